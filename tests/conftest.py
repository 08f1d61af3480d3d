"""Test set-up: a simulated 8-device CPU mesh and strict rank promotion, before any JAX work."""

import gc
import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True, scope="module")
def release_compiled_code(request):
    """Frees a test module's compiled executables when the module ends.

    XLA's CPU backend maps a few memory regions per executable. A worker that kept every
    executable of its half of the suite reached the kernel's limit of mappings per process
    (vm.max_map_count, 65530) after about 800 tests, and the next compilation segfaulted.
    Functions a module shares between its tests stay shared within the module.
    """
    yield
    for value in vars(request.module).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    jax.clear_caches()
    gc.collect()


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
