"""The benchmarks' shared helpers that decide what a table shows."""

import gzip
import json

import jax
import pytest

from benchmarks import common
from benchmarks.common import OUT_OF_MEMORY, Cases, hbm_bytes_per_s, header, or_out_of_memory, ratio
from benchmarks.name_kernels import moved_bytes, trace_ops


def _raise(message: str):
    def call():
        raise jax.errors.JaxRuntimeError(message)

    return call


def test_an_out_of_memory_contender_is_reported_and_the_run_goes_on():
    assert or_out_of_memory(lambda: 1.5) == 1.5
    assert (
        or_out_of_memory(_raise("RESOURCE_EXHAUSTED: Out of memory allocating 62.00GiB")) == "OOM"
    )
    assert OUT_OF_MEMORY == "OOM"
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        or_out_of_memory(_raise("INTERNAL: a kernel failed"))


def test_ratios_leave_out_what_was_not_measured():
    assert ratio(3.0, 1.5) == 2.0
    assert ratio(OUT_OF_MEMORY, 1.5) == "-"
    assert ratio(3.0, OUT_OF_MEMORY) == "-"


def test_named_decode_cases_set_the_decode_sizes():
    """Decode cases named on the command line are timed even where the defaults leave them out;
    prefill names and no names keep the defaults."""
    cases = Cases()
    named = cases.naming(["decode 16 @ 1024", "decode 32 @ 4096", "prefill 4096"])
    assert named.decode_sequences == (16, 32) and named.decode_caches == (1024, 4096)
    assert ("decode 32 @ 4096", 32, 4096) in named.decodes()
    assert named.prefills() == cases.prefills()
    assert cases.naming(None) == cases and cases.naming(["prefill 512"]) == cases
    for wrong in ("decode 16", "decode 16 at 1024", "decode x @ 1024"):
        with pytest.raises(ValueError, match="decode <sequences> @ <cache>"):
            cases.naming([wrong])


def test_an_instructions_bytes_are_its_outputs_and_operands():
    text = (
        "(bf16[8,4096]{1,0}, f32[8]{0}) fusion(bf16[8,4096]{1,0} %p0, s32[4096]{0} %p1), "
        'kind=kLoop, calls=%fused, metadata={op_name="f32[9]"}'
    )
    assert moved_bytes(text) == 2 * (8 * 4096 * 2) + 8 * 4 + 4096 * 4


def test_operands_named_without_a_shape_are_looked_up():
    instructions = {
        "p0": ("bf16[8,4096]{1,0} parameter(0)", ""),
        "w": ("bf16[4096,1024]{1,0} parameter(1)", ""),
    }
    text = "bf16[8,1024]{1,0} fusion(%p0, %w), kind=kCustom, calls=%gemm"
    assert moved_bytes(text, instructions) == 2 * (8 * 1024 + 8 * 4096 + 4096 * 1024)


def test_the_roofline_bandwidth_is_the_faster_copy_measured_once(monkeypatch):
    """The decode roofline divides by the faster of the two copies, timed once per process and
    printed in every benchmark's header."""
    hbm_bytes_per_s.cache_clear()
    calls = []
    monkeypatch.setattr(common, "kernel_ms", lambda *a, **k: calls.append("pass") or 2.0)
    monkeypatch.setattr(common, "median_wall_ms", lambda *a, **k: calls.append("copy") or 0.5)
    try:
        bandwidth = hbm_bytes_per_s()
        assert bandwidth == 2 * 2**22 / 0.5e-3  # the memcpy's 0.5 ms, not the pass's 2 ms
        assert "HBM roofline: 0.02 TB/s" in header("x")
        assert calls == ["pass", "copy"]  # the header reused the measurement
    finally:
        hbm_bytes_per_s.cache_clear()


def test_kernels_a_trace_leaves_without_a_module_count_under_the_case_s_module(tmp_path):
    """A GPU stream's kernel without `hlo_module` counts under the module of the case's other
    kernels; host events without one, and the XLA Ops line's copies, are left out."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "Stream #8"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "XLA Ops"}},
    ]
    module = {"hlo_module": "jit_body"}
    kernels = [
        {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "dur": 300, "args": module},
        {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "dur": 300, "args": module},
        {"ph": "X", "pid": 1, "tid": 8, "name": "branch_kernel", "dur": 500, "args": {}},
        {"ph": "X", "pid": 1, "tid": 8, "name": "branch_kernel", "dur": 700, "args": {}},
        {"ph": "X", "pid": 1, "tid": 9, "name": "branch_kernel", "dur": 900, "args": {}},
        {"ph": "X", "pid": 2, "tid": 1, "name": "PjitFunction", "dur": 4000, "args": {}},
    ]
    folder = tmp_path / "case" / "plugins"
    folder.mkdir(parents=True)
    with gzip.open(folder / "t.trace.json.gz", "wt") as stream:
        json.dump({"traceEvents": meta + kernels}, stream)
    assert trace_ops(tmp_path / "case", calls=2) == {
        ("jit_body", "gemm"): [0.3, 1.0],
        ("jit_body", "branch_kernel"): [0.6, 1.0],
    }
