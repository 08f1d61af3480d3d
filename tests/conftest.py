"""Test set-up: a simulated 8-device CPU mesh and strict rank promotion, before any JAX work."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_terminal_summary(terminalreporter):
    """Prints how many pipeline cuts the binding sweep checked (reported by each worker)."""
    cuts = sum(
        value
        for report in terminalreporter.stats.get("passed", [])
        for name, value in report.user_properties
        if name == "cuts"
    )
    if cuts:
        terminalreporter.write_line(f"pipeline cuts checked at binding level: {cuts:,}")
