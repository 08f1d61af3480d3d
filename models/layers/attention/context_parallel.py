"""Causal attention across context-parallel shards: each attention-CP rank holds some rows of
every sequence (in zigzag order, `models.inputs.zigzag`) and attends its queries to the keys of
all CP ranks.

Rows are as `attend_packed` takes them: `positions` [T] within each sequence and `segment_ids`
[T] (-1 for padding), but a sequence's rows need not be contiguous or in order, so the mask is
built from positions and segments alone. Two ways to reach the other ranks' keys
(`CpAttentionMode`): all-gather them, or pass them around the CP ring block by block with an
online softmax. Call inside `jax.shard_map` over a mesh with the topology's attention-CP axes.

Decode keeps the KV cache where the prefill wrote it: each CP rank's cache shard holds the keys
of its own rows (`KVCache.positions` says which positions), a decode row (one per slot, alike
on every CP rank) attends to the local shard, and the ranks' `SoftmaxPartial`s merge in one
all-gather over attention CP (`attend_cp_cache`). A new token's key goes to CP rank
`position % C` (`cp_decode_writes`), so the shards grow evenly.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
from jax import lax

from boundary_jax import SumGroup, Topology
from boundary_jax.ops import shard_index

from .attend import accumulation_dtype, attend, causal_visibility


class CpAttentionMode(enum.Enum):
    """How a CP rank's queries reach the keys and values of the other CP ranks.

    ALL_GATHER: one all-gather of K/V (and their positions and segments) over attention CP,
    then one attention over all keys; simple, but every rank holds every key.
    RING: C steps around the CP ring; at each, the rank sends its current K/V block on
    (`ppermute`) while it attends to it, folding the block into an online softmax; a rank
    holds two blocks at a time.
    """

    ALL_GATHER = "all_gather"
    RING = "ring"


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["peak", "total", "weighted"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class SoftmaxPartial:
    """A softmax-weighted sum over some of a query's keys, mergeable with one over other keys.

    With `m` the peak score seen, `total = sum exp(s - m)` and `weighted = sum exp(s - m) v`
    over the keys seen; the attention output is `weighted / total`. Two partials over disjoint
    keys merge exactly (rescaled to the larger peak). Accumulators are float32 or wider.

    Attributes:
      peak: [T, kv, group] the largest allowed score seen (no gradient: a shift that cancels);
        -inf where no key was allowed yet.
      total: [T, kv, group] sum of the weights.
      weighted: [T, kv, group, Dv] weighted sum of the values.
    """

    peak: jax.Array
    total: jax.Array
    weighted: jax.Array

    @classmethod
    def over(
        cls,
        q: jax.Array,
        keys: jax.Array,
        values: jax.Array,
        mask: jax.Array,
        scale: float,
        key_axes: str = "skd",
    ) -> SoftmaxPartial:
        """The partial of queries q [T, kv, group, D] over keys [S, kv, D] and values
        [S, kv, Dv] (`key_axes` "skd"), or one set per query row, [T, S, kv, D] ("tskd"),
        where mask [T, S] allows."""
        acc = accumulation_dtype(q.dtype)
        scores = jnp.einsum(f"tkgd,{key_axes}->tkgs", q, keys, preferred_element_type=acc)
        scores = jnp.where(mask[:, None, None, :], scores * scale, -jnp.inf)
        peak = lax.stop_gradient(jnp.max(scores, axis=-1))
        weights = jnp.exp(scores - _finite(peak)[..., None])
        weighted = jnp.einsum(
            f"tkgs,{key_axes}->tkgd",
            weights.astype(values.dtype),
            values,
            preferred_element_type=acc,
        )
        return cls(peak=peak, total=jnp.sum(weights, axis=-1), weighted=weighted)

    def merge(self, other: SoftmaxPartial) -> SoftmaxPartial:
        """The partial over both partials' keys (disjoint key sets)."""
        peak = jnp.maximum(self.peak, other.peak)
        mine, theirs = jnp.exp(self.peak - _finite(peak)), jnp.exp(other.peak - _finite(peak))
        return SoftmaxPartial(
            peak=peak,
            total=self.total * mine + other.total * theirs,
            weighted=self.weighted * mine[..., None] + other.weighted * theirs[..., None],
        )

    def merge_over(self, names: tuple[str, ...]) -> SoftmaxPartial:
        """The partial over the keys of every rank of the mesh axes `names` (each rank's
        partial over its own, disjoint keys, for the same queries): one all-gather of the
        packed partials [T, kv, group, Dv + 2], then a local merge; alike on every rank."""
        packed = jnp.concatenate(
            [self.weighted, self.total[..., None], self.peak[..., None]], axis=-1
        )
        every = lax.all_gather(packed, names)  # [ranks, T, kv, group, Dv + 2]
        peaks = every[..., -1]
        peak = jnp.max(peaks, axis=0)
        shift = jnp.exp(peaks - _finite(peak)[None])
        return SoftmaxPartial(
            peak=peak,
            total=jnp.sum(every[..., -2] * shift, axis=0),
            weighted=jnp.sum(every[..., :-2] * shift[..., None], axis=0),
        )

    def result(self) -> jax.Array:
        """[T, kv, group, Dv] attention output; zero where no key was allowed (padding)."""
        total = jnp.where(self.total > 0, self.total, 1.0)
        return self.weighted / total[..., None]


def _finite(peak: jax.Array) -> jax.Array:
    """The peak as a shift: 0 where no key was allowed, so exp(-inf - shift) stays 0, not NaN."""
    return jnp.where(jnp.isfinite(peak), peak, 0.0)


def cp_mask(
    positions: jax.Array,
    segment_ids: jax.Array,
    key_positions: jax.Array,
    key_segment_ids: jax.Array,
    sliding_window: int | None = None,
) -> jax.Array:
    """[T, S] which keys each query row sees: same sequence, causal (and within the window) by
    position, the query not padding (a padding key's segment -1 matches no real query)."""
    mask = segment_ids[:, None] == key_segment_ids[None, :]
    mask &= causal_visibility(positions, key_positions, sliding_window)
    return mask & (segment_ids >= 0)[:, None]


def attend_context_parallel(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    topology: Topology,
    mode: CpAttentionMode,
    scale: float,
    sliding_window: int | None = None,
) -> jax.Array:
    """Causal attention of this CP rank's query rows to the key rows of every CP rank.

    Equals `attend_packed` over all CP ranks' rows together, row for row. Call inside
    `jax.shard_map` with the rows split over attention CP (`topology.group_names(
    SumGroup.ATTN_CP)`); with one CP rank it attends within the local rows.

    Args:
      q: [T, kv, group, D] this rank's queries, grouped by the kv head they use.
      k: [T, kv, D] this rank's keys.
      v: [T, kv, Dv] this rank's values.
      positions: [T] position of each row in its sequence (any row order).
      segment_ids: [T] sequence of each row, alike on every CP rank; -1 for padding (zero
        output).
      topology: The parallel topology (its attention-CP axes name the collectives).
      mode: All-gather of K/V or the ring.
      scale: Factor of the scores.
      sliding_window: A row attends to the `sliding_window` positions ending at its own; None
        for full causal attention.

    Returns:
      [T, kv, group, Dv] in float32 or wider.

    Raises:
      ValueError: Rows of q, k, v, positions and segment_ids that differ.
    """
    rows = q.shape[0]
    if k.shape[0] != rows or v.shape[0] != rows or positions.shape != (rows,):
        raise ValueError(
            "q, k, v, positions and segment_ids must share their rows; got "
            f"{q.shape=}, {k.shape=}, {v.shape=}, {positions.shape=}, {segment_ids.shape=}"
        )
    if segment_ids.shape != (rows,):
        raise ValueError(f"segment_ids must be [T] for q {q.shape}; got {segment_ids.shape=}")
    names = topology.group_names(SumGroup.ATTN_CP)
    if not names or mode is CpAttentionMode.ALL_GATHER:
        if names:
            k, v, key_positions, key_segments = lax.all_gather(
                (k, v, positions, segment_ids), names, axis=0, tiled=True
            )
        else:
            key_positions, key_segments = positions, segment_ids
        mask = cp_mask(positions, segment_ids, key_positions, key_segments, sliding_window)
        return attend(q, k, v, mask, "skd", scale)
    return _ring(q, (k, v, positions, segment_ids), names, topology.attn_cp, scale, sliding_window)


def _ring(
    q: jax.Array,
    block: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    names: tuple[str, ...],
    ranks: int,
    scale: float,
    sliding_window: int | None,
) -> jax.Array:
    """Ring attention: at step s a rank holds rank (r - s)'s block (k, v, positions, segments)."""
    positions, segment_ids = block[2], block[3]
    onward = [(rank, (rank + 1) % ranks) for rank in range(ranks)]
    partial = None
    for step in range(ranks):
        # Sent before this block's compute, which does not wait on it: the transfer overlaps.
        incoming = lax.ppermute(block, names, onward) if step + 1 < ranks else None
        keys, values, key_positions, key_segments = block
        mask = cp_mask(positions, segment_ids, key_positions, key_segments, sliding_window)
        here = SoftmaxPartial.over(q, keys, values, mask, scale)
        partial = here if partial is None else partial.merge(here)
        block = incoming
    return partial.result()


def cp_prefill_cache_index(segment_ids: jax.Array, slots: int) -> jax.Array:
    """int32 [T]: the cache row each prefill row of this CP rank takes in its slot's shard.

    A CP rank's rows of one sequence are contiguous in its zigzag block (chunk i, then chunk
    2C-1-i), so a row's cache row is its offset from the sequence's first row in the block
    (rows keep their positions in `KVCache.positions`, so their order does not matter).
    Padding rows (segment -1) get an index they must not be written at.
    """
    rows = jnp.arange(segment_ids.shape[0], dtype=jnp.int32)
    slot = jnp.where(segment_ids >= 0, segment_ids, slots)
    first = jax.ops.segment_min(rows, slot, num_segments=slots + 1)
    return rows - first[slot]


def cp_decode_writes(
    positions: jax.Array, segment_ids: jax.Array, key_positions: jax.Array, topology: Topology
) -> tuple[jax.Array, jax.Array]:
    """Where this CP rank appends the keys of a DECODE step (row i is slot i): only the rows
    whose position it owns (`position % attn_cp` is its CP index), each after its slot's
    filled rows.

    Args:
      positions: [slots] position of each row's token.
      segment_ids: [slots] the row's slot, -1 for an idle slot.
      key_positions: [slots, rows] this rank's `KVCache.positions`.
      topology: The parallel topology.

    Returns:
      (int32 [slots] the slot to write each row in, -1 where this rank does not; int32 [slots]
      the cache row it takes).
    """
    rank = shard_index(topology, SumGroup.ATTN_CP)
    owned = (segment_ids >= 0) & (positions % topology.attn_cp == rank)
    filled = jnp.sum(key_positions >= 0, axis=1, dtype=jnp.int32)
    return jnp.where(owned, segment_ids, -1), filled


def attend_cp_cache(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    key_positions: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    topology: Topology,
    scale: float,
    sliding_window: int | None = None,
) -> jax.Array:
    """Decode attention over a KV cache split over attention CP: each row (slot i, alike on
    every CP rank) attends to this rank's shard of its slot, and the ranks' partial softmaxes
    merge in one all-gather over attention CP.

    Args:
      q: [slots, kv, group, D] this step's queries, row i being slot i's.
      keys: [slots, rows, kv, D] this rank's cache shard (after this step's writes).
      values: [slots, rows, kv, Dv].
      key_positions: [slots, rows] position of each cached key, -1 for an empty row.
      positions: [slots] each query's position.
      segment_ids: [slots] the row's slot, -1 for an idle one (zero output).
      topology: The parallel topology.
      scale: Factor of the scores.
      sliding_window: A row attends to the `sliding_window` positions ending at its own; None
        for full causal attention.

    Returns:
      [slots, kv, group, Dv] in float32 or wider, alike on every CP rank.
    """
    distance = positions[:, None] - key_positions
    mask = (key_positions >= 0) & (distance >= 0) & (segment_ids >= 0)[:, None]
    if sliding_window is not None:
        mask &= distance < sliding_window
    partial = SoftmaxPartial.over(q, keys, values, mask, scale, key_axes="tskd")
    return partial.merge_over(topology.group_names(SumGroup.ATTN_CP)).result()


def share_over_cp(rows: jax.Array, topology: Topology) -> jax.Array:
    """Rows that one attention-CP rank holds and the others hold as zeros, on every CP rank
    (a sum over attention CP): e.g. each sequence's last prefill row, which lies on one CP
    rank, for a decode whose rows are alike over CP."""
    names = topology.group_names(SumGroup.ATTN_CP)
    return lax.psum(rows, names) if names else rows
