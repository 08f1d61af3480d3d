"""Test set-up: a simulated 8-device CPU mesh and strict rank promotion, before any JAX work."""

import gc
import os
import sys

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    # Most of a CPU test's time is LLVM compiling XLA's kernels. At the tests' tiny shapes
    # unoptimized machine code costs nothing at run time and saves about a third of the suite's
    # time; the HLO (collectives, fusions) the tests read is optimized as before.
    os.environ["XLA_FLAGS"] = " ".join(
        (
            os.environ.get("XLA_FLAGS", ""),
            "--xla_backend_optimization_level=0",
            "--xla_llvm_disable_expensive_passes=true",
        )
    ).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Sends each module's tests to one xdist worker, except those a test groups itself.

    A module's tests share its cached models and compiled programs; spread over both workers,
    each worker loaded, traced and compiled them again. (First, before xdist's own hook reads
    the groups into the test ids.)
    """
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def mapped_regions() -> tuple[int, int]:
    """This process's memory mappings and the kernel's limit on them (0, 0 where unknown)."""
    try:
        with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 0


@pytest.fixture(autouse=True, scope="module")
def release_compiled_code():
    """Frees the compiled executables when a module ends with the process's mappings past half
    the kernel's limit.

    XLA's CPU backend maps a few memory regions per executable. A worker that kept every
    executable of its half of the suite reached the limit of mappings per process
    (vm.max_map_count, 65530) after about 800 tests, and the next compilation segfaulted.
    Releasing only past half the limit keeps the compilations that later modules share; the
    test modules' cached functions and JAX's caches are then cleared together.
    """
    yield
    regions, limit = mapped_regions()
    if regions < limit // 2:
        return
    tests = os.path.dirname(__file__)
    for module in list(sys.modules.values()):
        if not (getattr(module, "__file__", None) or "").startswith(tests):
            continue
        for value in vars(module).values():
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
