"""Gated DeltaNet: the chunked gated delta rule against the recurrence over packed rows, the decode
step, the mixer under attention TP, and its decode cache against a longer prefill."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from models.config.linear_attention import DeltaProjections, GatedDeltaNetSpec
from models.inputs.rows import RowsPhase
from models.layers.mixers.delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_reference,
    gated_delta_rule_step,
)
from models.layers.mixers.gated_deltanet import DeltaCache, DeltaSplit, GatedDeltaNet
from tests.models import make_mesh, row_spec, run_sharded, sum_over
from tests.models.layers.mixers.test_mamba2 import layout_rows, rank_block

# Packed rows: (slot, length) per sequence, then padding; slot 3 holds two sequences one after
# the other, and lengths cross chunk boundaries of 4 and 7 rows anywhere.
LAYOUT = ((0, 9), (2, 1), (3, 4), (3, 6), (1, 13))


def numpy_delta_rule(q, k, v, g, beta, positions, segments, slots):
    """The recurrence in float64 NumPy, row by row: the spec (q, k L2-normalized here)."""
    per_key = v.shape[1] // q.shape[1]
    q = np.repeat(q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6), per_key, 1)
    k = np.repeat(k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6), per_key, 1)
    q = q / np.sqrt(q.shape[-1])
    state = np.zeros((v.shape[1], q.shape[2], v.shape[2]))
    finals = np.zeros((slots, *state.shape))
    out = np.zeros(v.shape)
    for t in range(v.shape[0]):
        if t == 0 or segments[t] != segments[t - 1] or positions[t] == 0:
            state = np.zeros_like(state)
        if segments[t] < 0:
            continue
        # A scalar gate per head decays its whole state, a per-channel one each key row.
        state = state * (np.exp(g[t])[:, None, None] if g.ndim == 2 else np.exp(g[t])[..., None])
        delta = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t])
        finals[segments[t]] = state
    return out, finals


def random_rule_inputs(
    rows: int, k_heads=2, v_heads=4, k_dim=5, v_dim=3, seed=0, per_channel=False
):
    """Random q, k, v, log gates (one per value head, or per key channel of each) and betas."""
    rng = np.random.default_rng(seed)
    gates = (rows, v_heads, k_dim) if per_channel else (rows, v_heads)
    return (
        rng.standard_normal((rows, k_heads, k_dim)),
        rng.standard_normal((rows, k_heads, k_dim)),
        rng.standard_normal((rows, v_heads, v_dim)),
        -rng.uniform(0.01, 1.0, gates),
        rng.uniform(0.05, 0.95, (rows, v_heads)),
    )


GATES = [
    pytest.param((chunk, per_channel), id=f"chunk{chunk}-{'channel' if per_channel else 'head'}")
    for chunk, per_channel in ((4, False), (7, False), (64, False), (4, True), (7, True))
]


@pytest.mark.parametrize("case", GATES)
def test_chunked_rule_equals_float64_recurrence(case):
    """The chunked form equals the row-by-row recurrence within 1e-10 in float64, on ragged
    packed sequences (no state across a sequence start, wherever the chunks cut), final states
    per slot too, with a gate per head (Gated DeltaNet) or per key channel (Kimi Delta
    Attention); the `lax.scan` reference equals it as well."""
    chunk_size, per_channel = case
    positions, segments = layout_rows(LAYOUT)
    inputs = random_rule_inputs(len(positions), per_channel=per_channel)
    want_out, want_finals = numpy_delta_rule(*inputs, positions, segments, slots=5)
    with jax.enable_x64(True):
        out, finals = gated_delta_rule_chunked(
            *inputs, positions, segments, chunk_size=chunk_size, num_slots=5
        )
        assert out.dtype == finals.dtype == jnp.float64
        np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-10)
        np.testing.assert_allclose(finals, want_finals, rtol=0, atol=1e-10)
        if chunk_size == 7:
            ref_out, ref_finals = gated_delta_rule_reference(
                *inputs, positions, segments, num_slots=5
            )
            np.testing.assert_allclose(ref_out, want_out, rtol=0, atol=1e-12)
            np.testing.assert_allclose(ref_finals, want_finals, rtol=0, atol=1e-12)
    assert not want_finals[4].any() and np.abs(want_out).max() > 0.3


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
def test_decode_step_continues_the_recurrence(per_channel):
    """A decode step from each slot's final state gives the recurrence's next row (float64),
    gates per head or per key channel; an idle slot keeps its state and reads zeros."""
    positions, segments = layout_rows(LAYOUT)
    inputs = random_rule_inputs(len(positions) + 4, seed=1, per_channel=per_channel)
    step_inputs = [x[-4:] for x in inputs]
    inputs = [x[:-4] for x in inputs]
    valid = np.array([True, True, False, True])
    with jax.enable_x64(True):
        _, finals = gated_delta_rule_chunked(*inputs, positions, segments, num_slots=4)
        out, states = gated_delta_rule_step(finals, *step_inputs, valid)
    for slot in np.flatnonzero(valid):
        last = np.flatnonzero(segments == slot)[-1]
        first = last - positions[last]
        rows = [*range(first, last + 1)]
        seq = [
            np.concatenate([x[rows], s[slot : slot + 1]])
            for x, s in zip(inputs, step_inputs, strict=True)
        ]
        n = len(rows) + 1
        want_out, want_final = numpy_delta_rule(
            *seq, np.arange(n, dtype=np.int32), np.zeros(n, np.int32), slots=1
        )
        np.testing.assert_allclose(out[slot], want_out[-1], atol=1e-10)
        np.testing.assert_allclose(states[slot], want_final[0], atol=1e-10)
    assert not np.asarray(out[2]).any()
    np.testing.assert_array_equal(states[2], finals[2])


def test_chunked_rule_float32_is_float32_and_close():
    """Float32 inputs give a float32 output and state close to the float64 recurrence."""
    positions, segments = layout_rows(LAYOUT)
    inputs = random_rule_inputs(len(positions), k_heads=4, v_heads=4, k_dim=16, v_dim=8, seed=2)
    want_out, want_finals = numpy_delta_rule(*inputs, positions, segments, slots=4)
    single = [np.asarray(v, np.float32) for v in inputs]
    out, finals = gated_delta_rule_chunked(*single, positions, segments, num_slots=4)
    assert out.dtype == finals.dtype == jnp.float32
    np.testing.assert_allclose(out, want_out, atol=1e-5 * np.abs(want_out).max())
    np.testing.assert_allclose(finals, want_finals, atol=1e-5 * np.abs(want_finals).max())


def test_chunked_rule_float32_with_aligned_keys():
    """Keys all alike and betas near 1 make the chunk's system I + A all ones below the diagonal
    (its powers grow as binomials): the float32 chunked form still follows the recurrence."""
    rows = 128
    q, k, v, g, beta = random_rule_inputs(rows, k_heads=2, v_heads=2, k_dim=16, v_dim=8, seed=3)
    k = np.broadcast_to(k[:1], k.shape)
    beta = np.ones_like(beta)
    g = np.zeros_like(g)
    positions, segments = np.arange(rows), np.zeros(rows, np.int32)
    want_out, _ = numpy_delta_rule(q, k, v, g, beta, positions, segments, slots=1)
    single = [np.asarray(x, np.float32) for x in (q, k, v, g, beta)]
    out, _ = gated_delta_rule_chunked(*single, positions, segments, chunk_size=64, num_slots=1)
    np.testing.assert_allclose(out, want_out, atol=1e-4 * np.abs(want_out).max())


# A mixer with 4 key heads of 8, 2 value heads each of 6, conv 4, chunks of 8 (so that the
# tests' sequences cross chunks); the tests share its compiled one-device prefill and decode.
SPEC = GatedDeltaNetSpec(
    hidden_size=32, num_k_heads=4, num_v_heads=8, k_dim=8, v_dim=6, conv_kernel=4, chunk_size=8
)
SLOTS = 4  # per attention-DP rank
ROWS = 32  # per attention-DP rank
# Per DP rank: (slot, length) of its sequences; slot 3 of rank 0 stays idle.
PACKINGS = (((0, 17), (2, 1), (1, 5)), ((1, 9), (3, 2), (0, 13), (2, 6)))


def packed(dp: int) -> tuple[np.ndarray, np.ndarray]:
    rows = [
        layout_rows(PACKINGS[r % 2], ROWS - sum(n for _, n in PACKINGS[r % 2])) for r in range(dp)
    ]
    return tuple(np.concatenate(parts) for parts in zip(*rows, strict=True))


def decode_segments(dp: int) -> np.ndarray:
    """One row per slot: slot s of a rank is active where it holds a sequence."""
    rows = np.full((dp, SLOTS), -1, np.int32)
    for r in range(dp):
        for slot, _ in PACKINGS[r % 2]:
            rows[r, slot] = slot
    return rows.reshape(-1)


@functools.cache
def one_device(spec: GatedDeltaNetSpec):
    """Jitted one-device prefill and decode calls, each `(params, h, positions, segments, cache)
    -> (out, cache)` with `params` a mixer's pure parameter dict."""
    graphdef, template = nnx.split(GatedDeltaNet(spec, topology=bj.Topology(), rngs=nnx.Rngs(5)))

    def call(phase, params, h, positions, segments, cache):
        state = jax.tree.map(lambda v: v, template)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)(h, positions, segments, cache, phase=phase)

    prefill = jax.jit(functools.partial(call, RowsPhase.PREFILL))
    return prefill, jax.jit(functools.partial(call, RowsPhase.DECODE))


def params_of(mixer: GatedDeltaNet) -> dict:
    return nnx.to_pure_dict(nnx.state(mixer, nnx.Param))


def conv_rank_blocks(conv: np.ndarray, spec: GatedDeltaNetSpec, tp: int) -> np.ndarray:
    """A one-device conv state [slots, K - 1, 2 key + value] in the rank-block layout of the
    global cache at attention TP `tp` (each rank's q, k, then v channels)."""
    key, value = spec.key_size // tp, spec.value_size // tp
    blocks = []
    for rank in range(tp):
        for start, width in ((0, key), (spec.key_size, key), (2 * spec.key_size, value)):
            blocks.append(conv[..., start + rank * width : start + (rank + 1) * width])
    return np.concatenate(blocks, axis=-1)


# TP 4 runs by default (one key head per rank); DP 2 x TP 2 under -m slow.
@pytest.mark.parametrize(
    "dp,tp,projections",
    [
        (1, 4, DeltaProjections.PER_KEY_HEAD),
        pytest.param(2, 2, DeltaProjections.SEPARATE, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_mixer_under_attention_tp_equals_one_device(dp, tp, projections):
    """Summed over attention TP, the out_proj partials of a prefill and of a decode step equal
    the one-device mixer on each DP rank's rows, and the caches hold the same states."""
    spec = dataclasses.replace(SPEC, projections=projections)
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    mixer = GatedDeltaNet(spec, topology=topology, rngs=nnx.Rngs(7))
    h = jax.random.normal(jax.random.key(1), (dp * ROWS, spec.hidden_size))
    step_h = jax.random.normal(jax.random.key(2), (dp * SLOTS, spec.hidden_size))
    positions, segments = packed(dp)
    step_segments = decode_segments(dp)
    step_positions = np.full(dp * SLOTS, 20, np.int32)
    cache = DeltaCache.create(spec, topology, slots=dp * SLOTS)
    rows, cache_specs = row_spec(topology), DeltaCache.specs(topology)

    def body(module, h, positions, segments, step_h, step_positions, step_segments, cache):
        out, cache = module(h, positions, segments, cache)
        step, cache = module(step_h, step_positions, step_segments, cache, phase=RowsPhase.DECODE)
        done = lambda v: sum_over(v, topology, bj.SumGroup.ATTN_TP)  # noqa: E731
        return done(out), done(step), cache

    args = (h, positions, segments, step_h, step_positions, step_segments, cache)
    specs = (row_spec(topology, None), rows, rows, row_spec(topology, None), rows, rows)
    out, step, cache = run_sharded(
        mixer,
        make_mesh(dp, tp),
        body,
        args,
        (*specs, cache_specs),
        (specs[0], specs[0], cache_specs),
    )
    prefill, decode = one_device(spec)
    state = params_of(mixer)
    for r in range(dp):
        block = functools.partial(rank_block, dp=dp, rank=r)
        want_cache = DeltaCache.create(spec, bj.Topology(), slots=SLOTS)
        want_out, want_cache = prefill(
            state, *(block(v, ROWS) for v in (h, positions, segments)), want_cache
        )
        step_in = (block(v, SLOTS) for v in (step_h, step_positions, step_segments))
        want_step, want_cache = decode(state, *step_in, want_cache)
        chex.assert_trees_all_close(block(out, ROWS), want_out, atol=2e-5)
        chex.assert_trees_all_close(block(step, SLOTS), want_step, atol=2e-5)
        chex.assert_trees_all_close(block(cache.state, SLOTS), want_cache.state, atol=2e-5)
        want_conv = conv_rank_blocks(np.asarray(want_cache.conv), spec, tp)
        chex.assert_trees_all_close(block(cache.conv, SLOTS), want_conv, atol=1e-6)
    assert np.all(np.asarray(out)[np.asarray(segments) < 0] == 0)
    assert np.all(np.asarray(step)[step_segments < 0] == 0) and np.abs(np.asarray(out)).max() > 0.1
    assert not np.asarray(cache.state)[step_segments < 0].any()


def test_prefill_then_decode_equals_a_longer_prefill():
    """Prefill, then three decode steps from the cache (conv and recurrent state), give the
    outputs the mixer gives the whole sequences prefilled at once; an idle slot's state stays
    zero, and a prefill writes only the slots it has rows of."""
    prefill, decode = one_device(SPEC)
    state = params_of(GatedDeltaNet(SPEC, topology=bj.Topology(), rngs=nnx.Rngs(3)))
    lengths, steps = (11, 1, 6), 3
    h = jax.random.normal(jax.random.key(4), (ROWS, SPEC.hidden_size))
    whole = tuple((s, n + steps) for s, n in enumerate(lengths))
    whole = layout_rows(whole, padding=ROWS - sum(n for _, n in whole))
    empty = DeltaCache.create(SPEC, bj.Topology(), slots=SLOTS)
    want = prefill(state, h, *whole, empty)[0]
    first = np.cumsum((0,) + tuple(n + steps for n in lengths))[:-1]
    prefix = np.concatenate([np.arange(f, f + n) for f, n in zip(first, lengths, strict=True)])
    prefix = np.concatenate([prefix, np.full(ROWS - len(prefix), ROWS - 1)])
    pad = ROWS - sum(lengths)
    out, cache = prefill(state, h[prefix], *layout_rows(tuple(enumerate(lengths)), pad), empty)
    chex.assert_trees_all_close(out[: sum(lengths)], want[prefix[: sum(lengths)]], atol=1e-5)
    segments = np.array([0, 1, 2, -1], np.int32)
    for step in range(steps):
        rows = np.array([f + n + step for f, n in zip(first, lengths, strict=True)])
        step_h = jnp.concatenate([h[rows], jnp.ones((1, SPEC.hidden_size))])
        positions = np.array([*(n + step for n in lengths), 0], np.int32)
        got, cache = decode(state, step_h, positions, segments, cache)
        chex.assert_trees_all_close(got[:3], want[rows], atol=1e-5)
        assert not np.asarray(got[3]).any()
    assert not np.asarray(cache.state[3]).any() and not np.asarray(cache.conv[3]).any()
    later = layout_rows(((3, 5),), padding=ROWS - 5)
    alone = prefill(state, h, *later, empty)[1]
    both = prefill(state, h, *later, cache)[1]
    for field in ("conv", "state"):
        kept, new = np.asarray(getattr(both, field)), np.asarray(getattr(alone, field))
        np.testing.assert_array_equal(kept[:3], np.asarray(getattr(cache, field))[:3])
        np.testing.assert_array_equal(kept[3], new[3])
        assert new[3].any()


def test_rejects_bad_splits_and_caches():
    """Key heads must split evenly over attention TP; value heads are a multiple of key heads;
    a decode needs its cache, of this rank's shape."""
    with pytest.raises(ValueError, match="num_k_heads .* multiple of the attention-TP"):
        GatedDeltaNet(SPEC, topology=bj.Topology(attn_tp=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        dataclasses.replace(SPEC, num_v_heads=6)
    assert DeltaSplit.of(SPEC, bj.Topology(attn_tp=2)).local_v_heads == 4
    mixer = GatedDeltaNet(SPEC, topology=bj.Topology(), rngs=nnx.Rngs(0))
    h, rows = jnp.zeros((4, SPEC.hidden_size)), np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="DECODE call needs a cache"):
        mixer(h, rows, rows, phase=RowsPhase.DECODE)
    wrong = DeltaCache.create(dataclasses.replace(SPEC, v_dim=4), bj.Topology(), slots=4)
    with pytest.raises(ValueError, match="Gated DeltaNet cache must be"):
        mixer(h, rows, rows, wrong)


def test_spec_chunk_storage_reaches_the_chunked_rule():
    """`chunk_storage='bfloat16'` makes the mixer's prefill round the chunked form's terms: its
    output moves off the float32-storage one by more than float32 noise and less than bf16's
    error, and its cached state stays float32; a dtype name that is no float of at most 32
    bits is refused."""
    bf16 = dataclasses.replace(SPEC, chunk_storage="bfloat16")
    state = params_of(GatedDeltaNet(SPEC, topology=bj.Topology(), rngs=nnx.Rngs(3)))
    h = jax.random.normal(jax.random.key(4), (ROWS, SPEC.hidden_size))
    positions, segments = layout_rows(((0, 20), (1, 9)), padding=ROWS - 29)
    empty = DeltaCache.create(SPEC, bj.Topology(), slots=SLOTS)
    want, want_cache = one_device(SPEC)[0](state, h, positions, segments, empty)
    got, cache = one_device(bf16)[0](state, h, positions, segments, empty)
    gap = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    assert 1e-5 < gap < 2e-2, gap
    assert cache.state.dtype == jnp.float32
    chex.assert_trees_all_close(
        cache.state, want_cache.state, atol=2e-2 * float(jnp.abs(want_cache.state).max())
    )
    for bad in ("int8", "float64", "no-such-type"):
        with pytest.raises(ValueError, match="chunk_storage"):
            dataclasses.replace(SPEC, chunk_storage=bad)
