"""cuDNN's packed prefill forms (GPU only): windows (sequences filling windows of equal rows, or
one sequence), and the ragged layout, against float64 attention of each sequence alone, with a
value as wide as the key and a narrower one (latent attention's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers.attention.cudnn import prefill_attention_cudnn

# form: (segment of each row's run as (segment, rows), max_segments, window_rows)
FORMS = {
    # Two windows of 16 rows, an idle one, then 4 rows short of a window.
    "windows": ([(0, 16), (1, 16), (-1, 16), (-1, 4)], 2, 16),
    "one segment": ([(0, 45), (-1, 19)], 1, None),
    "ragged": ([(1, 23), (0, 13), (2, 9), (-1, 19)], 3, None),
}


def _reference(q, k, v, runs, scale):
    """float64 causal attention within each run of rows (rows of padding runs: 0)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    out, start = np.zeros((*q.shape[:2], v.shape[-1])), 0
    for segment, length in runs:
        rows = slice(start, start + length)
        start += length
        if segment < 0:
            continue
        scores = np.einsum("thd,shd->hts", q[rows], k[rows]) * scale
        scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out[rows] = np.einsum("hts,shd->thd", weights, v[rows])
    return out


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("v_dim", [64, 32])
@pytest.mark.parametrize("form", FORMS)
def test_cudnn_prefill_forms(form, v_dim):
    """Each form equals causal attention over each sequence (grouped kv heads, bf16), with the
    value as wide as the key and narrower; every padding row (an idle window, rows past the
    last whole window, rows after the segments) comes out exactly 0."""
    runs, max_segments, window_rows = FORMS[form]
    rows, heads, kv, dim = sum(n for _, n in runs), 8, 2, 64
    q, k, v = (
        jax.random.normal(jax.random.key(i), (rows, n, d), jnp.bfloat16)
        for i, n, d in ((0, heads, dim), (1, kv, dim), (2, kv, v_dim))
    )
    segments = jnp.array([s for s, n in runs for _ in range(n)], jnp.int32)
    attend = jax.jit(
        lambda q, k, v, s: prefill_attention_cudnn(
            q, k, v, s, max_segments=max_segments, scale=0.125, window_rows=window_rows
        )
    )
    got = np.asarray(attend(q, k, v, segments), np.float64)
    assert got.shape == (rows, heads, v_dim)
    want = _reference(q, k, v, runs, 0.125)
    real = np.asarray(segments) >= 0
    assert np.max(np.abs(got[real] - want[real])) <= 2e-2 * np.max(np.abs(want))
    assert np.all(got[~real] == 0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
def test_cudnn_windows_gradient_with_a_narrower_value():
    """The windows form's backward, value narrower than the key, equals XLA's float32
    attention's (each window a sequence) within bf16 rounding."""
    windows, length, heads, dim, v_dim = 3, 32, 4, 96, 64
    q, k, v, cotangent = (
        jax.random.normal(jax.random.key(i), (windows * length, heads, d), jnp.bfloat16)
        for i, d in ((0, dim), (1, dim), (2, v_dim), (3, v_dim))
    )
    segments = jnp.repeat(jnp.arange(windows, dtype=jnp.int32), length)

    def cudnn(q, k, v):
        return prefill_attention_cudnn(
            q, k, v, segments, max_segments=windows, scale=0.1, window_rows=length
        )

    def xla(q, k, v):
        grid = [a.astype(jnp.float32).reshape(windows, length, heads, -1) for a in (q, k, v)]
        grid[2] = jnp.pad(grid[2], ((0, 0), (0, 0), (0, 0), (0, dim - v_dim)))
        out = jax.nn.dot_product_attention(*grid, scale=0.1, is_causal=True, implementation="xla")
        return out[..., :v_dim].reshape(windows * length, heads, v_dim)

    got = jax.jit(lambda *a: jax.vjp(cudnn, *a)[1](cotangent))(q, k, v)
    want = jax.jit(lambda *a: jax.vjp(xla, *a)[1](cotangent.astype(jnp.float32)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.max(np.abs(g - w)) <= 3e-2 * np.max(np.abs(w))


def test_windows_must_hold_a_row():
    """A window of no rows is refused before anything reaches cuDNN (on any backend)."""
    x = jnp.zeros((8, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="window_rows must be >= 1"):
        prefill_attention_cudnn(
            x, x, x, jnp.zeros(8, jnp.int32), max_segments=1, scale=1.0, window_rows=0
        )
