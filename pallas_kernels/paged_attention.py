"""Attention of ragged rows over a paged KV cache, read where the pages lie (Pallas Triton).

A serving step's rows are chunks of sequences: a prompt chunk of many rows, or one decode row
per sequence. Each row attends to its sequence's cached positions up to its own (within a
sliding window, with a sink logit per head where the layer has them), its keys found through
its sequence's page table. The kernel cuts each chunk into blocks of `rows_per_block`
consecutive rows and runs one program per (block, kv head): the program holds the block's
queries (its rows times the query heads of the kv head) and walks the sequence's pages once
for all of them, `pages_per_block` pages per step, with an online softmax. A decode row is a
block of its own; a prompt chunk reads its prefix once per block instead of once per row.

Rows belong to blocks through their chunks: each sequence's rows in a call must be one run of
consecutive rows at consecutive positions (the serving step's layout: one chunk per slot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import axes

QUERY_ROWS = 64
"""Query rows (sequence rows times query heads) one program holds, by default."""

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def _kernel(
    desc_ref,
    tables_ref,
    sinks_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    group: int,
    page_size: int,
    pages_per_block: int,
    sliding_window: int | None,
):
    """One program: one block of a chunk's rows, one kv head, all the pages they reach."""
    first, count = desc_ref[0], desc_ref[1]
    q = q_ref[...]  # [query rows, D], already scaled
    query_rows, head_dim = q.shape
    row_position = first + lax.broadcasted_iota(jnp.int32, (query_rows,), 0) // group
    block_k = pages_per_block * page_size
    end = first + count
    start_block = 0
    if sliding_window is not None:
        start_block = jnp.maximum(first - sliding_window + 1, 0) // block_k

    def step(i, carry):
        out, top, total = carry
        pages = tables_ref[pl.ds(i * pages_per_block, pages_per_block)]
        k = k_ref[pages].reshape(block_k, head_dim)
        v = v_ref[pages].reshape(block_k, head_dim)
        scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
        key_position = i * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        seen = key_position[None, :] <= row_position[:, None]
        if sliding_window is not None:
            seen &= key_position[None, :] > row_position[:, None] - sliding_window
        scores = jnp.where(seen, scores, _MASKED)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        kept = jnp.exp(top - new_top)
        weights = jnp.exp(scores - new_top[:, None])
        total = total * kept + weights.sum(axis=-1)
        out = out * kept[:, None] + jnp.dot(
            weights.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        return out, new_top, total

    init = (
        jnp.zeros((query_rows, head_dim), jnp.float32),
        jnp.full((query_rows,), _MASKED, jnp.float32),
        jnp.zeros((query_rows,), jnp.float32),
    )
    out, top, total = lax.fori_loop(start_block, pl.cdiv(end, block_k), step, init)
    if sinks_ref is not None:
        total = total + jnp.exp(sinks_ref[...] - top)
    o_ref[...] = (out / jnp.where(total > 0, total, 1.0)[:, None]).astype(o_ref.dtype)


def _blocks(
    positions: jax.Array, segment_ids: jax.Array, rows_per_block: int, max_blocks: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Cuts the rows' chunks into blocks of at most `rows_per_block` rows.

    Returns:
      (first row [blocks], [blocks, 2] the first row's position and the block's row count,
      each row's block [T] (max_blocks for padding rows), each row's place in its block [T]).
    """
    rows = positions.shape[0]
    valid = segment_ids >= 0
    index = jnp.arange(rows, dtype=jnp.int32)
    before_segment = jnp.concatenate([jnp.full((1,), -2, jnp.int32), segment_ids[:-1]])
    before_position = jnp.concatenate([jnp.full((1,), -2, jnp.int32), positions[:-1]])
    opens_chunk = valid & ((segment_ids != before_segment) | (positions != before_position + 1))
    chunk_first = lax.cummax(jnp.where(opens_chunk, index, 0))
    place = (index - chunk_first) % rows_per_block
    opens_block = valid & (place == 0)
    block = jnp.where(valid, jnp.cumsum(opens_block) - 1, max_blocks)
    first_row = jnp.zeros((max_blocks,), jnp.int32).at[jnp.where(opens_block, block, max_blocks)]
    first_row = first_row.set(index, mode="drop")
    count = jnp.zeros((max_blocks,), jnp.int32).at[block].add(1, mode="drop")
    first_position = jnp.where(count > 0, positions[first_row], 0)
    return first_row, jnp.stack([first_position, count], axis=1), block, place


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "rows_per_block",
        "pages_per_block",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def ragged_paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
    rows_per_block: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Each row's attention over its sequence's cached positions 0..its position.

    Args:
      q: [T, kv, group, D] queries, grouped by the kv head they use.
      k_pool: [pages, page_size, kv, D] keys (page_size and D powers of two); v_pool alike.
      page_table: int32 [slots, pages per sequence]: slot s's positions [j * page_size,
        (j + 1) * page_size) lie in page `page_table[s, j]`.
      positions: int32 [T] each row's position in its sequence.
      segment_ids: int32 [T] each row's slot; -1 for padding (zero output). A slot's rows are
        one run of consecutive rows at consecutive positions.
      scale: Factor of the scores.
      sliding_window: A row sees the `sliding_window` positions ending at its own; None: all.
      sinks: [kv, group] each query head's sink logit (in the softmax's denominator), or None.
      rows_per_block: Static: sequence rows per program (default: QUERY_ROWS query rows).
      pages_per_block: Static: pages per step of a program's walk (default: 64 positions).
      num_warps, num_stages: Static: Triton's launch parameters.
      interpret: Static: run the Pallas interpreter (CPU tests).

    Returns:
      [T, kv, group, D] in q's dtype.

    Raises:
      ValueError: A page size or head_dim that is not a power of two, or pools of another
        shape than q's heads.
    """
    rows, kv, group, head_dim = q.shape
    pages, page_size = k_pool.shape[:2]
    if (
        k_pool.shape != (pages, page_size, kv, head_dim)
        or v_pool.shape != k_pool.shape
        or page_size & (page_size - 1)
        or head_dim & (head_dim - 1)
    ):
        raise ValueError(
            "ragged_paged_attention takes q [T, kv, group, D] and pools [pages, page_size, kv, "
            f"D] with page_size and D powers of two; got {q.shape=}, {k_pool.shape=}, "
            f"{v_pool.shape=}"
        )
    wide = 1 << (group - 1).bit_length()
    rows_per_block = rows_per_block or max(1, QUERY_ROWS // wide)
    pages_per_block = pages_per_block or max(1, 64 // page_size)
    slots, width = page_table.shape
    max_blocks = min(rows, slots + -(-rows // rows_per_block))
    first_row, desc, block, place = _blocks(positions, segment_ids, rows_per_block, max_blocks)

    q = jnp.pad(q * jnp.asarray(scale, q.dtype), ((0, 0), (0, 0), (0, wide - group), (0, 0)))
    taken = jnp.minimum(first_row[:, None] + jnp.arange(rows_per_block)[None, :], rows - 1)
    query_rows = rows_per_block * wide
    q_blocks = q[taken].transpose(0, 2, 1, 3, 4).reshape(max_blocks, kv, query_rows, head_dim)
    slot = jnp.maximum(segment_ids[jnp.minimum(first_row, rows - 1)], 0)
    padded = max(pages_per_block, 1 << (width - 1).bit_length())
    tables = jnp.pad(page_table[slot], ((0, 0), (0, padded - width)))
    if sinks is None:
        sinks_blocks, sinks_spec = None, None
    else:
        row_sinks = jnp.pad(sinks.astype(jnp.float32), ((0, 0), (0, wide - group)))
        sinks_blocks = jnp.tile(row_sinks, (1, rows_per_block))  # [kv, query rows]
        sinks_spec = pl.BlockSpec((None, query_rows), lambda b, h: (h, 0))
    varying = axes.varying_axes(q, k_pool, v_pool, page_table, positions, segment_ids)
    by_head = pl.BlockSpec((None, None, query_rows, head_dim), lambda b, h: (b, h, 0, 0))
    pool = pl.BlockSpec((pages, page_size, None, head_dim), lambda b, h: (0, 0, h, 0))
    out = pl.pallas_call(
        functools.partial(
            _kernel,
            group=wide,
            page_size=page_size,
            pages_per_block=pages_per_block,
            sliding_window=sliding_window,
        ),
        grid=(max_blocks, kv),
        in_specs=[
            pl.BlockSpec((None, 2), lambda b, h: (b, 0)),
            pl.BlockSpec((None, padded), lambda b, h: (b, 0)),
            sinks_spec,
            by_head,
            pool,
            pool,
        ],
        out_specs=by_head,
        out_shape=axes.output_type(q_blocks.shape, q.dtype, varying),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(desc, tables, sinks_blocks, q_blocks, k_pool, v_pool)
    out = out.reshape(max_blocks, kv, rows_per_block, wide, head_dim)
    valid = segment_ids >= 0
    got = out[jnp.minimum(block, max_blocks - 1), :, place][:, :, :group]
    return jnp.where(valid[:, None, None, None], got, 0).astype(q.dtype)


def kernel_supports(page_size: int, head_dim: int) -> bool:
    """Whether `ragged_paged_attention` takes pages of `page_size` positions and heads of
    `head_dim` (both powers of two, Triton's dots at least 16 wide)."""
    return all(x >= 1 and x & (x - 1) == 0 for x in (page_size, head_dim)) and head_dim >= 16
