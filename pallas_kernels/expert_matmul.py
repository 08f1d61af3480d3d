"""Grouped matmul for decode-sized MoE steps: reads only the weights of experts that have rows.

`out[r] = rows[r] @ weights[g(r)]` for rows sorted by group (expert). One program per (expert
with rows, column block): it streams that expert's [K, block_n] weight tile once, multiplying
the expert's rows `block_rows` at a time, so the weights of experts no row chose are never read.
JAX's Mosaic GPU `ragged_dot` instead visits every group (an empty one still reads its weights),
which at a few routed rows per expert costs the whole weight tensor. Runs through the Pallas
Triton lowering (NVIDIA GPUs) or the Pallas interpreter (any platform, for tests).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


@dataclasses.dataclass(frozen=True)
class ExpertMatmulBlocks:
    """Tiling of `expert_matmul`.

    Attributes:
      block_rows: Rows of one expert multiplied together (at least 16 for the tensor cores).
      block_n: Output columns per program.
      block_k: Contraction depth per pipelined step.
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining depth of the contraction loop.
    """

    block_rows: int = 16
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4


def expert_matmul_reference(
    rows: jax.Array, weights: jax.Array, group_sizes: jax.Array
) -> jax.Array:
    """`jax.lax.ragged_dot` in float32 accumulation, rows past the groups zero: the spec."""
    return lax.ragged_dot(rows, weights, group_sizes, preferred_element_type=jnp.float32).astype(
        rows.dtype
    )


def _expert_matmul_kernel(
    active_ref, offsets_ref, rows_ref, weights_ref, out_ref, *, num_experts, blocks, depth
):
    slot, column = pl.program_id(0), pl.program_id(1)
    expert = active_ref[slot]
    columns = pl.ds(pl.multiple_of(column * blocks.block_n, blocks.block_n), blocks.block_n)

    @pl.when(expert < num_experts)
    def _():
        start, end = offsets_ref[expert], offsets_ref[expert + 1]

        def row_block(index, carry):
            first = start + index * blocks.block_rows
            row_ids = first + lax.broadcasted_iota(jnp.int32, (blocks.block_rows, 1), 0)
            valid = row_ids < end
            row_slice = pl.ds(first, blocks.block_rows)

            def step(k, acc):
                depth_slice = pl.ds(
                    pl.multiple_of(k * blocks.block_k, blocks.block_k), blocks.block_k
                )
                x = pltriton.load(rows_ref.at[row_slice, depth_slice], mask=valid, other=0)
                w = weights_ref[expert, depth_slice, columns]
                return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

            zeros = jnp.zeros((blocks.block_rows, blocks.block_n), jnp.float32)
            acc = lax.fori_loop(0, depth // blocks.block_k, step, zeros)
            pltriton.store(out_ref.at[row_slice, columns], acc.astype(out_ref.dtype), mask=valid)
            return carry

        lax.fori_loop(0, pl.cdiv(end - start, blocks.block_rows), row_block, 0)


def expert_matmul_supported(k: int, n: int, dtype, blocks: ExpertMatmulBlocks) -> bool:
    """Whether the tiling divides the shape (`k % block_k == 0`, `n % block_n == 0`)."""
    del dtype
    return k % blocks.block_k == 0 and n % blocks.block_n == 0


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def expert_matmul(
    rows: jax.Array,  # [M, K], sorted by group
    weights: jax.Array,  # [G, K, N]
    group_sizes: jax.Array,  # [G] int32
    *,
    blocks: ExpertMatmulBlocks = ExpertMatmulBlocks(),
    interpret: bool = False,
) -> jax.Array:
    """`[M, K] x [G, K, N] -> [M, N]`: each row times its group's weights, float32 accumulation.

    Args:
      rows: Rows sorted by group: group g's rows follow group g - 1's.
      weights: One [K, N] matrix per group, `rows.dtype`.
      group_sizes: Rows per group; rows past their sum are not written (unspecified).
      blocks: The tiling.
      interpret: Run in the Pallas interpreter (CPU tests) instead of compiling for Triton.

    Returns:
      [M, N] in `rows.dtype`.

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
    if not expert_matmul_supported(k, n, rows.dtype, blocks):
        raise ValueError(f"{blocks} does not divide K={k}, N={n}")
    slots = min(m, groups)  # at most this many groups have rows
    group_sizes = group_sizes.astype(jnp.int32)
    (active,) = jnp.nonzero(group_sizes > 0, size=slots, fill_value=groups)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)])
    # Padding rows keep every block's window inside the arrays (masked lanes touch no data).
    padded = jnp.pad(rows, ((0, blocks.block_rows), (0, 0)))
    call = pl.pallas_call(
        functools.partial(_expert_matmul_kernel, num_experts=groups, blocks=blocks, depth=k),
        out_shape=jax.ShapeDtypeStruct((m + blocks.block_rows, n), rows.dtype),
        grid=(slots, n // blocks.block_n),
        compiler_params=pltriton.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
    )
    return call(active.astype(jnp.int32), offsets, padded, weights)[:m]
