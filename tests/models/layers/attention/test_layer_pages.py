"""A scanned run's paged caches read and written in place (`LayerPages`, a `bj.LayerStacked`):
the same values as slicing each layer's pools out of stacked pools, without the copies."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import boundary_jax as bj
from models.layers.attention.paged import LayerPages, PagedKVCache

LAYERS, PAGES, PAGE_SIZE, KV, D, SLOTS, PER_SEQUENCE = 3, 8, 4, 2, 8, 2, 3


class Writer(nnx.Module):
    """A stand-in layer: writes its scaled rows into its cache, then reads its rows' sequences
    back through the page table."""

    def __init__(self, scale: float):
        self.scale = nnx.Param(jnp.asarray(scale))

    def __call__(self, x, cache: PagedKVCache, positions, segments):
        rows = x * self.scale[...]
        cache = cache.write(rows, -rows, segments, positions)
        keys, values = cache.gather(segments)
        return x + keys.sum(axis=1) + values.mean(axis=1), cache


def inputs():
    stacked = tuple(
        jax.random.normal(jax.random.key(i), (LAYERS, PAGES, PAGE_SIZE, KV, D)) for i in (0, 1)
    )
    table = jnp.asarray([[3, 0, 5], [1, 7, 2]], jnp.int32)
    x = jax.random.normal(jax.random.key(2), (4, KV, D))
    positions = jnp.asarray([4, 5, 0, 9], jnp.int32)
    segments = jnp.asarray([0, 0, 1, -1], jnp.int32)
    return stacked, table, x, positions, segments


RUN = bj.StackedLayers([Writer(s) for s in (1.0, 2.0, 3.0)], start=0)


def scanned(stacked, table, x, positions, segments, in_place_pages: bool):
    def call(layer, x, cache):
        return layer(x, cache, positions, segments)

    if in_place_pages:
        cache = LayerPages.of(stacked, table, PagedKVCache)
    else:
        tables = jnp.broadcast_to(table, (LAYERS, *table.shape))
        cache = PagedKVCache(*stacked, tables)
    x, cache = RUN.scan(call, x, cache, in_place=True)
    return x, cache.pools


def test_layer_pages_equal_sliced_pools():
    """Each layer reads and writes its own pages of the flat pools: outputs and pools equal
    the stacked pools sliced per layer (every layer wrote its scaled rows, and nothing else)."""
    args = inputs()
    got = jax.jit(lambda *a: scanned(*a, in_place_pages=True))(*args)
    want = jax.jit(lambda *a: scanned(*a, in_place_pages=False))(*args)
    chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-6)
    stacked = args[0]
    changed = np.abs(np.asarray(got[1][0]) - np.asarray(stacked[0])).max(axis=(2, 3, 4))
    # Rows at positions 4, 5 (slot 0: table entry 1, page 0) and 0 (slot 1: page 1).
    assert (changed[:, [0, 1]] > 0).all() and not np.delete(changed, [0, 1], axis=1).any()


def test_layer_pages_slice_no_layer_pool_out_of_the_run():
    """Compiled, the in-place run copies no layer's pool out of the stacked pools; the sliced
    run does (the copy each scanned step paid)."""
    args = inputs()
    one_pool = rf"f32\[{PAGES},{PAGE_SIZE},{KV},{D}\]\S* (dynamic-slice|fusion)\("

    def slices(in_place_pages: bool) -> int:
        lowered = jax.jit(lambda *a: scanned(*a, in_place_pages=in_place_pages)).lower(*args)
        text = lowered.compile().as_text()
        return len([line for line in text.splitlines() if re.search(one_pool, line)])

    assert slices(True) == 0 and slices(False) > 0
