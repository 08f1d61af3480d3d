"""The KV cache's writes: row by row, and a prefill's windows as whole blocks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from models.config import PRESETS
from models.inputs.rows import RowsPhase
from models.layers.attention.kv_cache import KVCache
from models.layers.attention.self_attention import Attention

SLOTS, MAX_LEN, KV, DIM = 3, 6, 2, 4
WINDOW = 4
# Windows of 4 rows: slot 2's sequence, padding, slot 0's sequence, then 2 rows of padding
# past the last whole window.
SEGMENTS = np.array([2] * 4 + [-1] * 4 + [0] * 4 + [-1] * 2, np.int32)


def _old_cache(seed: int = 0) -> KVCache:
    """A cache whose every entry holds a value no write produces, so a stray write shows."""
    k, v = jax.random.normal(jax.random.key(seed), (2, SLOTS, MAX_LEN, KV, DIM)) + 10.0
    return KVCache(k=k, v=v)


def _rows(seed: int = 1) -> tuple[jax.Array, jax.Array]:
    return tuple(jax.random.normal(jax.random.key(seed), (2, SEGMENTS.size, KV, DIM)))


def _positions() -> np.ndarray:
    return np.array([i % WINDOW for i in range(SEGMENTS.size)], np.int32)


def test_windows_write_each_sequence_whole_into_its_slot():
    """Each sequence's window lands in its slot from row 0; padding windows, the rows past the
    last whole window and the slot no window names keep what they held."""
    k, v = _rows()
    old = _old_cache()
    got = jax.jit(KVCache.put_windows, static_argnums=4)(old, k, v, jnp.asarray(SEGMENTS), WINDOW)
    want_k, want_v = np.array(old.k), np.array(old.v)
    for window, slot in ((0, 2), (2, 0)):
        rows = slice(window * WINDOW, (window + 1) * WINDOW)
        want_k[slot, :WINDOW], want_v[slot, :WINDOW] = k[rows], v[rows]
    np.testing.assert_array_equal(np.asarray(got.k), want_k)
    np.testing.assert_array_equal(np.asarray(got.v), want_v)
    rows_written = old.put_rows(k, v, jnp.asarray(SEGMENTS), jnp.asarray(_positions()))
    np.testing.assert_array_equal(np.asarray(got.k), np.asarray(rows_written.k))
    np.testing.assert_array_equal(np.asarray(got.v), np.asarray(rows_written.v))


def test_a_block_of_padding_writes_nothing():
    """An attention-DP rank with no sequence (every window padding) leaves its cache as it was."""
    k, v = _rows()
    old = _old_cache()
    got = old.put_windows(k, v, jnp.full(SEGMENTS.size, -1, jnp.int32), WINDOW)
    np.testing.assert_array_equal(np.asarray(got.k), np.asarray(old.k))
    np.testing.assert_array_equal(np.asarray(got.v), np.asarray(old.v))


def test_windows_longer_than_the_cache_or_with_cp_positions_are_refused():
    k, v = _rows()
    with pytest.raises(ValueError, match="within the cache's 6 rows"):
        _old_cache().put_windows(k, v, jnp.asarray(SEGMENTS), MAX_LEN + 1)
    old = _old_cache()
    with_positions = KVCache(old.k, old.v, jnp.full((SLOTS, MAX_LEN), -1, jnp.int32))
    with pytest.raises(ValueError, match="without CP positions"):
        with_positions.put_windows(k, v, jnp.asarray(SEGMENTS), WINDOW)


def test_attention_prefill_writes_windows_as_blocks():
    """A PREFILL given its window rows stores the same cache as one written row by row, and
    does it as one block per window (the scatter's updates are [windows, window, kv, dim])."""
    config = dataclasses.replace(
        PRESETS["tiny-qwen3"], hidden_size=32, head_dim=DIM, num_kv_heads=KV
    )
    attn = Attention(config.attention_spec(0), topology=bj.Topology(), rngs=nnx.Rngs(0))
    h = jax.random.normal(jax.random.key(2), (SEGMENTS.size, config.hidden_size))
    positions, segments = jnp.asarray(_positions()), jnp.asarray(SEGMENTS)
    old = _old_cache()

    def prefill(cache, window_rows):
        out, cache = attn(
            h, positions, segments, cache, phase=RowsPhase.PREFILL, window_rows=window_rows
        )
        return out, cache

    (out_rows, by_rows), (out_windows, by_windows) = prefill(old, None), prefill(old, WINDOW)
    np.testing.assert_array_equal(np.asarray(by_windows.k), np.asarray(by_rows.k))
    np.testing.assert_array_equal(np.asarray(by_windows.v), np.asarray(by_rows.v))
    np.testing.assert_allclose(np.asarray(out_windows), np.asarray(out_rows), atol=1e-6)
    assert not np.array_equal(np.asarray(by_rows.k), np.asarray(old.k))
    hlo = jax.jit(prefill, static_argnums=1).lower(old, WINDOW).as_text()
    cache = f") -> tensor<{SLOTS}x{MAX_LEN}x{KV}x{DIM}xf32>"
    blocks = f"tensor<{SEGMENTS.size // WINDOW}x{WINDOW}x{KV}x{DIM}xf32>{cache}"
    assert (
        hlo.count(blocks) == 2 and hlo.count(f"tensor<{SEGMENTS.size}x{KV}x{DIM}xf32>{cache}") == 0
    )
