"""Attention sinks and the o bias: the softmax with a sink logit per head in its denominator equals
float64 NumPy on the packed, blocked and decode paths, trains, and leaves padding rows zero; split
over attention TP with their heads (and the o bias counted on one rank) the layer sums to the
one-device layer; a decode over a window reads only the window; cuDNN takes layers with sinks."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from models.config import PRESETS
from models.layers.attention.attend import attend, attend_packed, causal_visibility
from models.layers.attention.kv_cache import KVCache
from models.layers.attention.self_attention import Attention, AttentionImpl
from models.layers.linear import RowParallelLinear
from tests.models import make_mesh, row_spec, run_sharded, sum_over, unsharded_copy

KV, GROUP, D = 2, 3, 8
SLOW = pytest.mark.slow
RNG = np.random.default_rng(11)


def numpy_attention(q, k, v, mask, scale, sinks):
    """float64: q [T, kv, group, D] over k, v [S, kv, D] under mask [T, S]; sinks [kv, group]
    (or None) join each head's denominator."""
    scores = np.einsum("tkgd,skd->tkgs", q, k) * scale
    scores = np.where(mask[:, None, None, :], scores, -np.inf)
    sink = -np.inf if sinks is None else sinks[None, :, :, None]
    peak = np.maximum(scores.max(-1, keepdims=True), sink)
    peak = np.where(np.isfinite(peak), peak, 0)
    weights = np.exp(scores - peak)
    weights /= np.maximum(weights.sum(-1, keepdims=True) + np.exp(sink - peak), 1e-300)
    return np.einsum("tkgs,skd->tkgd", weights, v)


def packed_case(rows: int = 40):
    """Two sequences of 23 and 14 rows and 3 padding rows, random q/k/v and sinks of N(0, 4)."""
    segments = np.array([0] * 23 + [1] * 14 + [-1] * (rows - 37), np.int32)
    positions = np.concatenate([np.arange(23), np.arange(14), np.zeros(rows - 37)]).astype(np.int32)
    q = RNG.standard_normal((rows, KV, GROUP, D))
    k, v = RNG.standard_normal((rows, KV, D)), RNG.standard_normal((rows, KV, D))
    return q, k, v, positions, segments, 2 * RNG.standard_normal((KV, GROUP))


@pytest.mark.parametrize("window", [None, 5])
def test_packed_and_blocked_attention_with_sinks_equal_float64(window):
    """The packed prefill (over all row pairs, and blocked by a sequence bound) and a masked
    decode-style call equal NumPy's softmax with the sink in the denominator; without the sink
    the output differs (the sinks matter), and padding rows are zero."""
    q, k, v, positions, segments, sinks = packed_case()
    mask = (segments[:, None] == segments[None, :]) & (segments >= 0)[:, None]
    mask &= np.asarray(causal_visibility(positions, positions, window))
    want = numpy_attention(q, k, v, mask, 0.3, sinks)
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
    sink32 = jnp.asarray(sinks, jnp.float32)
    for bound in (None, 23):  # all pairs; key blocks within the longest sequence
        got = attend_packed(
            *args,
            jnp.asarray(positions),
            jnp.asarray(segments),
            scale=0.3,
            max_sequence_rows=bound,
            sliding_window=window,
            sinks=sink32,
        )
        chex.assert_trees_all_close(np.asarray(got), want, atol=1e-5)
    per_row = attend(args[0], args[1], args[2], jnp.asarray(mask), "skd", 0.3, sinks=sink32)
    chex.assert_trees_all_close(np.asarray(per_row), want, atol=1e-5)
    assert not np.any(np.asarray(per_row)[segments < 0])
    plain = numpy_attention(q, k, v, mask, 0.3, None)
    assert np.max(np.abs(plain - want)) > 0.1


def test_sinks_get_gradients_and_padding_stays_finite():
    """The loss's gradient reaches every head's sink, and is finite with padding rows (whose
    every key is masked: the sink takes all their weight, and their output is zero)."""
    q, k, v, positions, segments, sinks = packed_case()

    def loss(sinks, q):
        out = attend_packed(
            q,
            jnp.asarray(k, jnp.float32),
            jnp.asarray(v, jnp.float32),
            jnp.asarray(positions),
            jnp.asarray(segments),
            scale=0.3,
            sinks=sinks,
        )
        return jnp.sum(out**2)

    grads = jax.grad(loss, argnums=(0, 1))(
        jnp.asarray(sinks, jnp.float32), jnp.asarray(q, jnp.float32)
    )
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.abs(np.asarray(grads[0])) > 0)


# --------------------------------------------------------------------------------------------
# The layer, split over attention TP
# --------------------------------------------------------------------------------------------

BASE = dataclasses.replace(
    PRESETS["tiny-gpt-oss"], hidden_size=32, head_dim=8, initializer_range=32**-0.5
)
ROWS = 12


def build(topology: bj.Topology, impl: AttentionImpl = AttentionImpl.XLA) -> Attention:
    attn = Attention(BASE.attention_spec(0), topology=topology, impl=impl, rngs=nnx.Rngs(0))
    for head, _ in enumerate(attn.sinks[...]):  # sinks of order one (the preset draws 0.02)
        attn.sinks[head] = 2.0 * (head % 3) - 1.0
    return attn


@pytest.mark.parametrize(
    "dp,tp", [(2, 2), pytest.param(1, 4, marks=SLOW), pytest.param(1, 8, marks=SLOW)], ids=str
)
def test_sinks_and_o_bias_split_over_attention_tp_sum_to_one_device(dp, tp):
    """Each rank's sinks are its heads' (its kv head shared by ranks at TP 4 and 8) and the o
    bias is added by one attention-TP rank: the sum over attention TP equals one device, on
    each DP rank's rows, in a sliding-window layer (TP 4 runs by default in the golden test)."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    attn = build(topology)
    h = jax.random.normal(jax.random.key(2), (dp * ROWS, BASE.hidden_size), jnp.float32)
    positions = jnp.tile(jnp.array([*range(9), 0, 1, 0], jnp.int32), dp)
    segments = jnp.tile(jnp.array([0] * 9 + [1, 1, -1], jnp.int32), dp)
    rows = row_spec(topology)

    def body(module, h, positions, segments):
        # As the attention stage's boundary counts the bias it declares replicated.
        first = bj.ops.is_first_rank(topology.group_names(bj.SumGroup.ATTN_TP))
        out, _ = module(h, positions, segments, counts_bias=first)
        return sum_over(out, topology, bj.SumGroup.ATTN_TP)

    hidden = row_spec(topology, None)
    got = run_sharded(
        attn, make_mesh(dp, tp), body, (h, positions, segments), (hidden, rows, rows), hidden
    )
    reference = unsharded_copy(
        attn, lambda t: Attention(BASE.attention_spec(0), topology=t, rngs=nnx.Rngs(9))
    )
    want = jnp.concatenate(
        [
            reference(
                *(a.reshape(dp, ROWS, *a.shape[1:])[r] for a in (h, positions, segments)),
                counts_bias=True,
            )[0]
            for r in range(dp)
        ]
    )
    chex.assert_trees_all_close(got, want, atol=2e-5)


def test_row_parallel_bias_is_counted_once():
    """A row-parallel projection's bias, whole on every rank, comes out once in the group's sum
    when added where its stage counts it; the projection refuses to run without being told."""
    topology = bj.Topology(attn_tp=4)
    layer = RowParallelLinear(
        8, 6, group=bj.SumGroup.ATTN_TP, topology=topology, bias=True, rngs=nnx.Rngs(1)
    )
    x = jax.random.normal(jax.random.key(3), (5, 8), jnp.float32)
    with pytest.raises(ValueError, match="pass counts_bias"):
        layer(x)
    first = topology.group_names(bj.SumGroup.ATTN_TP)
    got = run_sharded(
        layer,
        make_mesh(1, 4),
        lambda module, x: sum_over(
            module(x, counts_bias=bj.ops.is_first_rank(first)), topology, bj.SumGroup.ATTN_TP
        ),
        (x,),
        (jax.sharding.PartitionSpec(None, topology.shard_entry(bj.SumGroup.ATTN_TP)),),
        jax.sharding.PartitionSpec(),
    )
    want = np.asarray(x) @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...])
    chex.assert_trees_all_close(np.asarray(got), want, atol=1e-5)


def test_cudnn_takes_layers_with_sinks_and_windows():
    """On the GPU path (AttentionImpl.CUDNN, bf16) cuDNN takes a layer with sinks and a sliding
    window (the sink applied from cuDNN's log-sum-exp); float32 stays on the jnp form."""
    spec = BASE.attention_spec(0)
    assert spec.sinks and spec.sliding_window is not None
    layer = Attention(spec, topology=bj.Topology(), impl=AttentionImpl.CUDNN, rngs=nnx.Rngs(0))
    assert layer.takes_cudnn(jnp.bfloat16)
    assert not layer.takes_cudnn(jnp.float32)


@pytest.mark.parametrize("window", [4, None])
def test_decode_reads_each_rows_window(window):
    """A decode step over a cache longer than the window reads each row's window only (gathered
    per row): rows before, at and past the window's length, at the cache's end, past it, and an
    idle row, equal float64 NumPy over the whole cache under the causal window mask."""
    spec = dataclasses.replace(BASE.attention_spec(0), sliding_window=window)
    layer = Attention(spec, topology=bj.Topology(), rngs=nnx.Rngs(0))
    slots, max_len = 6, 12
    heads, kv, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    k_cache = RNG.standard_normal((slots, max_len, kv, dim))
    v_cache = RNG.standard_normal((slots, max_len, kv, dim))
    cache = KVCache(jnp.asarray(k_cache, jnp.float32), jnp.asarray(v_cache, jnp.float32))
    positions = np.array([1, 3, 7, 11, 13, 0], np.int32)
    valid = np.array([True] * 5 + [False])
    q = RNG.standard_normal((slots, heads, dim))
    sinks = 2 * RNG.standard_normal((kv, heads // kv))
    got = layer._decode_jnp(
        jnp.asarray(q, jnp.float32),
        cache,
        jnp.asarray(positions),
        jnp.asarray(valid),
        jnp.asarray(sinks, jnp.float32),
    )
    keys = np.arange(max_len)
    for row in range(slots):
        mask = np.asarray(causal_visibility(positions[row : row + 1], keys, window)) & valid[row]
        want = numpy_attention(
            q[row : row + 1].reshape(1, kv, -1, dim),
            k_cache[row],
            v_cache[row],
            mask,
            layer.scale,
            sinks,
        )
        np.testing.assert_allclose(np.asarray(got[row]), want[0], atol=1e-5)


def test_sinks_under_attention_cp_are_refused():
    with pytest.raises(NotImplementedError, match="attention sinks are not built under"):
        Attention(BASE.attention_spec(0), topology=bj.Topology(attn_cp=2), rngs=nnx.Rngs(0))
