"""A Pallas (Triton) kernel for the chunk-to-chunk half of the chunked gated delta rule
(`models.layers.mixers.delta_rule.gated_delta_rule_chunked`, scalar gate per head).

The chunked form first builds, per chunk c and head h, its intra-chunk terms with batched
matmuls (the UT transform's values U and state reads W, the keys weighted by the gates). What
remains sequential is the state S [k_dim, v_dim] carried over the chunks:

    new_c = U_c - W_c S                  (the chunk's corrected values)
    S     = carried_c S + K_c^T new_c    (the state at its end)

`lax.scan` runs that as one small XLA loop iteration per chunk; this kernel runs it as one
program per (head, block of value columns) that keeps its block of S in registers across all
chunks and does the two products with `jnp.dot` on the tensor cores. It writes each chunk's
entering state, so that the outputs, `Q_c S_c + scores_c new_c`, are batched matmuls over all
chunks at once outside the sequential loop (as flash-linear-attention splits its
`chunk_gated_delta_rule_fwd_h` from `chunk_fwd_o`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import axes


def _scan_kernel(
    values_ref,
    reads_ref,
    keys_ref,
    carried_ref,
    new_ref,
    states_ref,
    *,
    chunks: int,
    k_dim: int,
    block_v: int,
):
    """One program: one head's block of value columns, through all chunks."""

    f32 = jnp.float32

    def chunk(c, state):
        entered = state.astype(states_ref.dtype)
        states_ref[c] = entered
        new = values_ref[c].astype(f32)
        new = new - jnp.dot(reads_ref[c], entered, preferred_element_type=f32)
        new = new.astype(new_ref.dtype)
        new_ref[c] = new
        return state * carried_ref[c] + jnp.dot(keys_ref[c].T, new, preferred_element_type=f32)

    lax.fori_loop(0, chunks, chunk, jnp.zeros((k_dim, block_v), f32))


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "num_stages", "interpret"))
def chunk_state_scan(
    values: jax.Array,
    reads: jax.Array,
    keys: jax.Array,
    carried: jax.Array,
    *,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The state's scan over chunks of the chunked gated delta rule (scalar gate per head).

    The state is carried in float32. values, reads and keys share one float dtype (bf16 or
    float32), in which the products read the state and the corrected values (both products
    summing in float32) and the outputs are stored.

    Args:
      values: [C, H, L, v_dim] U, the chunk's values before the entering state is subtracted.
      reads: [C, H, L, k_dim] W, what reads the entering state.
      keys: [C, H, L, k_dim] the keys weighted by the decay to the chunk's end (zero on rows
        not in the chunk's last run).
      carried: [C, H] the factor the entering state keeps at the chunk's end.
      block_v: Static value columns per program (a power of two dividing v_dim; default
        min(32, v_dim)).
      num_warps: Static Triton warps per program.
      num_stages: Static Triton pipeline stages: 3 loads the next chunks' blocks while the
        current chunk's two dots run. At Qwen3-Next's shape (64 chunks x 32 heads x 64 rows x
        128 x 128) on an H200, float32 terms, 32 columns, 4 warps: 0.216 ms at 3 stages, 0.238
        at 2, 0.344 at 1; 16 columns 0.308-0.411 ms; 2 or 8 warps slower (benchmarks/RESULTS.md
        run 40). On an H100, bf16 terms: 0.108 ms, level with 16 columns and best of 2-4 stages
        and 4 or 8 warps (run 41).
      interpret: Static: run the Pallas interpreter (CPU tests).

    Returns:
      (new [C, H, L, v_dim] the corrected values, entering states [C, H, k_dim, v_dim]), as
      the `lax.scan` of `gated_delta_rule_chunked`, both in the inputs' dtype.

    Raises:
      ValueError: Shapes or dtypes that do not match, or block_v not dividing v_dim.
    """
    chunks, heads, length, v_dim = values.shape
    k_dim = reads.shape[-1]
    block_v = block_v or min(32, v_dim)
    if (
        reads.shape != (chunks, heads, length, k_dim)
        or keys.shape != reads.shape
        or carried.shape != (chunks, heads)
        or v_dim % block_v
        or not reads.dtype == keys.dtype == values.dtype
    ):
        raise ValueError(
            "chunk_state_scan takes values [C, H, L, v], reads and keys [C, H, L, k], carried "
            f"[C, H], block_v dividing v, one dtype for values, reads and keys; got "
            f"{values.shape=}, {reads.shape=}, {keys.shape=}, {carried.shape=}, {block_v=}, "
            f"{values.dtype=}, {reads.dtype=}, {keys.dtype=}"
        )
    carried = carried.astype(jnp.float32)[..., None, None]  # [C, H, 1, 1]

    def by_head(*tail, v_block=False):
        # One program's chunks, strided over the heads in place: no head-major copy.
        def index(h, j):
            return (0, h, 0, j if v_block else 0)

        return pl.BlockSpec((chunks, None, *tail), index)

    stored = values.dtype
    # Under shard_map the outputs vary over every mesh axis an input does.
    varying = axes.varying_axes(values, reads, keys, carried)
    new, states = pl.pallas_call(
        functools.partial(_scan_kernel, chunks=chunks, k_dim=k_dim, block_v=block_v),
        grid=(heads, v_dim // block_v),
        in_specs=[
            by_head(length, block_v, v_block=True),
            by_head(length, k_dim),
            by_head(length, k_dim),
            by_head(1, 1),
        ],
        out_specs=[
            by_head(length, block_v, v_block=True),
            by_head(k_dim, block_v, v_block=True),
        ],
        out_shape=[
            axes.output_type((chunks, heads, length, v_dim), stored, varying),
            axes.output_type((chunks, heads, k_dim, v_dim), stored, varying),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(values, reads, keys, carried)
    return new, states
