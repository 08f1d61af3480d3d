"""cuDNN's packed prefill forms (GPU only): one segment through plain causal attention, several
through the ragged form, against float64 attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers.cudnn_attention import prefill_attention_cudnn


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("max_segments", [1, 3])
def test_cudnn_single_sequence_prefill(max_segments):
    """One sequence from row 0, then padding: the single-slot (plain causal) and the ragged
    cuDNN forms both equal causal attention over the sequence (grouped kv heads, bf16)."""
    length, rows, heads, kv, dim = 45, 64, 8, 2, 64
    q, k, v = (
        jax.random.normal(jax.random.key(i), (rows, n, dim), jnp.bfloat16)
        for i, n in ((0, heads), (1, kv), (2, kv))
    )
    segments = jnp.array([0] * length + [-1] * (rows - length), jnp.int32)
    got = prefill_attention_cudnn(q, k, v, segments, max_segments=max_segments, scale=0.125)
    qf, kf, vf = (np.asarray(a, np.float64)[:length] for a in (q, k, v))
    kf, vf = np.repeat(kf, heads // kv, axis=1), np.repeat(vf, heads // kv, axis=1)
    scores = np.einsum("thd,shd->hts", qf, kf) * 0.125
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("hts,shd->thd", weights / weights.sum(-1, keepdims=True), vf)
    got = np.asarray(got, np.float64)[:length]
    assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))
