"""A block of layers' cache in a paged step: the paged form of its keys, values or latents
read through the page table, or its recurrent state one slot per sequence, made from the
block's pools and given back as pools (`paged.PagedRunner`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ..layers.attention.kv_cache import KVCache
from ..layers.attention.latent import LatentCache
from ..layers.attention.paged import LayerPages, PagedKVCache, PagedLatentCache
from ..layers.mixers.gated_deltanet import DeltaCache
from ..layers.mixers.mamba2 import Mamba2Cache

PAGED_FORMS = {KVCache: PagedKVCache, LatentCache: PagedLatentCache}
"""The paged form of each slot-indexed cache a block of layers may hold."""
SLOT_STATES = (Mamba2Cache, DeltaCache)
"""Caches of a recurrent state (Mamba2's, the delta rule's): one slot per sequence, stepped in
place, no pages."""


def cache_parts(spec: Any) -> tuple[str, ...]:
    """The fields of a cache made of caches that have paged forms (LongCat-Flash's latent cache
    per attention), each paged on its own, as a spec tree or in its step form; () for any other
    cache."""
    forms = (*PAGED_FORMS, *PAGED_FORMS.values(), LayerPages)
    if type(spec) in forms or not dataclasses.is_dataclass(spec):
        return ()
    names = tuple(field.name for field in dataclasses.fields(spec))
    return names if all(type(getattr(spec, n)) in forms for n in names) else ()


def step_cache(spec: Any, pools: tuple[jax.Array, ...], table: jax.Array, scanned: bool) -> Any:
    """A block's cache in a step, from its pools and its cache's spec tree `spec`: the paged
    form of keys, values or latents read through `table` (of each part, for a cache of parts;
    a `scanned` run's as `LayerPages`, read in place), a recurrent state as it is, None for a
    block without a cache."""

    def paged(kind: type, pools: tuple[jax.Array, ...]) -> Any:
        form = PAGED_FORMS[kind]
        return LayerPages.of(pools, table, form) if scanned else form.from_pools(pools, table)

    kind = type(spec)
    if kind in PAGED_FORMS:
        return paged(kind, pools)
    if parts := cache_parts(spec):
        caches, start = {}, 0
        for name in parts:
            part = getattr(spec, name)
            count = len(jax.tree_util.tree_leaves(part))
            caches[name] = paged(type(part), pools[start : start + count])
            start += count
        return kind(**caches)
    return kind(*pools) if pools else None


def cache_pools(cache: Any) -> tuple[jax.Array, ...]:
    """The pools of a step's cache (what `step_cache` took)."""
    if isinstance(cache, PagedKVCache | PagedLatentCache | LayerPages):
        return cache.pools
    if parts := cache_parts(cache):
        return tuple(pool for name in parts for pool in getattr(cache, name).pools)
    return tuple(jax.tree_util.tree_leaves(cache))
