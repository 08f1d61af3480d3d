"""Fused all-reduce + add + RMSNorm on two GPUs of one process vs `psum` + XLA's add + norm.

Run from the repository root on a machine with two GPUs:
    python3 -m benchmarks.bench_fused_all_reduce

Each variant runs 32 boundaries, unrolled, inside one jitted `shard_map` (the normed output feeds
the next boundary as its partial sum, the new residual as its residual), so host dispatch is paid
once per 32 boundaries. Unrolled, not `lax.fori_loop`: on XLA:GPU each `while` iteration reads
its predicate back to the host, which cost ~25 us per iteration in run 1 and hid the kernels.
Correctness is checked on one boundary first; CUPTI splits the device time of two shapes by kernel.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.mosaic.gpu import profiler

from benchmarks.common import header, print_table, relative_error, wall_ms
from pallas_kernels import Impl, all_reduce_add_rms_norm

P = jax.sharding.PartitionSpec
ROWS = (1, 8, 64, 256, 2048)
HIDDEN = (4096, 8192)
DTYPE = jnp.bfloat16
BOUNDARIES = 32
AXIS = "tp"


def make_mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(jax.devices()[:2], (AXIS,))


@functools.cache
def boundary(mesh, impl: Impl | None, loop: bool):
    """A jitted shard_map running one boundary, or BOUNDARIES of them unrolled."""

    def step(x, residual, weight):
        return all_reduce_add_rms_norm(x, residual, weight, axis_name=AXIS, impl=impl)

    def body(x, residual, weight):
        x, residual, weight = x[0], residual[0], weight[0]
        for _ in range(BOUNDARIES if loop else 1):
            x, residual = step(x, residual, weight)
        return x[None], residual[None]

    spec = P(AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def inputs(mesh, rows: int, hidden: int):
    """Per-device partials, residuals and weights, all different across the two devices."""
    kx, kr, kw = jax.random.split(jax.random.key(rows * 7919 + hidden), 3)
    sharding = jax.sharding.NamedSharding(mesh, P(AXIS))
    x = jax.random.normal(kx, (2, rows, hidden), jnp.float32).astype(DTYPE)
    residual = (3 * jax.random.normal(kr, (2, rows, hidden), jnp.float32)).astype(DTYPE)
    weight = (1 + jax.random.normal(kw, (2, hidden), jnp.float32)).astype(DTYPE)
    return tuple(jax.device_put(a, sharding) for a in (x, residual, weight))


def psum_ceiling(mesh) -> tuple[float, float]:
    """(bus bandwidth of a 1 GiB psum in GB/s, us per 16 KiB psum in an unrolled jitted loop)."""
    spec = P(AXIS)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    big = jax.device_put(jax.random.normal(jax.random.key(1), (2, 2**29), DTYPE), sharding)
    psum = jax.jit(
        jax.shard_map(
            lambda a: lax.psum(a, AXIS), mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
        )
    )
    ms = wall_ms(psum, (big,), repeats=10)
    bus_gb_s = big.nbytes / 2 / ms / 1e6  # 2 (n - 1) / n of the buffer crosses a link; n = 2
    del big

    def chain(a):
        for _ in range(BOUNDARIES):
            a = lax.psum(a, AXIS) * 0.5
        return a

    small = jax.device_put(jax.random.normal(jax.random.key(2), (2, 8192), DTYPE), sharding)
    loop = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    return bus_gb_s, wall_ms(loop, (small,)) * 1e3 / BOUNDARIES


def kernel_breakdown(fn, args) -> list[tuple[str, float]]:
    """CUPTI device time per kernel name, in us per boundary per device (2 devices)."""
    jax.block_until_ready(fn(*args))
    _, kernels = profiler.measure(fn, aggregate=False)(*args)
    totals: dict[str, float] = {}
    for name, ms in kernels or ():
        totals[name[:70]] = totals.get(name[:70], 0.0) + ms * 1e3 / BOUNDARIES / 2
    return sorted(totals.items(), key=lambda item: -item[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--hidden", type=int, nargs="+", default=HIDDEN)
    args = parser.parse_args()
    print(header("bench_fused_all_reduce"))
    mesh = make_mesh()
    bus, small_us = psum_ceiling(mesh)
    print(
        f"psum 1 GiB bus bandwidth: {bus:.0f} GB/s; 16 KiB psum, unrolled loop: {small_us:.1f} us"
    )

    table = []
    for hidden in args.hidden:
        for rows in args.rows:
            operands = inputs(mesh, rows, hidden)
            want = boundary(mesh, Impl.XLA, loop=False)(*operands)
            row = {"rows": rows, "hidden": hidden}
            try:
                row["err"] = relative_error(
                    boundary(mesh, Impl.PALLAS_GPU, loop=False)(*operands), want
                )
                loop_fused = boundary(mesh, Impl.PALLAS_GPU, loop=True)
                loop_xla = boundary(mesh, Impl.XLA, loop=True)
                row["loop err"] = relative_error(loop_fused(*operands), loop_xla(*operands))
                row["fused"] = wall_ms(loop_fused, operands) * 1e3 / BOUNDARIES
            except Exception as e:
                print(f"  fused {rows}x{hidden} failed: {type(e).__name__}: {str(e)[:400]}")
                row.update(err=float("nan"), fused=float("nan"))
            row["xla"] = wall_ms(boundary(mesh, Impl.XLA, loop=True), operands) * 1e3 / BOUNDARIES
            row["default"] = wall_ms(boundary(mesh, None, loop=True), operands) * 1e3 / BOUNDARIES
            row["speedup"] = row["xla"] / row["fused"]
            for impl, key in ((Impl.PALLAS_GPU, "fused dev"), (Impl.XLA, "xla dev")):
                try:
                    parts = kernel_breakdown(boundary(mesh, impl, loop=True), operands)
                except Exception as e:
                    print(f"  CUPTI {impl.name} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                row[key] = sum(us for _, us in parts)
                if rows in (8, 2048) and hidden == 8192:
                    print(f"  CUPTI {impl.name} {rows}x{hidden}, us/boundary/device: {parts}")
            print(f"  {row}")
            table.append(row)

    keys = (
        "rows",
        "hidden",
        "fused",
        "xla",
        "speedup",
        "default",
        "fused dev",
        "xla dev",
        "err",
        "loop err",
    )
    print(f"\nall_reduce_add_rms_norm on 2 GPUs, bf16, us per boundary ({BOUNDARIES} unrolled):")
    print_table(
        (
            "rows",
            "hidden",
            "fused us",
            "psum+xla us",
            "speedup",
            "impl=None us",
            "fused kernel us",
            "psum+xla kernels us",
            "1-step rel err",
            "32-step rel err vs xla",
        ),
        [tuple(r.get(k, float("nan")) for k in keys) for r in table],
    )


if __name__ == "__main__":
    main()
