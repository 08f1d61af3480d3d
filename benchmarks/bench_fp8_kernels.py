"""The FP8 kernels alone, parts "matmul" and "experts" of `benchmarks.bench_fp8` (which runs them
and prints their tables): one projection over the decode and prefill kernels' tilings, and the
padded MoE experts' two products over the batched wgmma kernel's tilings."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.fp8_matmul import (
    SWAP_MAX_ROWS,
    Fp8MatmulImpl,
    MosaicFp8Tiling,
    TritonFp8Tiling,
    fp8_batched_matmul,
    fp8_matmul,
)
from pallas_kernels.quantize import quantize_blocks_reference, quantize_token_groups_reference

from .common import relative_error

# -- part matmul -------------------------------------------------------------------------------

TRITON_SWEEP = (None,)
"""The decode kernel at its table's pick (`triton_fp8_tiling`); `--wide` sweeps a grid."""
WIDE_TRITON_SWEEP = tuple(
    TritonFp8Tiling(block_n=n, split_k=split, num_warps=warps, num_stages=stages)
    for n in (32, 64, 128)
    for split in (1, 2, 4, 8, 16)
    for warps in (4, 8)
    for stages in (3, 5)
)
"""`--wide`: the decode kernel's tilings as a grid (columns, split, warps, stages)."""
MOSAIC_SWEEP = (
    None,  # the table's pick (`mosaic_fp8_tiling`)
    MosaicFp8Tiling(tile_n=128, max_concurrent_steps=3, grid_block_n=4),
    MosaicFp8Tiling(tile_n=128, max_concurrent_steps=4, grid_block_n=8),
    MosaicFp8Tiling(tile_n=224, max_concurrent_steps=3, grid_block_n=2),
    MosaicFp8Tiling(tile_n=224, max_concurrent_steps=2, grid_block_n=2),
    MosaicFp8Tiling(tile_n=224, max_concurrent_steps=2, grid_block_n=2, chain=True),
    MosaicFp8Tiling(tile_n=224, max_concurrent_steps=3, grid_block_n=2, cluster=True),
    MosaicFp8Tiling(tile_n=192, max_concurrent_steps=4, grid_block_n=2),
    MosaicFp8Tiling(tile_n=192, max_concurrent_steps=4, grid_block_n=2, chain=True),
    MosaicFp8Tiling(tile_n=192, max_concurrent_steps=4, grid_block_n=2, cluster=True),
    MosaicFp8Tiling(tile_n=128, max_concurrent_steps=4, grid_block_n=4, cluster=True),
)
"""The Mosaic kernel above `SWAP_MAX_ROWS` rows (prefill: rows as A, the weight as B)."""


def mosaic_swap_sweep(rows: int) -> tuple[MosaicFp8Tiling | None, ...]:
    """The Mosaic kernel up to `SWAP_MAX_ROWS` rows (decode: the weight as A, the rows as one B
    tile): the table's pick, then splits and copies in flight around it."""
    tile = max(32, int(pl.next_power_of_2(rows)))
    return (None,) + tuple(
        MosaicFp8Tiling(tile_n=tile, max_concurrent_steps=steps, grid_block_n=1, split_k=split,
                        swap=True)
        for split in (1, 2, 4)
        for steps in (4, 8, 12)
    )  # fmt: skip


def matmul(
    k: int, n: int, rows_list, *, timed_ms: Callable, smoke: bool, wide: bool = False
) -> list[tuple]:
    """Part matmul: one [k -> n] projection at each row count, bf16 `jnp.dot` against the FP8
    forms and the kernels over their sweeps (`timed_ms(fn, arg_sets)` times one; `smoke`: the
    interpreted kernels, two tilings each)."""
    kw, kx = jax.random.split(jax.random.key(0))
    w = jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)
    w_values, w_scales = quantize_blocks_reference(w)
    w_bf16 = w.T.astype(jnp.bfloat16)
    del w
    triton = Fp8MatmulImpl.PALLAS_INTERPRET if smoke else Fp8MatmulImpl.PALLAS_TRITON
    mosaic = Fp8MatmulImpl.PALLAS_GPU_INTERPRET if smoke else Fp8MatmulImpl.PALLAS_GPU
    results = []
    for rows in rows_list:
        x = jax.random.normal(kx, (rows, k)).astype(jnp.bfloat16)
        x_values, x_scales = quantize_token_groups_reference(x)
        base = timed_ms(jax.jit(jnp.dot), [(x, w_bf16)])
        want = fp8_matmul(x_values, x_scales, w_values, w_scales, out_dtype=jnp.float32)
        variants = [
            ("bf16 jnp.dot", None, None),
            ("fp8 XLA reference (float32)", Fp8MatmulImpl.XLA, None),
            ("fp8 dequantized to bf16", Fp8MatmulImpl.DEQUANTIZED_BF16, None),
        ]
        sweeps = (TRITON_SWEEP[:1], MOSAIC_SWEEP[:2]) if smoke else (TRITON_SWEEP, MOSAIC_SWEEP)
        if wide:  # the decode kernel alone
            sweeps = (WIDE_TRITON_SWEEP[:2] if smoke else WIDE_TRITON_SWEEP, ())
        if rows <= 512:  # the decode kernel re-reads the weights per 64 rows
            variants += [(f"fp8 triton {t or 'table'}", triton, t) for t in sweeps[0]]
        if not wide:
            mosaic_sweep = mosaic_swap_sweep(rows) if rows <= SWAP_MAX_ROWS else sweeps[1]
            if smoke:  # the table's pick and one more: each interpreted call takes a second
                mosaic_sweep = mosaic_sweep[:2]
            variants += [
                (f"fp8 mosaic {_tiling_label(t)}", mosaic, t)
                for t in mosaic_sweep
                if t is None or t.swap or n % t.tile_n == 0
            ]
        for name, impl, tiling in variants[1:]:
            args = (x_values, x_scales, w_values, w_scales)
            timed = _checked(fp8_matmul, impl, tiling, args, want, timed_ms, f"{name} @ {rows}")
            if timed is None:
                continue
            ms, error = timed
            tb_s = (w_values.nbytes + w_scales.nbytes) / ms / 1e9
            tflop_s = 2 * rows * k * n / ms / 1e9
            results.append((rows, name, ms * 1e3, base / ms, tb_s, tflop_s, error))
            print(results[-1], flush=True)
        results.append((rows, variants[0][0], base * 1e3, 1.0, 2 * k * n / base / 1e9, 0.0, 0.0))
    return results


# -- part experts ------------------------------------------------------------------------------

EXPERTS_SWEEP = (
    None,  # the table's pick (`mosaic_fp8_batched_tiling`)
    MosaicFp8Tiling(tile_n=256, max_concurrent_steps=4, grid_block_n=1, split_columns=True),
    MosaicFp8Tiling(
        tile_n=256, max_concurrent_steps=4, grid_block_n=1, split_columns=True, chain=True
    ),
    MosaicFp8Tiling(tile_n=256, max_concurrent_steps=3, grid_block_n=1, split_columns=True),
    MosaicFp8Tiling(
        tile_n=256, max_concurrent_steps=3, grid_block_n=1, split_columns=True, chain=True
    ),
    MosaicFp8Tiling(tile_n=192, max_concurrent_steps=4, grid_block_n=1, split_columns=True),
    MosaicFp8Tiling(tile_n=192, max_concurrent_steps=4, grid_block_n=1),
    MosaicFp8Tiling(tile_n=192, max_concurrent_steps=4, grid_block_n=1, chain=True),
    MosaicFp8Tiling(tile_n=128, max_concurrent_steps=4, grid_block_n=2),
)
"""The batched kernel's tilings for experts padded to a capacity (rows split between the
warpgroups only where the capacity is a multiple of 128). Dropped after run 41 (an H100), where
each was slower than the 256-wide split tiles at every shape or did not fit: 2 or 6 steps in
flight (6 exceeds shared memory), 2 column blocks per grid step, 128-wide split tiles and
clusters."""


def experts(
    capacities, *, groups: int, hidden: int, width: int, timed_ms: Callable, smoke: bool
) -> list[tuple]:
    """The padded experts' two products alone ([groups, capacity, hidden] -> 2 x width, then
    width -> hidden): the bf16 layer's batched matmul, the FP8 weights dequantized to bf16, and
    the batched wgmma kernel over `EXPERTS_SWEEP`, each checked against XLA's FP8 reference."""
    mosaic = Fp8MatmulImpl.PALLAS_GPU_INTERPRET if smoke else Fp8MatmulImpl.PALLAS_GPU
    results = []
    for capacity in capacities:
        for name, k, n in (("gate|up", hidden, 2 * width), ("down", width, hidden)):
            kx, kw = jax.random.split(jax.random.key(capacity + k))
            x = jax.random.normal(kx, (groups, capacity, k)).astype(jnp.bfloat16)
            w = (jax.random.normal(kw, (groups, n, k)) / np.sqrt(k)).astype(jnp.bfloat16)
            args = (*quantize_token_groups_reference(x), *quantize_blocks_reference(w))
            want = fp8_batched_matmul(*args, out_dtype=jnp.float32)
            w_t = jnp.swapaxes(w, 1, 2)
            base = timed_ms(jax.jit(lambda x, w: jnp.einsum("gck,gkn->gcn", x, w)), [(x, w_t)])
            flops = 2 * groups * capacity * k * n
            case = f"{name} [{groups} x {capacity}, {k} -> {n}]"
            results.append((case, "bf16 batched einsum", base * 1e3, 1.0, flops / base / 1e9, 0.0))
            variants = [("fp8 dequantized to bf16", Fp8MatmulImpl.DEQUANTIZED_BF16, None)]
            sweep = EXPERTS_SWEEP[:2] if smoke else EXPERTS_SWEEP
            variants += [(f"fp8 mosaic {_tiling_label(t)}", mosaic, t) for t in sweep]
            for label, impl, tiling in variants:
                if tiling is not None and (n % tiling.tile_n or capacity % tiling.tile_a):
                    continue
                timed = _checked(
                    fp8_batched_matmul, impl, tiling, args, want, timed_ms, f"{label} @ {case}"
                )
                if timed is None:
                    continue
                ms, error = timed
                results.append((case, label, ms * 1e3, base / ms, flops / ms / 1e9, error))
                print(results[-1], flush=True)
    return results


def _checked(product, impl, tiling, args, want, timed_ms, label) -> tuple[float, float] | None:
    """(ms, error against `want`) of `product(*args)` jitted with `impl` and `tiling`, bf16 out;
    None, with a line saying why, where it fails (one failing tiling must not end the run)."""
    fn = jax.jit(lambda *a: product(*a, out_dtype=jnp.bfloat16, impl=impl, tiling=tiling))
    try:
        return timed_ms(fn, [args]), relative_error(fn(*args), want)
    except Exception as failure:
        print(f"  {label}: {type(failure).__name__}: {str(failure)[:400]}")
        return None


def _tiling_label(tiling: MosaicFp8Tiling | None) -> str:
    """A Mosaic tiling in a few characters: B tile rows / steps in flight / B tiles per grid
    step, and its options."""
    if tiling is None:
        return "table"
    options = [name for name in ("swap", "cluster", "split_columns") if getattr(tiling, name)]
    if tiling.chain:
        options.append("chained")
    if tiling.split_k > 1:
        options.append(f"split_k={tiling.split_k}")
    steps = f"{tiling.tile_n}/{tiling.max_concurrent_steps}/{tiling.grid_block_n}"
    return " ".join([steps, *options])
