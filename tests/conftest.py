"""Test set-up: a simulated 8-device CPU mesh and strict rank promotion, before any JAX work."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
