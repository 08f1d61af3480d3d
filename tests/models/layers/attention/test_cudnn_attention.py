"""cuDNN's packed prefill forms (GPU only): windows (sequences filling windows of equal rows, or
one sequence), and the ragged layout, against float64 attention of each sequence alone, with a
value as wide as the key and a narrower one (latent attention's); with attention sinks and a
sliding window in prefill (values and gradients) and in decode. On any platform: the widest
head cuDNN is given, by the GPU's compute capability, and the segment bound a cache-less forward
gives its ragged prefill."""

import dataclasses
import importlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from models.build import build_model
from models.config import PRESETS
from models.layers.attention import cudnn
from models.layers.attention.attend import attend_packed
from models.layers.attention.cudnn import (
    decode_cache_cudnn,
    max_head_dim,
    prefill_attention_cudnn,
)
from models.layers.attention.kv_cache import KVCache
from models.layers.attention.self_attention import Attention, AttentionImpl
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

# form: (segment of each row's run as (segment, rows), max_segments, window_rows)
FORMS = {
    # Two windows of 16 rows, an idle one, then 4 rows short of a window.
    "windows": ([(0, 16), (1, 16), (-1, 16), (-1, 4)], 2, 16),
    "one segment": ([(0, 45), (-1, 19)], 1, None),
    "ragged": ([(1, 23), (0, 13), (2, 9), (-1, 19)], 3, None),
}


def _reference(q, k, v, runs, scale, window=None, sinks=None):
    """float64 causal attention within each run of rows (rows of padding runs: 0), within a
    sliding window of `window` rows (None: none), each head's sink logit (`sinks` [heads], or
    None) in its denominator."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    sink = -np.inf if sinks is None else np.asarray(sinks, np.float64)[:, None, None]
    out, start = np.zeros((*q.shape[:2], v.shape[-1])), 0
    for segment, length in runs:
        rows = slice(start, start + length)
        start += length
        if segment < 0:
            continue
        scores = np.einsum("thd,shd->hts", q[rows], k[rows]) * scale
        distance = np.arange(length)[:, None] - np.arange(length)[None, :]
        visible = (distance >= 0) & (distance < (window or length))
        scores = np.where(visible, scores, -np.inf)
        peak = np.maximum(scores.max(-1, keepdims=True), sink)
        weights = np.exp(scores - peak)
        weights /= weights.sum(-1, keepdims=True) + np.exp(sink - peak)
        out[rows] = np.einsum("hts,shd->thd", weights, v[rows])
    return out


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize(("dim", "v_dim"), [(64, 64), (64, 32), (256, 256)])
@pytest.mark.parametrize("form", FORMS)
def test_cudnn_prefill_forms(form, dim, v_dim):
    """Each form equals causal attention over each sequence (grouped kv heads, bf16), with the
    value as wide as the key and narrower, and at Qwen3-Next's head width 256 (Hopper's
    widest); every padding row (an idle window, rows past the last whole window, rows after
    the segments) comes out exactly 0."""
    if dim > max_head_dim():
        pytest.skip(f"this GPU's cuDNN takes heads up to {max_head_dim()} wide")
    runs, max_segments, window_rows = FORMS[form]
    rows, heads, kv = sum(n for _, n in runs), 8, 2
    q, k, v = (
        jax.random.normal(jax.random.key(i), (rows, n, d), jnp.bfloat16)
        for i, n, d in ((0, heads, dim), (1, kv, dim), (2, kv, v_dim))
    )
    segments = jnp.array([s for s, n in runs for _ in range(n)], jnp.int32)
    attend = jax.jit(
        lambda q, k, v, s: prefill_attention_cudnn(
            q, k, v, s, max_segments=max_segments, scale=dim**-0.5, window_rows=window_rows
        )
    )
    got = np.asarray(attend(q, k, v, segments), np.float64)
    assert got.shape == (rows, heads, v_dim)
    want = _reference(q, k, v, runs, dim**-0.5)
    real = np.asarray(segments) >= 0
    assert np.max(np.abs(got[real] - want[real])) <= 2e-2 * np.max(np.abs(want))
    assert np.all(got[~real] == 0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize(("dim", "v_dim"), [(96, 64), (256, 256)])
def test_cudnn_windows_gradient(dim, v_dim):
    """The windows form's backward, value narrower than the key or both 256 wide, equals XLA's
    float32 attention's (each window a sequence) within bf16 rounding."""
    if dim > max_head_dim():
        pytest.skip(f"this GPU's cuDNN takes heads up to {max_head_dim()} wide")
    windows, length, heads = 3, 32, 4
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


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("form", FORMS)
def test_cudnn_prefill_with_sinks_and_a_window(form, window):
    """Each form with sinks (of order one: they matter) and a sliding window equals float64
    attention with the sink in the denominator; padding rows stay 0."""
    runs, max_segments, window_rows = FORMS[form]
    rows, heads, kv, dim = sum(n for _, n in runs), 8, 2, 64
    q, k, v = (
        jax.random.normal(jax.random.key(i), (rows, n, dim), jnp.bfloat16)
        for i, n in ((0, heads), (1, kv), (2, kv))
    )
    sinks = 2.0 * jax.random.normal(jax.random.key(3), (heads,), jnp.float32)
    segments = jnp.array([s for s, n in runs for _ in range(n)], jnp.int32)
    attend = jax.jit(
        lambda q, k, v, s, sinks: prefill_attention_cudnn(
            q,
            k,
            v,
            s,
            max_segments=max_segments,
            scale=0.125,
            window_rows=window_rows,
            sliding_window=window,
            sinks=sinks,
        )
    )
    got = np.asarray(attend(q, k, v, segments, sinks), np.float64)
    want = _reference(q, k, v, runs, 0.125, window, sinks)
    without = _reference(q, k, v, runs, 0.125, window, jnp.full_like(sinks, -1e9))
    real = np.asarray(segments) >= 0
    assert np.max(np.abs(got[real] - want[real])) <= 2e-2 * np.max(np.abs(want))
    assert np.max(np.abs(want[real] - without[real])) > 0.1 * np.max(np.abs(want))
    assert np.all(got[~real] == 0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
def test_cudnn_prefill_with_sinks_differentiates_as_the_jnp_form():
    """The gradient of the cuDNN prefill with sinks (q, k, v and the sinks) equals the float32
    `jnp` form's, ragged layout and windows."""
    runs, max_segments, _ = FORMS["ragged"]
    rows, heads, kv, dim = sum(n for _, n in runs), 4, 2, 64
    q, k, v, cotangent = (
        jax.random.normal(jax.random.key(i), (rows, n, dim), jnp.float32)
        for i, n in ((0, heads), (1, kv), (2, kv), (3, heads))
    )
    sinks = jax.random.normal(jax.random.key(4), (heads,), jnp.float32)
    segments = jnp.array([s for s, n in runs for _ in range(n)], jnp.int32)

    def cudnn(q, k, v, sinks):
        return prefill_attention_cudnn(
            q.astype(jnp.bfloat16),
            k.astype(jnp.bfloat16),
            v.astype(jnp.bfloat16),
            segments,
            max_segments=max_segments,
            scale=0.125,
            sliding_window=7,
            sinks=sinks,
        ).astype(jnp.float32)

    def reference(q, k, v, sinks):
        rows_ = jnp.arange(rows)
        seg = jnp.where(segments >= 0, segments, max_segments)
        first = jax.ops.segment_min(rows_, seg, max_segments + 1)
        out = attend_packed(
            q.reshape(rows, kv, -1, dim),
            k,
            v,
            rows_ - first[seg],
            segments,
            scale=0.125,
            sliding_window=7,
            sinks=sinks.reshape(kv, -1),
        )
        return out.reshape(rows, heads, dim)

    got = jax.jit(lambda *a: jax.vjp(cudnn, *a)[1](cotangent))(q, k, v, sinks)
    want = jax.jit(lambda *a: jax.vjp(reference, *a)[1](cotangent))(q, k, v, sinks)
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.max(np.abs(g - w)) <= 3e-2 * np.max(np.abs(w))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("window", [None, 6])
def test_cudnn_decode_with_sinks_and_a_window(window, dim):
    """cuDNN's decode with sinks over each row's window (rows before, at and past the window's
    length, at the cache's end) equals float64 attention over the whole cache under the causal
    window mask with the sink in the denominator; heads 64 and 256 wide."""
    if dim > max_head_dim():
        pytest.skip(f"this GPU's cuDNN takes heads up to {max_head_dim()} wide")
    slots, max_len, heads, kv = 5, 32, 8, 2
    k, v = (
        jax.random.normal(jax.random.key(i), (slots, max_len, kv, dim), jnp.bfloat16)
        for i in (0, 1)
    )
    q = jax.random.normal(jax.random.key(2), (slots, heads, dim), jnp.bfloat16)
    sinks = 2.0 * jax.random.normal(jax.random.key(3), (heads,), jnp.float32)
    positions = jnp.array([0, 4, 5, 19, 31], jnp.int32)
    got = jax.jit(
        lambda q, cache, p, s: decode_cache_cudnn(
            q, cache, p, dim**-0.5, sliding_window=window, sinks=s
        )
    )(q, KVCache(k, v), positions, sinks)
    got = np.asarray(got, np.float64)
    for row, position in enumerate(np.asarray(positions)):
        runs = [(0, int(position) + 1)]
        keys = slice(0, int(position) + 1)
        qs = np.concatenate(
            [np.zeros((int(position), heads, dim)), np.asarray(q[row : row + 1], np.float64)]
        )
        want = _reference(qs, k[row, keys], v[row, keys], runs, dim**-0.5, window, sinks)[-1]
        assert np.max(np.abs(got[row] - want)) <= 2e-2 * np.max(np.abs(want))


def _no_gpu():
    raise RuntimeError(
        "Unknown backend: 'gpu' requested, but no platforms that are instances of gpu are present."
    )


@pytest.fixture
def fresh_max_head_dim():
    """`max_head_dim` recomputed inside the test and again after it (it is cached)."""
    max_head_dim.cache_clear()
    yield
    max_head_dim.cache_clear()


@pytest.mark.parametrize(
    ("gpus", "widest"),
    [
        (lambda: [types.SimpleNamespace(compute_capability="9.0")], 256),
        (lambda: [types.SimpleNamespace(compute_capability="10.0")], 256),
        (lambda: [types.SimpleNamespace(compute_capability="8.0")], 128),
        (lambda: [types.SimpleNamespace()], 128),
        (_no_gpu, 128),
    ],
    ids=["hopper", "blackwell", "ampere", "not-nvidia", "no-gpu"],
)
def test_cudnn_takes_heads_as_wide_as_the_gpu_allows(monkeypatch, fresh_max_head_dim, gpus, widest):
    """256-wide heads (Qwen3-Next's) go to cuDNN from Hopper on and to the jnp form before, on a
    GPU that is not NVIDIA's and without a GPU; 128-wide heads go to cuDNN everywhere."""
    layers = {
        width: Attention(
            dataclasses.replace(PRESETS["tiny-qwen3"].attention_spec(0), head_dim=width),
            topology=bj.Topology(),
            impl=AttentionImpl.CUDNN,
            rngs=nnx.Rngs(0),
        )
        for width in (128, 256)
    }
    monkeypatch.setattr(cudnn.jax, "devices", lambda backend=None: gpus())
    assert max_head_dim() == widest
    for width, layer in layers.items():
        assert layer.takes_cudnn(jnp.bfloat16) == (width <= widest)
        assert not layer.takes_cudnn(jnp.float32)


@pytest.mark.parametrize(
    "preset, module",
    [
        ("tiny-gpt-oss", "models.layers.attention.self_attention"),
        pytest.param("tiny-deepseek-v3", "models.layers.attention.latent", marks=pytest.mark.slow),
    ],
)
def test_cudnn_prefill_without_a_cache_is_bounded_by_the_packed_slots(monkeypatch, preset, module):
    """A cache-less forward hands cuDNN's ragged prefill the packed slots as its segment bound,
    not the rows (with sinks its log-sum-exps were [rows, heads, rows] float32: 4 GiB a layer
    for GPT-OSS-20B at 4096 rows), in self-attention and in latent attention alike. Any
    platform: the cuDNN call is replaced by one that records its bound."""
    bounds = []

    def recording(q, k, v, segment_ids, *, max_segments, **_):
        bounds.append(max_segments)
        return jnp.zeros((*q.shape[:2], v.shape[-1]), q.dtype)

    monkeypatch.setattr(importlib.import_module(module), "prefill_attention_cudnn", recording)
    topology = bj.Topology(attn_tp=min(2, jax.device_count()))
    mesh = bj.make_mesh(topology)
    options = BuildOptions(dtype=jnp.bfloat16, attention=AttentionImpl.CUDNN)
    runner = ShardedCausalLM(build_model(PRESETS[preset], topology, options, mesh=mesh), mesh)
    prompts = [[3] * 9, [5] * 4, [7] * 6]
    runner.forward(prompts)
    packed = runner.pack(prompts)
    assert packed.decode_rows_per_rank < packed.rows_per_rank
    assert bounds and set(bounds) == {packed.decode_rows_per_rank}
