"""Block-scaled FP8 matmul for decode: reads the FP8 weights once, scales in registers.

`out = x @ w.T` for rows quantized per token group and a weight quantized per 128 x 128 block
(`fp8_matmul_reference`). One program per (column block, row block, contraction split): it streams
its [block_n, K / split_k] slice of the FP8 weight one scale block (128 features) at a time,
multiplies both operands' FP8 values on the tensor cores with float32 sums (or, with
`fp8_dot=False`, converts them to float16 in registers first: exact, every e4m3 value is a float16),
and scales each block's partial by its row's and its weight block's scales before adding it up, so
the tensor cores' reduced-precision FP8 sums never run past 128 features. At decode sizes the
weights are almost all the bytes a step reads, so reading them in FP8 is the speed. Runs through the
Pallas Triton lowering (NVIDIA GPUs, compute capability >= 8.9 for FP8) or the Pallas interpreter
(any platform, for tests).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .. import axes
from .reference import fp8_matmul_reference
from .tuned_block_sizes import SCALE_BLOCK, TritonFp8Tiling


def _fp8_matmul_kernel(
    x_values_ref,
    x_scales_ref,
    w_values_ref,
    w_scales_ref,
    out_ref,
    *,
    block_m: int,
    block_n: int,
    steps: int,
    operand_dtype: jnp.dtype,
):
    column, row_block, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    columns = pl.ds(pl.multiple_of(column * block_n, block_n), block_n)
    rows = pl.ds(pl.multiple_of(row_block * block_m, block_m), block_m)
    scale_row = column * block_n // SCALE_BLOCK

    def step(index, acc):
        depth_block = part * steps + index
        depth = pl.ds(pl.multiple_of(depth_block * SCALE_BLOCK, SCALE_BLOCK), SCALE_BLOCK)
        x = x_values_ref[rows, depth].astype(operand_dtype)
        w = w_values_ref[columns, depth].astype(operand_dtype)
        partial = lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        x_scale = x_scales_ref[rows, pl.ds(depth_block, 1)]  # [block_m, 1]
        w_scale = w_scales_ref[scale_row, depth_block]
        return acc + partial * (x_scale * w_scale)

    acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    out_ref[part, rows, columns] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "interpret"))
def fp8_matmul_triton(
    x_values: jax.Array,  # [M, K] float8_e4m3fn
    x_scales: jax.Array,  # [M, K / 128] float32
    w_values: jax.Array,  # [N, K] float8_e4m3fn
    w_scales: jax.Array,  # [N / 128, K / 128] float32
    *,
    out_dtype: jnp.dtype,
    tiling: TritonFp8Tiling,
    interpret: bool = False,
) -> jax.Array:
    """`fp8_matmul_reference` through the Triton decode kernel, with an explicit tiling.

    Shapes are checked by `fp8_matmul`. Not differentiable: FP8 weights are for inference.

    Returns:
      [M, N] in `out_dtype`, varying (inside `shard_map`) over the mesh axes the reference's
      output would.
    """
    m, k = x_values.shape
    n = w_values.shape[0]
    block_m = tiling.rows_per_program(m)
    padded = pl.cdiv(m, block_m) * block_m
    if padded != m:  # zero rows: scale 0, so they add nothing
        x_values = jnp.pad(x_values, ((0, padded - m), (0, 0)))
        x_scales = jnp.pad(x_scales, ((0, padded - m), (0, 0)))
    steps, left = divmod(k // SCALE_BLOCK, tiling.split_k)
    if left or n % tiling.block_n:
        raise ValueError(f"{tiling} does not divide K={k} into its scale blocks or N={n}")
    split = tiling.split_k > 1
    (varying,) = axes.reference_varying(
        functools.partial(fp8_matmul_reference, out_dtype=out_dtype),
        x_values,
        x_scales,
        w_values,
        w_scales,
    )
    kernel = functools.partial(
        _fp8_matmul_kernel,
        block_m=block_m,
        block_n=tiling.block_n,
        steps=steps,
        operand_dtype=x_values.dtype if tiling.fp8_dot else jnp.float16,
    )
    call = pl.pallas_call(
        kernel,
        out_shape=axes.output_type(
            (tiling.split_k, padded, n), jnp.float32 if split else out_dtype, varying
        ),
        grid=(n // tiling.block_n, padded // block_m, tiling.split_k),
        compiler_params=pltriton.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages
        ),
        interpret=interpret,
    )
    parts = call(x_values, x_scales, w_values, w_scales)
    out = jnp.sum(parts, axis=0).astype(out_dtype) if split else parts[0]
    return out[:m]
