"""The `boundary-jax` command line: forward, generate, plan, train and the demo."""
