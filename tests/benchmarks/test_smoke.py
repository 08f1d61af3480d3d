"""The benchmarks' smoke modes run to completion on CPU, in a fresh process, and print their tables.

Each runs as a user runs it (`python -m benchmarks.X --smoke`) on one CPU device or on simulated
ones (JAX_NUM_CPU_DEVICES), with the suite's XLA flags from `conftest.py` inherited. The
interpreted GEMM one runs by default; the rest are `slow` (`-m slow`).
"""

import itertools
import os
import pathlib
import subprocess
import sys

import pytest

from pallas_kernels import compat

ROOT = pathlib.Path(__file__).resolve().parents[2]
SLOW = pytest.mark.slow


def run_smoke(module: str, *args: str, devices: int = 1) -> str:
    """stdout of `python -m benchmarks.<module> <args>` on `devices` CPU devices; fails on a
    non-zero exit, showing the end of stderr."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)}
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-4000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    return result.stdout


def table_rows(stdout: str, column: str) -> list[list[str]]:
    """The cells of each row of the Markdown table (`common.print_table`) that has a `column`."""
    lines = stdout.splitlines()
    for index, line in enumerate(lines[:-1]):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("|") and column in cells and lines[index + 1].startswith("|-"):
            rows = itertools.takewhile(lambda row: row.startswith("|"), lines[index + 2 :])
            return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    raise AssertionError(f"no table with a {column!r} column in:\n{stdout[-4000:]}")


@SLOW
@pytest.mark.parametrize("devices", [1, 2])
def test_e2e_smoke_runs_every_tp_the_devices_hold(devices):
    """bench_e2e --smoke times a prefill and a decode case at TP 1, and at TP 2 where two
    devices exist (both baselines' prefill logits within bf16 error of the project's), then
    runs the generate() check."""
    out = run_smoke("bench_e2e", "--smoke", devices=devices)
    rows = table_rows(out, "project ms")
    want = [
        (f"2L TP{tp}", case) for tp in (1, 2)[:devices] for case in ("prefill 32", "decode 4 @ 16")
    ]
    assert [(row[0], row[1]) for row in rows] == want, out
    errors = [float(e) for row in rows if row[1].startswith("prefill") for e in row[-1].split("/")]
    assert len(errors) == 2 * devices and max(errors) < 2e-2, errors
    assert "generate(): 2 prompts of 8 tokens" in out
    assert ("TP [2] left out" in out) == (devices == 1)


@SLOW
def test_ssd_smoke_compares_the_two_forms():
    """bench_ssd --smoke prints the scan against its chunked forms."""
    rows = table_rows(run_smoke("bench_ssd", "--smoke"), "rel err vs lax.scan")
    assert [row[0] for row in rows] == ["lax.scan, row by row", "chunked", "chunked"]


def test_gemm_smoke_checks_the_interpreted_kernel():
    """bench_gemm --smoke runs the split-K kernel interpreted and prints its error."""
    out = run_smoke("bench_gemm", "--smoke")
    (line,) = [line for line in out.splitlines() if line.startswith("smoke rel err")]
    assert float(line.split()[-1]) < 1e-3, line


# bench_fp8's Mosaic GPU kernels run where JAX interprets them: the padded experts' layer in part
# moe beside the XLA one, two of part experts' four variants per product.
INTERPRETS = compat.gpu_interpret_params() is not None
FP8_MOE_ROWS = 1 + INTERPRETS
SLOW_SMOKES = {
    # id: (module, arguments, devices, {a column of each table it prints: rows of that table})
    "e2e-fp8": ("bench_e2e", ("--smoke", "--quantize", "fp8"), 1, {"fp8 logits vs XLA fp8": 2}),
    "fp8": (
        "bench_fp8",
        ("--smoke",),
        1,
        {
            "fp8 logits vs XLA fp8": 2,
            "fp8 vs XLA fp8": FP8_MOE_ROWS,
            "err vs fp8 reference": 8 if INTERPRETS else 4,
            "rel err vs XLA fp8": 12,
        },
    ),
    "moe": ("bench_moe", ("--smoke",), 1, {"grouped matmul": 8, "fused us": 1}),
    "moe-fp8": ("bench_moe", ("--smoke", "--fp8"), 1, {"fp8 vs XLA fp8": FP8_MOE_ROWS}),
    "nemotron-h": ("bench_nemotron_h", ("--smoke",), 1, {"logit err": 2, "rel err": 2}),
    "delta-rule": ("bench_delta_rule", ("--smoke",), 1, {"rel err vs lax.scan": 18}),
    "qwen3-next": ("bench_qwen3_next", ("--smoke",), 1, {"logit err": 2}),
    "deepseek": ("bench_deepseek", ("--smoke",), 1, {"GSPMD ms": 4}),
    "gpt-oss": ("bench_gpt_oss", ("--smoke",), 1, {"GSPMD ms": 4}),
    "init": ("bench_init", ("--smoke",), 1, {"compile s": 2}),
    "train-1-device": ("bench_train", ("--smoke",), 1, {"gspmd ms": 1}),
    "train-2-devices": ("bench_train", ("--smoke",), 2, {"gspmd ms": 1}),
}


@SLOW
@pytest.mark.parametrize("case", sorted(SLOW_SMOKES))
def test_slow_smoke_prints_its_tables(case):
    """The smoke mode exits 0 and prints each of its tables, whole."""
    module, args, devices, tables = SLOW_SMOKES[case]
    out = run_smoke(module, *args, devices=devices)
    assert {column: len(table_rows(out, column)) for column in tables} == tables, out


@SLOW
def test_overlap_smoke_reports_one_batch_against_tbo():
    """bench_overlap --smoke (8 simulated devices of its own) compares one batch with TBO."""
    out = run_smoke("bench_overlap", "--smoke")
    assert "layers 2, dp 1 x tp 2, 4 x 16 tokens: one batch" in out, out


@SLOW
def test_pipeline_smoke_reports_both_programs():
    """bench_pipeline --smoke (8 simulated devices of its own) times MPMD and SPMD stages."""
    out = run_smoke("bench_pipeline", "--smoke").splitlines()
    assert any(line.startswith("MPMD (a program per stage)") for line in out), out
    assert any(line.startswith("SPMD (switch + ppermute)") for line in out), out


@SLOW
def test_lora_smoke_times_the_base_and_lora_steps():
    """bench_lora --smoke times the base and the multi-LoRA decode step of one model; the
    adapters change the greedy tokens."""
    rows = table_rows(run_smoke("bench_lora", "--smoke"), "LoRA / base")
    assert [(row[1], row[2]) for row in rows] == [("decode 4 @ 16", "8 x r16")]
    assert rows[0][-1] != "0%", rows


@SLOW
def test_serve_smoke_reports_engine_and_static():
    """bench_serve --smoke serves 16 requests through the engine and times the static
    generate of the same requests, the same load penalized (no prefix reused), and the
    shared-prefix load with reuse off and on; the warm-up compiles every step program the runs
    use."""
    out = run_smoke("bench_serve", "--smoke")
    rows = table_rows(out, "output tok/s")
    assert rows[0][0].startswith("engine (") and rows[1][0] == "static generate", out
    assert rows[2][0].startswith("engine, penalized (") and int(rows[2][7]) == 0, out
    assert rows[3][0].startswith("prefix 8, reuse off") and int(rows[3][7]) == 0, out
    assert rows[4][0].startswith("prefix 8, reuse on") and int(rows[4][7]) > 0, out
    warmed = int(out.split("warm-up: ")[1].split()[0])
    assert f"{warmed} step programs" in out, out


@SLOW
def test_paged_attention_smoke_matches_the_reference():
    """bench_paged_attention --smoke runs the interpreted Pallas paged kernel on a decode and a
    mixed step, and it matches the jnp reference on both."""
    rows = table_rows(run_smoke("bench_paged_attention", "--smoke"), "max diff vs jnp")
    assert [row[2] for row in rows] == ["kernel 16/16", "jnp"] * 2, rows
    assert [row[0].split()[0] for row in rows] == ["decode"] * 2 + ["mixed"] * 2, rows
    assert all(float(row[-1]) < 1e-5 for row in rows), rows
