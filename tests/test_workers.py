"""How `./run test` spreads the suite over its xdist workers."""

import pytest


def test_each_module_runs_as_one_xdist_group(request):
    """Under `--dist loadgroup` this test's id carries its module's group: xdist reads it to keep
    a module's tests (and the models and programs they cache) on one worker, and the tests
    marked `xdist_group("multiprocess")` one after another. pytest 9.2 dropped the id xdist
    writes (pytest-dev/pytest-xdist#1386), and every group silently did nothing."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("checks ./run test's --dist loadgroup")
    assert request.node.nodeid.endswith("@tests/test_workers.py"), request.node.nodeid
