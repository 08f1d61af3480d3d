"""A paged KV cache: fixed-size pages of keys and values, and a page table per sequence.

The cache of one attention layer is a pool of pages, globally [pages, page_size, cache heads,
head_dim], pages split over attention DP (each DP rank owns its pool and numbers its pages from
0) and heads over attention TP as `KVCache`'s are; a latent attention's (`PagedLatentCache`) is
[pages, page_size, latent width], replicated over attention TP as `LatentCache`'s is. A
sequence held in the cache has a slot on its DP rank; `page_table[slot, j]` is the page that
holds its positions [j * page_size, (j + 1) * page_size). Sequences that share a prompt prefix
may name the same pages (the host's block manager counts their references); a page is written
only by the sequence that owns its next position, so shared pages are only read.

Rows of an `RowsPhase.EXTEND` call are any tokens of the sequences held (a chunk of a prompt,
or one decode token each): every row is written at its position and then attends to its
sequence's positions up to its own, read through the page table (`attend_paged`: the `jnp`
reference gathers each row's pages; `attend_paged_kernel` reads them where they lie, by the
Pallas kernel `pallas_kernels.paged_attention`, on a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from boundary_jax import TokenAxis, Topology
from pallas_kernels import axes
from pallas_kernels.paged_attention import kernel_supports, ragged_paged_attention

from .attend import attend, causal_visibility


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
    def pools(self) -> tuple[jax.Array, ...]:
        """The page pools (k, v), as `from_pools` takes them."""
        return (self.k, self.v)

    @classmethod
    def from_pools(cls, pools: tuple[jax.Array, ...], page_table: jax.Array) -> PagedKVCache:
        """The cache of pools (k, v) read through `page_table`."""
        k, v = pools
        return cls(k, v, page_table)

    def write(
        self, k: jax.Array, v: jax.Array, segment_ids: jax.Array, positions: jax.Array
    ) -> PagedKVCache:
        """Row i's key and value at position `positions[i]` of slot `segment_ids[i]` (-1: not
        written); k and v are [T, local kv heads, head_dim]."""
        page, offset = page_rows(self.page_table, segment_ids, positions, self.k.shape[:2])
        return PagedKVCache(
            put_rows(self.k, page, offset, k), put_rows(self.v, page, offset, v), self.page_table
        )

    def gather(self, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each row's sequence's keys and values in position order: [T, pages per sequence *
        page_size, local kv heads, head_dim] each (the `jnp` reference's copy of the pages)."""
        return (
            gather_rows(self.k, self.page_table, segment_ids),
            gather_rows(self.v, self.page_table, segment_ids),
        )


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["latent", "page_table"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class PagedLatentCache:
    """One latent-attention (MLA) layer's paged cache: `LatentCache`'s latent per position
    (the normed kv latent, then the rotated shared key), in pages, read through the page table.

    Inside `shard_map` a rank holds latent [pages per rank, page_size, latent width] (alike on
    every attention-TP rank, as every rank computes the same latent) and page_table int32
    [slots per rank, pages per sequence].
    """

    latent: jax.Array
    page_table: jax.Array

    @property
    def pools(self) -> tuple[jax.Array, ...]:
        """The page pool (latent,), as `from_pools` takes it."""
        return (self.latent,)

    @classmethod
    def from_pools(cls, pools: tuple[jax.Array, ...], page_table: jax.Array) -> PagedLatentCache:
        """The cache of pool (latent,) read through `page_table`."""
        (latent,) = pools
        return cls(latent, page_table)

    def write(
        self, latent: jax.Array, segment_ids: jax.Array, positions: jax.Array
    ) -> PagedLatentCache:
        """Row i's latent [T, latent width] at position `positions[i]` of slot
        `segment_ids[i]` (-1: not written)."""
        page, offset = page_rows(self.page_table, segment_ids, positions, self.latent.shape[:2])
        return PagedLatentCache(put_rows(self.latent, page, offset, latent), self.page_table)

    def gather(self, segment_ids: jax.Array) -> jax.Array:
        """Each row's sequence's latents in position order: [T, pages per sequence * page_size,
        latent width]."""
        return gather_rows(self.latent, self.page_table, segment_ids)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["flat", "tables"], meta_fields=["form"]
)
@dataclasses.dataclass(frozen=True)
class LayerPages:
    """A scanned run's paged caches, read and written in place (a `bj.LayerStacked`): each of
    the run's pools flattened to [layers * pages, ...], layer i's pages numbered from
    i * pages, so a layer's view is the whole flat pool through its page table offset by that
    (slicing layer i's pool out of stacked pools copies it on every step).

    Attributes:
      flat: The form's pools, each [layers * pages per layer, page_size, ...].
      tables: int32 [layers, slots, pages per sequence] each layer's page table (its own page
        ids, from 0).
      form: `PagedKVCache` or `PagedLatentCache`.
    """

    flat: tuple[jax.Array, ...]
    tables: jax.Array
    form: type

    @classmethod
    def of(cls, pools: tuple[jax.Array, ...], table: jax.Array, form: type) -> LayerPages:
        """The run's `pools` ([layers, pages, ...] each) read through `table` (the same page
        table for every layer, as a serving step's)."""
        layers = pools[0].shape[0]
        flat = tuple(pool.reshape(-1, *pool.shape[2:]) for pool in pools)
        return cls(flat, jnp.broadcast_to(table, (layers, *table.shape)), form)

    @property
    def pools(self) -> tuple[jax.Array, ...]:
        """The pools as [layers, pages, ...] again (what `of` took)."""
        layers = self.tables.shape[0]
        return tuple(pool.reshape(layers, -1, *pool.shape[1:]) for pool in self.flat)

    def layer(self, index: jax.Array | int) -> PagedKVCache | PagedLatentCache:
        """Layer `index`'s cache: the flat pools through its offset page table."""
        pages = self.flat[0].shape[0] // self.tables.shape[0]
        table = jax.lax.dynamic_index_in_dim(self.tables, index, 0, False)
        return self.form.from_pools(self.flat, table + index * pages)

    def written(self, index: jax.Array | int, view: PagedKVCache | PagedLatentCache) -> LayerPages:
        """The run's caches after layer `index` wrote `view` (its pools are the flat pools)."""
        del index
        return LayerPages(view.pools, self.tables, self.form)


def page_table_spec(topology: Topology) -> PartitionSpec:
    """The page tables' `PartitionSpec`: slots over attention DP."""
    return PartitionSpec(topology.spec_entry((TokenAxis.ATTN_DP,)), None)


def page_rows(
    page_table: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    pool: tuple[int, int],
) -> tuple[jax.Array, jax.Array]:
    """Where each row goes in a pool of `pool` = (pages, page_size): its page (through its
    slot's page table) and offset. Padding rows (segment id -1) point past the pool, each at
    its own offset: every index is distinct (XLA may scatter without atomics) and those drop."""
    pages, size = pool
    valid = segment_ids >= 0
    slot = jnp.where(valid, segment_ids, 0)
    block = jnp.clip(positions // size, 0, page_table.shape[1] - 1)
    page = jnp.where(valid, page_table[slot, block], pages)
    offset = jnp.where(valid, positions % size, jnp.arange(positions.shape[0]))
    return page, offset


def put_rows(pool: jax.Array, page: jax.Array, offset: jax.Array, rows: jax.Array) -> jax.Array:
    """`pool` [pages, page_size, ...] with `rows` [T, ...] stored at (page, offset) (those out of
    range dropped)."""
    return pool.at[page, offset].set(rows.astype(pool.dtype), mode="drop", unique_indices=True)


def gather_rows(pool: jax.Array, page_table: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Each row's sequence's entries of `pool` [pages, page_size, ...] in position order:
    [T, pages per sequence * page_size, ...]."""
    table = page_table[jnp.maximum(segment_ids, 0)]  # [T, pages per sequence]
    rows = pool[table]  # [T, pages, page_size, ...]
    return rows.reshape(rows.shape[0], -1, *rows.shape[3:])


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


def kernel_takes(page_size: int, head_dim: int, dtype: jnp.dtype) -> bool:
    """Whether `attend_paged_kernel` takes queries of `dtype` over pages of `page_size` positions
    and heads of `head_dim` on a GPU: half precision, and pages and heads `kernel_supports` (else
    `attend_paged` computes the call)."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return half and kernel_supports(page_size, head_dim)


def paged_attention(gpu: bool, cache: PagedKVCache, dtype: jnp.dtype) -> Callable[..., jax.Array]:
    """The form of `attend_paged` a layer runs: the Pallas kernel (`attend_paged_kernel`) on a
    `gpu` where it takes the cache and `dtype` (`kernel_takes`), the `jnp` reference otherwise."""
    if gpu and kernel_takes(cache.k.shape[1], cache.k.shape[-1], dtype):
        return attend_paged_kernel
    return attend_paged


def attend_paged_kernel(
    q: jax.Array,
    cache: PagedKVCache,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`attend_paged` with the pages read where they lie, by the Pallas paged kernel
    (`pallas_kernels.paged_attention.ragged_paged_attention`; `interpret` runs its body in
    the Pallas interpreter). Each sequence's rows must be one run of consecutive rows at
    consecutive positions (an EXTEND step's layout: one chunk per slot)."""

    def kernel(q, k, v, page_table, positions, segment_ids, sinks):
        return ragged_paged_attention(
            q,
            k,
            v,
            page_table,
            positions,
            segment_ids,
            scale=scale,
            sliding_window=sliding_window,
            sinks=sinks,
            interpret=interpret,
        )

    def reference(q, k, v, page_table, positions, segment_ids, sinks):
        cache = PagedKVCache(k, v, page_table)
        return attend_paged(
            q,
            cache,
            positions,
            segment_ids,
            scale=scale,
            sliding_window=sliding_window,
            sinks=sinks,
        )

    run = axes.interpreted(kernel, reference) if interpret else kernel
    k, v = cache.k.astype(q.dtype), cache.v.astype(q.dtype)
    return run(q, k, v, cache.page_table, positions, segment_ids, sinks)
