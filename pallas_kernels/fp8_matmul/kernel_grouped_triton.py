"""Grouped block-scaled FP8 matmul for decode-sized MoE steps: reads only the FP8 weights of experts
that have rows, scaling in registers.

`out[r] = x[r] @ w[g(r)].T` for rows sorted by group (expert), each row quantized per token group
and each expert's [N, K] weight per 128 x 128 block (`fp8_grouped_matmul_reference`). One program
per (expert with rows, column block), as `grouped_matmul.expert_matmul` does for bf16: it walks the
expert's rows `block_rows` at a time and, for each, streams the expert's [block_n, K] FP8 weight
slice one scale block at a time, both operands multiplied as FP8 on the tensor cores (or converted
to float16 first, as `fp8_matmul_triton` can), float32 sums scaled per block. Runs through the
Pallas Triton lowering (NVIDIA GPUs, compute capability >= 8.9) or the Pallas interpreter (any
platform, tests).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .. import axes
from .reference import fp8_grouped_matmul_reference
from .tuned_block_sizes import SCALE_BLOCK, TritonFp8Tiling


def _fp8_grouped_kernel(
    active_ref,
    offsets_ref,
    x_values_ref,
    x_scales_ref,
    w_values_ref,
    w_scales_ref,
    out_ref,
    *,
    num_groups: int,
    block_rows: int,
    block_n: int,
    depth_blocks: int,
    operand_dtype: jnp.dtype,
):
    slot, column = pl.program_id(0), pl.program_id(1)
    last_window = x_values_ref.shape[0] - block_rows  # a block's window ends by the last row
    group = active_ref[slot]
    columns = pl.ds(pl.multiple_of(column * block_n, block_n), block_n)
    scale_row = column * block_n // SCALE_BLOCK

    @pl.when(group < num_groups)
    def _():
        start, end = offsets_ref[group], offsets_ref[group + 1]

        def row_block(index, carry):
            # A block past the last row slides back; the rows it then covers twice are masked.
            own = start + index * block_rows
            first = jnp.minimum(own, last_window)
            row_ids = first + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
            valid = (row_ids >= own) & (row_ids < end)
            rows = pl.ds(first, block_rows)

            def step(depth_block, acc):
                depth = pl.ds(pl.multiple_of(depth_block * SCALE_BLOCK, SCALE_BLOCK), SCALE_BLOCK)
                # Rows outside the block's own are finite FP8 (other rows, or the zero padding):
                # their scale loads as 0 and they are not stored.
                x = x_values_ref[rows, depth].astype(operand_dtype)
                w = w_values_ref[group, columns, depth].astype(operand_dtype)
                partial = lax.dot_general(
                    x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                )
                x_scale = pltriton.load(
                    x_scales_ref.at[rows, pl.ds(depth_block, 1)], mask=valid, other=0.0
                )
                w_scale = w_scales_ref[group, scale_row, depth_block]
                return acc + partial * (x_scale * w_scale)

            acc = lax.fori_loop(
                0, depth_blocks, step, jnp.zeros((block_rows, block_n), jnp.float32)
            )
            pltriton.store(out_ref.at[rows, columns], acc.astype(out_ref.dtype), mask=valid)
            return carry

        lax.fori_loop(0, pl.cdiv(end - start, block_rows), row_block, 0)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "interpret"))
def fp8_expert_matmul(
    x_values: jax.Array,  # [M, K] float8_e4m3fn, sorted by group
    x_scales: jax.Array,  # [M, K / 128] float32
    w_values: jax.Array,  # [G, N, K] float8_e4m3fn
    w_scales: jax.Array,  # [G, N / 128, K / 128] float32
    group_sizes: jax.Array,  # [G] int32
    *,
    out_dtype: jnp.dtype,
    tiling: TritonFp8Tiling | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`fp8_grouped_matmul_reference` through the Triton kernel: each row times its group's FP8
    weight, reading only the weights of groups that have rows.

    Args:
      x_values, x_scales: Rows sorted by group (group g's rows follow group g - 1's), quantized
        per 128-feature token group.
      w_values, w_scales: One [N, K] weight per group (Hugging Face's [out, in]) and its block
        scales.
      group_sizes: Rows per group; rows past their sum are not written (unspecified).
      out_dtype: The result's dtype.
      tiling: `block_m` rows of a group multiplied together (None: 16), `block_n` columns per
        program, Triton warps and stages, `fp8_dot`; `split_k` must be 1.
      interpret: Run in the Pallas interpreter (CPU tests) instead of compiling for Triton.

    Returns:
      [M, N] in `out_dtype`; inside `shard_map` it varies as the reference's would. Not
      differentiable: FP8 weights are for inference.

    Raises:
      ValueError: Mismatched shapes, or a tiling that splits the contraction.
    """
    m, k = x_values.shape
    groups, n, k2 = w_values.shape
    tiling = tiling or TritonFp8Tiling(block_m=16)
    if (
        k2 != k
        or k % SCALE_BLOCK
        or n % tiling.block_n
        or w_scales.shape != (groups, n // SCALE_BLOCK, k // SCALE_BLOCK)
        or x_scales.shape != (m, k // SCALE_BLOCK)
        or group_sizes.shape != (groups,)
        or tiling.split_k != 1
    ):
        raise ValueError(
            f"fp8_expert_matmul takes x [M, K] with scales [M, K/128], w [G, N, K] with scales "
            f"[G, N/128, K/128] and group sizes [G], K a multiple of 128 and N of block_n, and "
            f"no split_k; got {x_values.shape=}, {x_scales.shape=}, {w_values.shape=}, "
            f"{w_scales.shape=}, {group_sizes.shape=}, {tiling=}"
        )
    block_rows = tiling.rows_per_program(16)
    call = functools.partial(
        _expert_call, out_dtype=out_dtype, tiling=tiling, block_rows=block_rows, interpret=interpret
    )
    if interpret:
        call = axes.interpreted(
            call, functools.partial(fp8_grouped_matmul_reference, out_dtype=out_dtype)
        )
    return call(x_values, x_scales, w_values, w_scales, group_sizes)


def _expert_call(
    x_values, x_scales, w_values, w_scales, group_sizes, *, out_dtype, tiling, block_rows, interpret
):
    """The Triton kernel's launch: its grid over the groups that have rows."""
    m, k = x_values.shape
    groups, n, _ = w_values.shape
    slots = min(m, groups)  # at most this many groups have rows
    group_sizes = group_sizes.astype(jnp.int32)
    (active,) = jnp.nonzero(group_sizes > 0, size=slots, fill_value=groups)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)])
    # Fewer rows than one block: padded to one, so that every block's window fits.
    x_values = jnp.pad(x_values, ((0, max(0, block_rows - m)), (0, 0)))
    x_scales = jnp.pad(x_scales, ((0, max(0, block_rows - m)), (0, 0)))
    reference = functools.partial(fp8_grouped_matmul_reference, out_dtype=out_dtype)
    (varying,) = axes.reference_varying(
        reference, x_values[:m], x_scales[:m], w_values, w_scales, group_sizes
    )
    kernel = functools.partial(
        _fp8_grouped_kernel,
        num_groups=groups,
        block_rows=block_rows,
        block_n=tiling.block_n,
        depth_blocks=k // SCALE_BLOCK,
        operand_dtype=x_values.dtype if tiling.fp8_dot else jnp.float16,
    )
    call = pl.pallas_call(
        kernel,
        out_shape=axes.output_type((x_values.shape[0], n), out_dtype, varying),
        grid=(slots, n // tiling.block_n),
        compiler_params=pltriton.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages
        ),
        interpret=interpret,
    )
    return call(active.astype(jnp.int32), offsets, x_values, x_scales, w_values, w_scales)[:m]
