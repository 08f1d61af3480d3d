"""add_rms_norm on one GPU: Mosaic GPU kernel vs XLA's fusion of the reference vs a plain copy.

Run from the repository root on a GPU machine:
    python3 -m benchmarks.bench_add_rms_norm

Every variant is checked against the reference on the same inputs before it is timed. Bytes per
call: read x and residual, write normed and new residual (the weight is negligible).
"""

import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.common import header, kernel_ms, print_table, relative_error
from pallas_kernels import Impl, add_rms_norm, add_rms_norm_reference
from pallas_kernels.add_rms_norm import GpuLaunch, gpu_launch, mosaic_gpu_add_rms_norm

ROWS = (1, 16, 256, 4096, 32768)
HIDDEN = (4096, 8192)
DTYPE = jnp.bfloat16
L2_BYTES = 60 * 2**20
EPS = 1e-6

reference = jax.jit(functools.partial(add_rms_norm_reference, eps=EPS))
pallas_gpu = jax.jit(functools.partial(add_rms_norm, eps=EPS, impl=Impl.PALLAS_GPU))
pallas_triton = jax.jit(functools.partial(add_rms_norm, eps=EPS, impl=Impl.PALLAS_TRITON))
copy = jax.jit(lambda x, residual, weight: (-x, -residual))


def input_sets(rows: int, hidden: int) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """Enough random (x, residual, weight) sets that rotating through them spans 4 x the L2."""
    bytes_per_set = 4 * rows * hidden * jnp.dtype(DTYPE).itemsize
    count = max(1, min(16, math.ceil(4 * L2_BYTES / bytes_per_set)))
    keys = jax.random.split(jax.random.key(rows * 100003 + hidden), 2 * count + 1)
    weight = (1 + jax.random.normal(keys[-1], (hidden,), jnp.float32)).astype(DTYPE)
    return [
        (
            jax.random.normal(keys[2 * i], (rows, hidden), DTYPE),
            (3 * jax.random.normal(keys[2 * i + 1], (rows, hidden), jnp.float32)).astype(DTYPE),
            weight,
        )
        for i in range(count)
    ]


def memcpy_ceiling_tb_s() -> tuple[float, float] | None:
    """Device-to-device memcpy bandwidth through PyTorch (2 GiB read + 2 GiB written), in TB/s.

    Returns (by CUDA events, by the wall clock around a synchronize), each over 10 back-to-back
    copies, or None where PyTorch is not installed. Call it before JAX starts: measured after
    JAX had taken the GPU (run 2), one copy between events read an impossible 179 TB/s.
    """
    try:
        import torch
    except ImportError:
        return None
    source = torch.empty(2**30, dtype=torch.bfloat16, device="cuda:0").normal_()
    target = torch.empty_like(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    event_ms, wall_ms_ = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        began = time.perf_counter()
        start.record()
        for _ in range(10):
            target.copy_(source)
        end.record()
        torch.cuda.synchronize()
        wall_ms_.append((time.perf_counter() - began) * 1e3 / 10)
        event_ms.append(start.elapsed_time(end) / 10)
    assert torch.equal(target[:4096], source[:4096]), "memcpy did not copy"
    nbytes = 2 * source.numel() * source.element_size()
    del source, target
    torch.cuda.empty_cache()
    return nbytes / statistics.median(event_ms) / 1e9, nbytes / statistics.median(wall_ms_) / 1e9


def copy_ceiling_tb_s() -> float:
    """Bandwidth of a large XLA elementwise copy (2 GiB read + 2 GiB written), in TB/s."""
    big = jax.random.normal(jax.random.key(0), (2**30,), DTYPE)
    ms = kernel_ms(jax.jit(lambda a: -a), [(big,)], repeats=20)
    return 2 * big.nbytes / ms / 1e9


def sweep_launches(sets, rows: int, hidden: int) -> list[tuple]:
    """Times the Mosaic GPU kernel over launch shapes; returns table rows."""
    sms = jax.local_devices()[0].core_count
    vector = gpu_launch(rows, hidden, DTYPE).vector_size
    results = []
    for programs_per_sm in (4, None):
        for rows_per_step in (1, 2):
            steps = math.ceil(rows / rows_per_step)
            programs = steps if programs_per_sm is None else min(steps, programs_per_sm * sms)
            launch = GpuLaunch(programs, rows_per_step, vector)
            run = jax.jit(
                functools.partial(
                    mosaic_gpu_add_rms_norm, eps=EPS, unit_offset=False, launch=launch
                )
            )
            try:
                error = relative_error(run(*sets[0]), reference(*sets[0]))
                ms = kernel_ms(run, sets, repeats=20)
            except Exception as e:
                print(f"  launch {launch} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            tb_s = 4 * rows * hidden * 2 / ms / 1e9
            results.append(
                (
                    rows,
                    hidden,
                    programs_per_sm or "all",
                    rows_per_step,
                    programs,
                    ms * 1e3,
                    tb_s,
                    error,
                )
            )
    return results


def main() -> None:
    memcpy = memcpy_ceiling_tb_s()  # first: JAX takes most of the GPU's memory once it starts
    print(header("bench_add_rms_norm"))
    print(f"default launch at 32768 x 8192: {gpu_launch(32768, 8192, DTYPE)}")
    print(f"memcpy ceiling (torch, 2 GiB D2D; events, wall clock): {memcpy} TB/s")
    ceiling = copy_ceiling_tb_s()
    print(f"XLA copy ceiling (2 GiB -a): {ceiling:.2f} TB/s")

    variants = {"pallas": pallas_gpu, "xla": reference, "copy": copy, "triton": pallas_triton}
    table, sweep = [], []
    for hidden in HIDDEN:
        for rows in ROWS:
            sets = input_sets(rows, hidden)
            want = reference(*sets[0])
            times, errors = {}, {}
            for name, fn in variants.items():
                try:
                    if name != "copy":
                        errors[name] = relative_error(fn(*sets[0]), want)
                    times[name] = kernel_ms(fn, sets)
                except Exception as e:
                    print(f"  {name} {rows}x{hidden} failed: {type(e).__name__}: {str(e)[:300]}")
                    times[name] = float("nan")
            nbytes = 4 * rows * hidden * jnp.dtype(DTYPE).itemsize
            tb_s = {k: nbytes / v / 1e9 for k, v in times.items()}
            table.append(
                (
                    rows,
                    hidden,
                    times["pallas"] * 1e3,
                    tb_s["pallas"],
                    times["xla"] * 1e3,
                    tb_s["xla"],
                    times["copy"] * 1e3,
                    tb_s["copy"],
                    times["triton"] * 1e3,
                    times["xla"] / times["pallas"],
                    tb_s["pallas"] / tb_s["copy"],
                    times["xla"] / times["triton"],
                    errors.get("pallas", float("nan")),
                    errors.get("triton", float("nan")),
                )
            )
            if rows == max(ROWS):
                sweep += sweep_launches(sets, rows, hidden)
            del sets

    print("\nMosaic GPU launch sweep (bf16, time in us):")
    print_table(
        ("rows", "hidden", "programs/SM", "rows/step", "programs", "us", "TB/s", "rel err"), sweep
    )
    print(
        f"\nadd_rms_norm, bf16, CUPTI kernel time (us); XLA copy {ceiling:.2f} TB/s, "
        f"memcpy {memcpy} TB/s:"
    )
    print_table(
        (
            "rows",
            "hidden",
            "pallas us",
            "pallas TB/s",
            "xla us",
            "xla TB/s",
            "copy us",
            "copy TB/s",
            "triton us",
            "xla/pallas",
            "pallas/copy BW",
            "xla/triton",
            "pallas err",
            "triton err",
        ),
        table,
    )


if __name__ == "__main__":
    main()
