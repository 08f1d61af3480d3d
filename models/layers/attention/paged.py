"""A paged KV cache: fixed-size pages of keys and values, and a page table per sequence.

The cache of one attention layer is a pool of pages, globally [pages, page_size, cache heads,
head_dim], pages split over attention DP (each DP rank owns its pool and numbers its pages from
0) and heads over attention TP as `KVCache`'s are. A sequence held in the cache has a slot on
its DP rank; `page_table[slot, j]` is the page that holds its positions
[j * page_size, (j + 1) * page_size). Sequences that share a prompt prefix may name the same
pages (the host's block manager counts their references); a page is written only by the
sequence that owns its next position, so shared pages are only read.

Rows of an `RowsPhase.EXTEND` call are any tokens of the sequences held (a chunk of a prompt,
or one decode token each): every row is written at its position and then attends to its
sequence's positions up to its own, read through the page table (`attend_paged`: the `jnp`
reference gathers each row's pages; a paged GPU kernel belongs beside it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from boundary_jax import SumGroup, TokenAxis, Topology

from ...config import DecoderConfig
from .attend import attend, causal_visibility
from .kv_cache import HeadSplit


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["k", "v", "page_table"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """One attention layer's paged key/value cache and the page table it is read through: a
    registered pytree.

    Inside `shard_map` a rank holds k and v [pages per rank, page_size, local kv heads,
    head_dim] and page_table int32 [slots per rank, pages per sequence] (pages of its own pool).

    Attributes:
      k: Keys after q/k norm and RoPE.
      v: Values.
      page_table: Per slot, the page of each block of its positions (entries past the
        sequence's last page are never read unmasked; any page id in range will do).
    """

    k: jax.Array
    v: jax.Array
    page_table: jax.Array

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @staticmethod
    def pool_shape(
        config: DecoderConfig, topology: Topology, *, pages: int, page_size: int
    ) -> tuple[int, int, int, int]:
        """The global [pages, page_size, cache heads, head_dim] shape of `k` and `v`.

        Raises:
          ValueError: `pages` does not split evenly over attention DP.
        """
        if pages % topology.attn_dp:
            raise ValueError(
                f"paged KV cache pages ({pages}) must split evenly over attention DP "
                f"({topology.attn_dp}); got {pages=}"
            )
        heads = HeadSplit.of(config, topology)
        return (pages, page_size, heads.cache_heads, config.head_dim)

    @staticmethod
    def pool_spec(topology: Topology) -> PartitionSpec:
        """Pages over attention DP, heads over attention TP."""
        dp = topology.spec_entry((TokenAxis.ATTN_DP,))
        return PartitionSpec(dp, None, topology.shard_entry(SumGroup.ATTN_TP), None)

    @staticmethod
    def table_spec(topology: Topology) -> PartitionSpec:
        """Slots over attention DP."""
        return PartitionSpec(topology.spec_entry((TokenAxis.ATTN_DP,)), None)

    @classmethod
    def create_pool(
        cls,
        config: DecoderConfig,
        topology: Topology,
        *,
        pages: int,
        page_size: int,
        dtype: jnp.dtype = jnp.float32,
        mesh: Mesh | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Zero (k, v) pools of the global shape; on `mesh` each device allocates its shard."""
        shape = cls.pool_shape(config, topology, pages=pages, page_size=page_size)
        device = None if mesh is None else NamedSharding(mesh, cls.pool_spec(topology))
        return jnp.zeros(shape, dtype, device=device), jnp.zeros(shape, dtype, device=device)

    def write(
        self, k: jax.Array, v: jax.Array, segment_ids: jax.Array, positions: jax.Array
    ) -> PagedKVCache:
        """Row i's key and value at position `positions[i]` of slot `segment_ids[i]` (-1: not
        written); k and v are [T, local kv heads, head_dim]."""
        pages, size = self.k.shape[0], self.page_size
        valid = segment_ids >= 0
        slot = jnp.where(valid, segment_ids, 0)
        block = jnp.clip(positions // size, 0, self.page_table.shape[1] - 1)
        page = jnp.where(valid, self.page_table[slot, block], pages)
        # Padding rows point past the pool, each at its own offset: every index is distinct
        # (XLA may scatter without atomics) and the out-of-range ones drop.
        offset = jnp.where(valid, positions % size, jnp.arange(positions.shape[0]))

        def put(values: jax.Array, new: jax.Array) -> jax.Array:
            return values.at[page, offset].set(
                new.astype(values.dtype), mode="drop", unique_indices=True
            )

        return PagedKVCache(put(self.k, k), put(self.v, v), self.page_table)

    def gather(self, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each row's sequence's keys and values in position order: [T, pages per sequence *
        page_size, local kv heads, head_dim] each (the `jnp` reference's copy of the pages)."""
        table = self.page_table[jnp.maximum(segment_ids, 0)]  # [T, pages per sequence]

        def read(values: jax.Array) -> jax.Array:
            rows = values[table]  # [T, pages, page_size, heads, D]
            return rows.reshape(rows.shape[0], -1, *rows.shape[3:])

        return read(self.k), read(self.v)


def attend_paged(
    q: jax.Array,
    cache: PagedKVCache,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Each row attends to its sequence's cached positions 0..position (within the sliding
    window), read through the page table: the `jnp` reference (it gathers every row's pages).

    Args:
      q: [T, kv, group, D] queries, grouped by the kv head they use.
      cache: The layer's cache, holding this call's keys already (`PagedKVCache.write`).
      positions: [T] position of each row in its sequence.
      segment_ids: [T] slot of each row's sequence; -1 for padding (zero output).
      scale: Factor of the scores.
      sliding_window: As `attend_packed`'s.
      sinks: [kv, group] each head's sink logit, or None.

    Returns:
      [T, kv, group, D].
    """
    keys, values = cache.gather(segment_ids)
    key_positions = jnp.arange(keys.shape[1], dtype=positions.dtype)
    mask = causal_visibility(positions, key_positions, sliding_window)
    mask &= (segment_ids >= 0)[:, None]
    return attend(q, keys.astype(q.dtype), values.astype(q.dtype), mask, "tskd", scale, sinks=sinks)
