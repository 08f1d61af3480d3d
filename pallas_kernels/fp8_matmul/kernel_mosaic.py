"""Block-scaled FP8 matmul for prefill: Hopper FP8 tensor cores (wgmma) through Mosaic GPU.

`out = x @ w.T` for rows quantized per token group and a weight quantized per 128 x 128 block
(`fp8_matmul_reference`), the DeepGEMM scheme: each output tile walks the contraction one scale
block (128 features) at a time; a wgmma multiplies the block's FP8 tiles into a fresh float32
accumulator, which is then scaled by the rows' and the weight columns' scales of that block and
added to the tile's running float32 sum in registers. Both operands are K-major, as FP8 wgmma
requires (the weight is [out, in], Hugging Face's layout). The weight scales are expanded to
one per column ([K / 128, N]) before the kernel, so a step loads a row of them like the rows'
scales. Runs on NVIDIA Hopper GPUs, or on CPU in the Mosaic GPU interpreter (JAX >= 0.12).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import axes
from .reference import fp8_matmul_reference
from .tuned_block_sizes import SCALE_BLOCK, MosaicFp8Tiling

_SMS = "sm"
NUM_SMS = 132
"""Programs launched (an H200's SMs); each walks output tiles with this stride."""


def _fp8_matmul_kernel(
    x_values_gmem,  # [M, K]
    w_values_gmem,  # [N, K]
    x_scales_gmem,  # [K / 128, M]
    w_scales_gmem,  # [K / 128, N]
    out_gmem,  # [M, N]
    *,
    tiling: MosaicFp8Tiling,
):
    m, k = x_values_gmem.shape
    n = w_values_gmem.shape[0]
    tile_m, tile_n = tiling.tile_m, tiling.tile_n
    grid = (m // tile_m, n // tile_n)

    @plgpu.nd_loop((grid[0] * grid[1],), collective_axes=_SMS)
    def _tile(info: plgpu.NDLoopInfo):
        row_tile, column_tile = plgpu.planar_snake(info.index[0], grid, 1, tiling.grid_block_n)

        def step(_, x_smem, w_smem, x_scales_smem, w_scales_smem, total):
            def block(acc_ref):
                plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))
                return acc_ref[...]

            partial = pl.run_scoped(block, plgpu.ACC((tile_m, tile_n), jnp.float32))
            row_scales = plgpu.load(x_scales_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
            column_scales = plgpu.load(w_scales_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
            shape = (tile_m, tile_n)
            scales = lax.broadcast_in_dim(row_scales, shape, [0]) * lax.broadcast_in_dim(
                column_scales, shape, [1]
            )
            return total + partial * scales

        zeros = plgpu.layout_cast(jnp.full((tile_m, tile_n), 0, jnp.float32), plgpu.Layout.WGMMA)
        total = plgpu.emit_pipeline(
            step,
            grid=(k // SCALE_BLOCK,),
            in_specs=[
                plgpu.BlockSpec((tile_m, SCALE_BLOCK), lambda d: (row_tile, d)),
                plgpu.BlockSpec((tile_n, SCALE_BLOCK), lambda d: (column_tile, d)),
                plgpu.BlockSpec((1, tile_m), lambda d: (d, row_tile)),
                plgpu.BlockSpec((1, tile_n), lambda d: (d, column_tile)),
            ],
            max_concurrent_steps=tiling.max_concurrent_steps,
            init_carry=zeros,
        )(x_values_gmem, w_values_gmem, x_scales_gmem, w_scales_gmem)

        @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((tile_m, tile_n), out_gmem.dtype))
        def _store(out_smem):
            out_smem[...] = total.astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem,
                out_gmem.at[pl.ds(row_tile * tile_m, tile_m), pl.ds(column_tile * tile_n, tile_n)],
            )
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "interpret"))
def fp8_matmul_mosaic(
    x_values: jax.Array,  # [M, K] float8_e4m3fn
    x_scales: jax.Array,  # [M, K / 128] float32
    w_values: jax.Array,  # [N, K] float8_e4m3fn
    w_scales: jax.Array,  # [N / 128, K / 128] float32
    *,
    out_dtype: jnp.dtype,
    tiling: MosaicFp8Tiling,
    interpret: object = None,
) -> jax.Array:
    """`fp8_matmul_reference` through the Mosaic GPU wgmma kernel, with an explicit tiling.

    Shapes are checked by `fp8_matmul`; rows are padded to whole tiles. Not differentiable:
    FP8 weights are for inference.

    Args:
      interpret: None to compile for the GPU, or Mosaic GPU interpret parameters (CPU).

    Returns:
      [M, N] in `out_dtype`, varying (inside `shard_map`) over the mesh axes the reference's
      output would.
    """
    m, k = x_values.shape
    n = w_values.shape[0]
    if n % tiling.tile_n or n % SCALE_BLOCK or k % SCALE_BLOCK:
        raise ValueError(f"{tiling} needs N={n} a multiple of tile_n and 128, K={k} of 128")
    padded = pl.cdiv(m, tiling.tile_m) * tiling.tile_m
    if padded != m:  # zero rows: scale 0, so they add nothing
        x_values = jnp.pad(x_values, ((0, padded - m), (0, 0)))
        x_scales = jnp.pad(x_scales, ((0, padded - m), (0, 0)))
    (varying,) = axes.reference_varying(
        functools.partial(fp8_matmul_reference, out_dtype=out_dtype),
        x_values,
        x_scales,
        w_values,
        w_scales,
    )
    column_scales = jnp.repeat(w_scales.T, SCALE_BLOCK, axis=1)  # [K / 128, N]
    call = plgpu.kernel(
        functools.partial(_fp8_matmul_kernel, tiling=tiling),
        out_type=jax.ShapeDtypeStruct((padded, n), out_dtype),
        grid=(NUM_SMS,),
        grid_names=(_SMS,),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
    out = call(x_values, w_values, x_scales.T, column_scales)
    # Mosaic GPU types its output invariant; it varies as the reference's does.
    return axes.mark_varying(out[:m], varying)
