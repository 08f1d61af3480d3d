"""The GPU forms of paged attention against the `jnp` reference: the Pallas paged decode kernel
interpreted on CPU (its Triton form, and the gather + cuDNN form, on a GPU)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers.attention.paged import PagedKVCache, attend_paged
from models.layers.attention.paged_gpu import (
    attend_paged_cudnn,
    attend_paged_kernel,
    kernel_blocks,
)
from pallas_kernels.impl import Impl

ON_GPU = jax.default_backend() == "gpu"
PAGES, PAGE_SIZE, KV, GROUP, HEAD_DIM, SLOTS, PER_SEQUENCE = 24, 4, 2, 2, 16, 3, 6
SEGMENTS = np.array([0, 2, -1, 1, 0, 2, 1], np.int32)
POSITIONS = np.array([5, 23, 0, 0, 17, 9, 12], np.int32)  # ragged; 23 is a sequence's last


def paged_inputs(dtype=jnp.float32, page_size: int = PAGE_SIZE):
    """Random pools, and each slot's pages drawn from a shuffled pool (no page shared)."""
    keys = jax.random.split(jax.random.key(0), 3)
    pool = (PAGES, page_size, KV, HEAD_DIM)
    k = jax.random.normal(keys[0], pool, dtype)
    v = jax.random.normal(keys[1], pool, dtype)
    order = np.random.default_rng(0).permutation(PAGES)[: SLOTS * PER_SEQUENCE]
    table = jnp.asarray(order.reshape(SLOTS, PER_SEQUENCE), jnp.int32)
    q = jax.random.normal(keys[2], (len(SEGMENTS), KV, GROUP, HEAD_DIM), dtype)
    return q, PagedKVCache(k, v, table)


def test_kernel_blocks_divide_the_table():
    """The padded table splits evenly and each split into whole compute blocks."""
    for pages in (1, 3, 6, 17, 160, 256):
        padded, splits, block = kernel_blocks(pages, 16, 8)
        assert padded >= pages and padded % splits == 0 and (padded // splits) % block == 0


@pytest.mark.parametrize("k_splits", [1, 4])
def test_pallas_kernel_interpreted_equals_reference(k_splits):
    """The Pallas paged kernel (interpreted) gives the reference's output for rows of
    ragged positions over shuffled pages, zero for padding; a wrong page table entry changes
    it (the kernel reads pages through the table)."""
    q, cache = paged_inputs()
    positions, segments = jnp.asarray(POSITIONS), jnp.asarray(SEGMENTS)
    run = lambda cache: attend_paged_kernel(  # noqa: E731
        q, cache, positions, segments, scale=0.25, impl=Impl.PALLAS_INTERPRET, k_splits=k_splits
    )
    want = attend_paged(q, cache, positions, segments, scale=0.25)
    got = run(cache)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
    assert not np.asarray(got[2]).any()
    # Mutant: slot 1's first page swapped for a page no slot uses.
    unused = sorted(set(range(PAGES)) - set(np.asarray(cache.page_table).ravel()))[0]
    wrong = PagedKVCache(cache.k, cache.v, cache.page_table.at[1, 0].set(unused))
    changed = np.abs(np.asarray(run(wrong)) - np.asarray(got)).max(axis=(1, 2, 3))
    assert changed[3] > 1e-3 and changed[6] > 1e-3 and changed[0] == 0, changed


def test_gpu_forms_refuse_windows_and_sinks():
    """A sliding window or sinks are refused, not ignored."""
    q, cache = paged_inputs()
    positions, segments = jnp.asarray(POSITIONS), jnp.asarray(SEGMENTS)
    with pytest.raises(NotImplementedError, match="sliding window or sinks"):
        attend_paged_kernel(
            q, cache, positions, segments, scale=0.25, impl=Impl.PALLAS_INTERPRET, sliding_window=8
        )
    with pytest.raises(NotImplementedError, match="sliding window or sinks"):
        attend_paged_cudnn(q, cache, positions, segments, scale=0.25, sinks=jnp.zeros((KV, GROUP)))


@pytest.mark.skipif(not ON_GPU, reason="the Triton kernel and cuDNN run on a GPU")
@pytest.mark.parametrize("form", ["kernel", "cudnn"])
def test_gpu_paged_forms_equal_reference_bf16(form):
    """On a GPU, the Triton kernel and gather + cuDNN give the reference's output in bf16
    (pages of 16 positions: Triton's dots take blocks of at least 16)."""
    q, cache = paged_inputs(jnp.bfloat16, page_size=16)
    positions, segments = jnp.asarray(POSITIONS), jnp.asarray(SEGMENTS)
    want = attend_paged(q, cache, positions, segments, scale=0.25).astype(jnp.float32)
    if form == "kernel":
        got = attend_paged_kernel(q, cache, positions, segments, scale=0.25, k_splits=2)
    else:
        got = attend_paged_cudnn(q, cache, positions, segments, scale=0.25)
    chex.assert_trees_all_close(got.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)
