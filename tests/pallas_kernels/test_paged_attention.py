"""The Pallas paged attention kernel against the `jnp` reference (`attend_paged`): interpreted
on CPU, and its Triton form in bf16 on a GPU."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers.attention.paged import (
    PagedKVCache,
    attend_paged,
    attend_paged_kernel,
    paged_attention,
)
from pallas_kernels.paged_attention import kernel_supports, ragged_paged_attention

ON_GPU = jax.default_backend() == "gpu"
PAGES, KV, GROUP, HEAD_DIM, SLOTS, PER_SEQUENCE = 40, 2, 3, 16, 4, 8
# One step's rows: a prompt chunk of slot 2 (positions 3..12, more rows than a block), a
# decode row of slot 0, slot 3's first row, slot 1's first chunk, then padding.
SEGMENTS = np.array([2] * 10 + [0, 3] + [1] * 5 + [-1] * 3, np.int32)
POSITIONS = np.array([*range(3, 13), 20, 0, *range(5), 0, 0, 0], np.int32)
SCALE = 0.3
TOL = 2e-3 if ON_GPU else 1e-5  # the interpreter's float32 dots run as TF32 on a GPU


def paged_inputs(dtype=jnp.float32, page_size: int = 4):
    """Queries and a cache whose slots' pages are drawn from a shuffled pool."""
    keys = jax.random.split(jax.random.key(0), 4)
    pool = (PAGES, page_size, KV, HEAD_DIM)
    k = jax.random.normal(keys[0], pool, dtype)
    v = jax.random.normal(keys[1], pool, dtype)
    order = np.random.default_rng(0).permutation(PAGES)[: SLOTS * PER_SEQUENCE]
    table = jnp.asarray(order.reshape(SLOTS, PER_SEQUENCE), jnp.int32)
    q = jax.random.normal(keys[2], (len(SEGMENTS), KV, GROUP, HEAD_DIM), dtype)
    sinks = 2.0 * jax.random.normal(keys[3], (KV, GROUP))
    return q, PagedKVCache(k, v, table), sinks


def interpreted(q, cache, sinks=None, window=None, rows_per_block=None):
    return ragged_paged_attention(
        q,
        cache.k,
        cache.v,
        cache.page_table,
        jnp.asarray(POSITIONS),
        jnp.asarray(SEGMENTS),
        scale=SCALE,
        sliding_window=window,
        sinks=sinks,
        rows_per_block=rows_per_block,
        pages_per_block=2,
        interpret=True,
    )


def reference(q, cache, sinks=None, window=None):
    positions, segments = jnp.asarray(POSITIONS), jnp.asarray(SEGMENTS)
    return attend_paged(
        q, cache, positions, segments, scale=SCALE, sliding_window=window, sinks=sinks
    )


@pytest.mark.parametrize(
    "rows_per_block, window, with_sinks",
    [(None, None, False), (4, None, False), (1, 5, False), (4, None, True), (4, 3, True)],
)
def test_kernel_interpreted_equals_reference(rows_per_block, window, with_sinks):
    """Chunks longer than a block, decode rows, a first row and padding rows: each row equals
    the reference's (within a sliding window, with sinks), padding rows are 0."""
    q, cache, sinks = paged_inputs()
    sinks = sinks if with_sinks else None
    got = interpreted(q, cache, sinks, window, rows_per_block)
    chex.assert_trees_all_close(got, reference(q, cache, sinks, window), atol=TOL, rtol=TOL)
    assert not np.asarray(got[-3:]).any()


def test_kernel_mutants_change_the_rows_they_should():
    """The kernel reads through the page table (a swapped page of slot 1 changes slot 1's rows
    only), its causal mask is each row's own (a later key changed reaches only the rows at or
    past it) and the sinks are in the denominator (other sinks, other outputs)."""
    q, cache, sinks = paged_inputs()
    got = np.asarray(interpreted(q, cache, sinks, rows_per_block=4))
    unused = sorted(set(range(PAGES)) - set(np.asarray(cache.page_table).ravel()))[0]
    wrong = PagedKVCache(cache.k, cache.v, cache.page_table.at[1, 0].set(unused))
    changed = np.abs(np.asarray(interpreted(q, wrong, sinks, rows_per_block=4)) - got).max(
        axis=(1, 2, 3)
    )
    np.testing.assert_array_equal(changed > 1e-4, SEGMENTS == 1)
    # Slot 2's key at position 8 (page 2, offset 0) changed: its rows at positions >= 8 only.
    page = int(cache.page_table[2, 2])
    later = PagedKVCache(cache.k.at[page, 0].add(1.0), cache.v, cache.page_table)
    changed = np.abs(np.asarray(interpreted(q, later, sinks, rows_per_block=4)) - got).max(
        axis=(1, 2, 3)
    )
    np.testing.assert_array_equal(changed > 1e-4, (SEGMENTS == 2) & (POSITIONS >= 8))
    other = np.asarray(interpreted(q, cache, sinks + 1.0, rows_per_block=4))
    assert np.abs(other - got)[SEGMENTS >= 0].min(axis=(1, 2, 3)).min() > 1e-6


def test_attend_paged_kernel_takes_the_cache():
    """`attend_paged_kernel` (the attention layer's GPU path) is the kernel over the cache's
    pools and table."""
    q, cache, _ = paged_inputs()
    positions, segments = jnp.asarray(POSITIONS), jnp.asarray(SEGMENTS)
    got = attend_paged_kernel(q, cache, positions, segments, scale=SCALE, interpret=True)
    chex.assert_trees_all_close(got, reference(q, cache), atol=TOL, rtol=TOL)


def test_the_layer_takes_the_kernel_on_a_gpu_where_it_tiles():
    """`paged_attention` (the attention layer's choice) gives the kernel for a GPU layer of half
    precision over pages and heads it tiles, and the `jnp` reference otherwise."""
    _, cache, _ = paged_inputs(page_size=16)
    assert paged_attention(True, cache, jnp.bfloat16) is attend_paged_kernel
    assert paged_attention(False, cache, jnp.bfloat16) is attend_paged
    assert paged_attention(True, cache, jnp.float32) is attend_paged
    _, narrow, _ = paged_inputs(page_size=3)
    assert paged_attention(True, narrow, jnp.bfloat16) is attend_paged


def test_kernel_refuses_shapes_it_cannot_tile():
    """Pages or heads of a width that is not a power of two are refused at trace time."""
    q, cache, _ = paged_inputs(page_size=3)
    assert not kernel_supports(3, HEAD_DIM) and kernel_supports(16, 128)
    with pytest.raises(ValueError, match="powers of two"):
        interpreted(q, cache)


@pytest.mark.skipif(not ON_GPU, reason="the Triton kernel runs on a GPU")
@pytest.mark.parametrize("with_sinks", [False, True])
def test_kernel_on_gpu_equals_reference_bf16(with_sinks):
    """On a GPU the Triton kernel gives the reference's output in bf16 (pages of 16)."""
    q, cache, sinks = paged_inputs(jnp.bfloat16, page_size=16)
    sinks = sinks if with_sinks else None
    positions, segments = jnp.asarray(POSITIONS), jnp.asarray(SEGMENTS)
    got = attend_paged_kernel(q, cache, positions, segments, scale=SCALE, sinks=sinks)
    want = reference(q, cache, sinks).astype(jnp.float32)
    chex.assert_trees_all_close(got.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="two devices (CPU CI simulates eight)")
def test_kernel_under_shard_map_over_attention_dp():
    """Inside `shard_map` with the varying-axes check on, each DP rank's kernel reads its own
    pool through its own table: the result equals the reference's on each rank."""
    mesh = jax.make_mesh((2,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    q, cache, sinks = paged_inputs()
    positions, segments = jnp.asarray(POSITIONS), jnp.asarray(SEGMENTS)
    # Rank 1 holds other pools and its slots another table (pages reversed).
    pools = [jnp.concatenate([x, x[::-1] * 0.5]) for x in (cache.k, cache.v)]
    table = jnp.concatenate([cache.page_table, cache.page_table[:, ::-1]])
    spec = jax.sharding.PartitionSpec("dp")

    def run(form):
        def local(q, k, v, table, positions, segments):
            return form(q, PagedKVCache(k, v, table), positions, segments, scale=SCALE)

        stacked = [jnp.concatenate([x, x]) for x in (q, positions, segments)]
        mapped = jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)
        return jax.jit(mapped)(stacked[0], *pools, table, *stacked[1:])

    got = run(functools.partial(attend_paged_kernel, interpret=True))
    want = run(attend_paged)
    chex.assert_trees_all_close(got, want, atol=TOL, rtol=TOL)
    rows = len(SEGMENTS)
    assert np.abs(np.asarray(got[:rows]) - np.asarray(got[rows:])).max() > 1e-3
