"""Block-scaled FP8 matmul on Hopper FP8 tensor cores (wgmma) through Mosaic GPU, warp-specialized.

`out = x @ w.T` for rows quantized per token group and a weight quantized per 128 x 128 block
(`fp8_matmul_reference`), the DeepGEMM scheme: each output tile walks the contraction one scale
block (128 features) at a time; a wgmma multiplies the block's FP8 tiles into a fresh float32
accumulator, which is then scaled by both operands' scales of that block and added to the tile's
running float32 sum in registers. A memory warpgroup streams the operands' blocks by TMA while two
compute warpgroups each multiply and scale their 64 rows of the tile, so one warpgroup's scaling
overlaps the other's product and neither waits on the copies.

The kernel multiplies an A [Ma, K] by a B [Nb, K], both K-major as FP8 wgmma requires, each with
one scale per row and 128-deep block ([K / 128, Ma] and [K / 128, Nb]). For prefill A is the rows
and B the weight ([out, in], Hugging Face's layout); for decode (`MosaicFp8Tiling.swap`) A is the
weight, so its many output features fill the wgmma's 64-row side and the few rows its narrow side,
and the contraction can be split over programs (their float32 partials summed after) so that
every SM streams weights. With `MosaicFp8Tiling.cluster`, two programs of a cluster take
neighbouring A tiles of one B tile and each loads half of every B block for both (TMA multicast),
so B crosses the L2 once per pair. Each program walks its tiles in turn; their pipelines can be
chained (`MosaicFp8Tiling.chain`, which the batched table takes): the memory warpgroup then
loads the next tile's first blocks while the compute warpgroups finish this tile and store it.
Runs on NVIDIA Hopper GPUs, or on CPU in the Mosaic GPU interpreter (JAX >= 0.12), which runs
each tile's pipeline on its own: chained, the interpreter's threads wait on each other forever
(JAX 0.12.0.1), where a compiled Hopper kernel runs them (benchmarks/RESULTS.md run 41).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import axes
from .reference import fp8_batched_matmul_reference, fp8_matmul_reference
from .tuned_block_sizes import COMPUTE_WARPGROUPS, NUM_SMS, SCALE_BLOCK, WGMMA_ROWS, MosaicFp8Tiling

_SMS = "sm"
_WG = "wg"
_CLUSTER = "cluster"
# FP8 operand blocks are 128 bytes deep: TMA writes them in 8-row tiles with the 128-byte swizzle
# that wgmma reads.
_OPERAND_TRANSFORMS = (plgpu.TilingTransform((8, SCALE_BLOCK)), plgpu.SwizzleTransform(128))


def _fp8_matmul_kernel(
    a_gmem,  # [G * Ma, K]
    b_gmem,  # [G * Nb, K]
    a_scales_gmem,  # [K / 128, G * Ma]
    b_scales_gmem,  # [K / 128, G * Nb]
    out_gmem,  # [split_k, G * Ma, Nb]
    *,
    tiling: MosaicFp8Tiling,
    groups: int,
    programs: int,
    chain: bool,
):
    k = a_gmem.shape[1]
    ma, nb = a_gmem.shape[0] // groups, b_gmem.shape[0] // groups
    tile_a, tile_b = tiling.tile_a, tiling.tile_n
    # Each compute warpgroup's share of a tile: (its A rows, its B rows) within the tile.
    wg_a = WGMMA_ROWS
    wg_b = tile_b // COMPUTE_WARPGROUPS if tiling.split_columns else tile_b
    pair = 2 if tiling.cluster else 1
    grid = (ma // (tile_a * pair), nb // tile_b)
    steps = k // SCALE_BLOCK // tiling.split_k
    tiles = grid[0] * grid[1]
    # Consecutive units chain their pipelines (the memory warpgroup loads the next unit's blocks
    # while the compute warpgroups finish this one) where every program has two units or more
    # and the pipeline's slots wrap evenly at a unit's end.
    chained = (
        chain
        and groups * tiling.split_k * tiles >= 2 * programs
        and steps % min(steps, tiling.max_concurrent_steps) == 0
    )

    def shares():
        """This warpgroup's A rows and B rows within the tile."""
        wg = lax.axis_index(_WG)
        if tiling.split_columns:
            return pl.ds(0, wg_a), pl.ds(wg * wg_b, wg_b)
        return pl.ds(wg * wg_a, wg_a), pl.ds(0, wg_b)

    def step(_, a_smem, b_smem, a_scales_smem, b_scales_smem, total):
        a_rows, b_rows = shares()

        def block(acc_ref):
            plgpu.wgmma(acc_ref, a_smem.at[a_rows], b_smem.at[b_rows].transpose((1, 0)))
            return acc_ref[...]

        partial = pl.run_scoped(block, plgpu.ACC((wg_a, wg_b), jnp.float32))
        row_scales = plgpu.load(a_scales_smem.at[0, a_rows], layout=plgpu.Layout.WGMMA.reduce(1))
        column_scales = plgpu.load(b_scales_smem.at[0, b_rows], layout=plgpu.Layout.WGMMA.reduce(0))
        shape = (wg_a, wg_b)
        scales = lax.broadcast_in_dim(row_scales, shape, [0]) * lax.broadcast_in_dim(
            column_scales, shape, [1]
        )
        return total + partial * scales

    def pipeline(body, compute_context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (tile_a, SCALE_BLOCK), lambda d: (0, d), transforms=_OPERAND_TRANSFORMS
                ),
                plgpu.BlockSpec(
                    (tile_b, SCALE_BLOCK),
                    lambda d: (0, d),
                    transforms=_OPERAND_TRANSFORMS,
                    collective_axes=(_CLUSTER,) if tiling.cluster else (),
                ),
                plgpu.BlockSpec((1, tile_a), lambda d: (d, 0)),
                plgpu.BlockSpec((1, tile_b), lambda d: (d, 0)),
            ],
            wg_axis=_WG,
            num_compute_wgs=COMPUTE_WARPGROUPS,
            max_concurrent_steps=tiling.max_concurrent_steps,
            compute_context=compute_context,
            pipeline_state=state,
        )

    ignore = lambda *_, **__: None  # noqa: E731 (allocations do not depend on the functions)
    operands = (a_gmem, b_gmem, a_scales_gmem, b_scales_gmem)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(*operands),
        out_smem=plgpu.SMEM((COMPUTE_WARPGROUPS, wg_a, wg_b), out_gmem.dtype),
        collective_axes=_WG,
    )
    def _scope(allocations, out_smem):
        # Units in order (group, split part, tile): the programs running at once share a
        # group's B operand (an expert's weight) in the L2.
        @plgpu.nd_loop((groups * tiling.split_k * tiles,), collective_axes=_SMS)
        def _unit(info: plgpu.NDLoopInfo):
            state = None
            if chained:
                state = jnp.where(
                    info.local_index == 0,
                    int(plgpu.PipelinePipeline.START),
                    jnp.where(
                        info.local_index == info.num_local_steps - 1,
                        int(plgpu.PipelinePipeline.STOP),
                        int(plgpu.PipelinePipeline.STEADY),
                    ),
                )
            group, rest = (
                lax.div(info.index[0], tiles * tiling.split_k),
                lax.rem(info.index[0], tiles * tiling.split_k),
            )
            part, tile = lax.div(rest, tiles), lax.rem(rest, tiles)
            a_tile, b_tile = plgpu.planar_snake(tile, grid, 1, tiling.grid_block_n)
            if tiling.cluster:
                a_tile = a_tile * 2 + lax.axis_index(_CLUSTER)
            a_rows = pl.ds(group * ma + a_tile * tile_a, tile_a)
            b_rows = pl.ds(group * nb + b_tile * tile_b, tile_b)
            depth = pl.ds(part * steps * SCALE_BLOCK, steps * SCALE_BLOCK)
            blocks = pl.ds(part * steps, steps)

            def compute_context(run):
                wg = lax.axis_index(_WG)
                zeros = jnp.full((wg_a, wg_b), 0, jnp.float32)
                total = run(plgpu.layout_cast(zeros, plgpu.Layout.WGMMA))
                # The previous unit's store has read its staging buffer: that store ran while
                # this unit multiplied.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_smem[wg] = total.astype(out_smem.dtype)
                plgpu.commit_smem()
                own_a, own_b = shares()
                rows = pl.ds(a_rows.start + own_a.start, wg_a)
                columns = pl.ds(b_tile * tile_b + own_b.start, wg_b)
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[part, rows, columns])

            pipeline(step, compute_context, state)(
                a_gmem.at[a_rows, depth],
                b_gmem.at[b_rows, depth],
                a_scales_gmem.at[blocks, a_rows],
                b_scales_gmem.at[blocks, b_rows],
                allocations=allocations,
            )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "interpret"))
def fp8_matmul_mosaic(
    x_values: jax.Array,  # [M, K] or [G, M, K] float8_e4m3fn
    x_scales: jax.Array,  # [M, K / 128] or [G, M, K / 128] float32
    w_values: jax.Array,  # [N, K] or [G, N, K] float8_e4m3fn
    w_scales: jax.Array,  # [N / 128, K / 128] or [G, N / 128, K / 128] float32
    *,
    out_dtype: jnp.dtype,
    tiling: MosaicFp8Tiling,
    interpret: object = None,
) -> jax.Array:
    """`fp8_matmul_reference` through the Mosaic GPU wgmma kernel, with an explicit tiling; with
    a leading group axis on every operand, one product per group in one kernel
    (`fp8_batched_matmul_reference`: experts padded to a capacity).

    Shapes are checked by `fp8_matmul` / `fp8_batched_matmul`; rows are padded to whole tiles
    (zero rows with zero scales, which add nothing). Not differentiable: FP8 weights are for
    inference.

    Args:
      interpret: None to compile for the GPU, or Mosaic GPU interpret parameters (CPU).

    Returns:
      [M, N] (or [G, M, N]) in `out_dtype`, varying (inside `shard_map`) over the mesh axes the
      reference's output would.
    """
    batched = x_values.ndim == 3
    reference = fp8_batched_matmul_reference if batched else fp8_matmul_reference
    (varying,) = axes.reference_varying(
        functools.partial(reference, out_dtype=out_dtype), x_values, x_scales, w_values, w_scales
    )
    if not batched:
        x_values, x_scales, w_values, w_scales = (
            a[None] for a in (x_values, x_scales, w_values, w_scales)
        )
    groups, m, k = x_values.shape
    n = w_values.shape[1]
    pair = 2 if tiling.cluster else 1
    row_tile = tiling.tile_n if tiling.swap else tiling.tile_a * pair
    weight_tile = tiling.tile_a * pair if tiling.swap else tiling.tile_n
    if n % weight_tile or (k // SCALE_BLOCK) % tiling.split_k:
        raise ValueError(
            f"{tiling} needs N={n} a multiple of {weight_tile} and K={k} of "
            f"{SCALE_BLOCK * tiling.split_k}"
        )
    padded = pl.cdiv(m, row_tile) * row_tile
    if padded != m:
        x_values = jnp.pad(x_values, ((0, 0), (0, padded - m), (0, 0)))
        x_scales = jnp.pad(x_scales, ((0, 0), (0, padded - m), (0, 0)))
    blocks = k // SCALE_BLOCK
    # Per-row scales, [K / 128, G * rows]: a 128 x 128 weight block's scale for each of its rows.
    row_scales = jnp.moveaxis(x_scales, 2, 0).reshape(blocks, groups * padded)
    column_scales = jnp.moveaxis(jnp.repeat(w_scales, SCALE_BLOCK, axis=1), 2, 0)
    column_scales = column_scales.reshape(blocks, groups * n)
    rows, weights = x_values.reshape(groups * padded, k), w_values.reshape(groups * n, k)
    operands = (rows, weights, row_scales, column_scales)
    shape = (padded, n)
    if tiling.swap:
        operands, shape = (weights, rows, column_scales, row_scales), (n, padded)
    partial_dtype = jnp.float32 if tiling.split_k > 1 else out_dtype
    # One program per SM at most (a cluster of two per pair of SMs), each walking the (group,
    # split, tile) units with the grid's stride.
    units = groups * (shape[0] // (tiling.tile_a * pair)) * (shape[1] // tiling.tile_n)
    programs = min((tiling.programs or NUM_SMS) // pair, units * tiling.split_k)
    call = plgpu.kernel(
        functools.partial(
            _fp8_matmul_kernel,
            tiling=tiling,
            groups=groups,
            programs=programs,
            chain=tiling.chain and interpret is None,
        ),
        out_type=jax.ShapeDtypeStruct((tiling.split_k, groups * shape[0], shape[1]), partial_dtype),
        grid=(programs,),
        grid_names=(_SMS,),
        cluster=(pair,),
        cluster_names=(_CLUSTER,),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name=_WG,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
    parts = call(*operands)
    out = jnp.sum(parts, axis=0) if tiling.split_k > 1 else parts[0]
    out = out.reshape(groups, *shape)
    out = (jnp.swapaxes(out, 1, 2) if tiling.swap else out)[:, :m].astype(out_dtype)
    # Mosaic GPU types its output invariant; it varies as the reference's does.
    return axes.mark_varying(out if batched else out[0], varying)
