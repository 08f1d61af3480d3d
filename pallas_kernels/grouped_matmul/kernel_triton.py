"""Grouped matmul for decode-sized MoE steps: reads only the weights of experts that have rows.

`out[r] = rows[r] @ weights[g(r)]` for rows sorted by group (expert). One program per (expert
with rows, column block): it streams that expert's [K, block_n] weight tile once, multiplying
the expert's rows `block_rows` at a time, so the weights of experts no row chose are never read.
JAX's Mosaic GPU `ragged_dot` instead visits every group (an empty one still reads its weights),
which at a few routed rows per expert costs the whole weight tensor. Runs through the Pallas
Triton lowering (NVIDIA GPUs) or the Pallas interpreter (any platform, for tests).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .. import axes
from ..vjp import with_reference_vjp
from .reference import grouped_matmul_reference
from .tuned_block_sizes import TritonTiling, triton_tiling


def _expert_matmul_kernel(
    active_ref, offsets_ref, rows_ref, weights_ref, out_ref, *, num_experts, tiling, depth
):
    last_window = rows_ref.shape[0] - tiling.block_rows  # a block's window ends by the last row
    slot, column = pl.program_id(0), pl.program_id(1)
    if tiling.columns_inner:
        slot, column = column, slot
    expert = active_ref[slot]
    columns = pl.ds(pl.multiple_of(column * tiling.block_n, tiling.block_n), tiling.block_n)

    @pl.when(expert < num_experts)
    def _():
        start, end = offsets_ref[expert], offsets_ref[expert + 1]

        def row_block(index, carry):
            # A block past the last row slides back; the rows it then covers twice are masked.
            own = start + index * tiling.block_rows
            first = jnp.minimum(own, last_window)
            row_ids = first + lax.broadcasted_iota(jnp.int32, (tiling.block_rows, 1), 0)
            valid = (row_ids >= own) & (row_ids < end)
            row_slice = pl.ds(first, tiling.block_rows)

            def step(k, acc):
                depth_slice = pl.ds(
                    pl.multiple_of(k * tiling.block_k, tiling.block_k), tiling.block_k
                )
                x = pltriton.load(rows_ref.at[row_slice, depth_slice], mask=valid, other=0)
                w = weights_ref[expert, depth_slice, columns]
                return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

            zeros = jnp.zeros((tiling.block_rows, tiling.block_n), jnp.float32)
            acc = lax.fori_loop(0, depth // tiling.block_k, step, zeros)
            pltriton.store(out_ref.at[row_slice, columns], acc.astype(out_ref.dtype), mask=valid)
            return carry

        lax.fori_loop(0, pl.cdiv(end - start, tiling.block_rows), row_block, 0)


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def expert_matmul(
    rows: jax.Array,  # [M, K], sorted by group
    weights: jax.Array,  # [G, K, N]
    group_sizes: jax.Array,  # [G] int32
    *,
    tiling: TritonTiling | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`[M, K] x [G, K, N] -> [M, N]`: each row times its group's weights, float32 accumulation.

    Args:
      rows: Rows sorted by group: group g's rows follow group g - 1's.
      weights: One [K, N] matrix per group, `rows.dtype`.
      group_sizes: Rows per group; rows past their sum are not written (unspecified).
      tiling: The tiling; None for `triton_tiling`'s by the mean rows per group.
      interpret: Run in the Pallas interpreter (CPU tests) instead of compiling for Triton.

    Returns:
      [M, N] in `rows.dtype`. Differentiable: the gradients are `grouped_matmul_reference`'s.
      Inside `shard_map` it varies over the mesh axes the reference's output would.

    Raises:
      ValueError: Mismatched shapes or a tiling that does not divide them.
    """
    m, k = rows.shape
    groups, k2, n = weights.shape
    if k2 != k or group_sizes.shape != (groups,) or weights.dtype != rows.dtype:
        raise ValueError(
            f"expert_matmul takes rows [M, K], weights [G, K, N] of rows' dtype and group_sizes "
            f"[G]; got {rows.shape=}, {weights.shape=}, {weights.dtype=}, {group_sizes.shape=}"
        )
    tiling = tiling or triton_tiling(k, n, rows.dtype, rows_per_group=m / groups)
    if not tiling.divides(k, n):
        raise ValueError(f"{tiling} does not divide K={k}, N={n}")
    kernel = functools.partial(_expert_matmul_call, tiling=tiling, interpret=interpret)
    if interpret:
        kernel = axes.interpreted(kernel, grouped_matmul_reference)
    return with_reference_vjp(kernel, grouped_matmul_reference)(rows, weights, group_sizes)


def _expert_matmul_call(
    rows: jax.Array, weights: jax.Array, group_sizes: jax.Array, *, tiling, interpret
) -> jax.Array:
    """The Triton kernel's launch: its grid over the groups that have rows."""
    m, k = rows.shape
    groups, _, n = weights.shape
    slots = min(m, groups)  # at most this many groups have rows
    group_sizes = group_sizes.astype(jnp.int32)
    (active,) = jnp.nonzero(group_sizes > 0, size=slots, fill_value=groups)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)])
    # Fewer rows than one block: padded to one, so that every block's window fits.
    padded = jnp.pad(rows, ((0, max(0, tiling.block_rows - m)), (0, 0)))
    (varying,) = axes.reference_varying(grouped_matmul_reference, rows, weights, group_sizes)
    call = pl.pallas_call(
        functools.partial(_expert_matmul_kernel, num_experts=groups, tiling=tiling, depth=k),
        out_shape=axes.output_type(padded.shape[:1] + (n,), rows.dtype, varying),
        grid=tiling.grid(slots, n // tiling.block_n),
        compiler_params=pltriton.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages
        ),
        interpret=interpret,
    )
    return call(active.astype(jnp.int32), offsets, padded, weights)[:m]
