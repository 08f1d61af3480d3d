"""Mamba2: the chunked SSD scan and the conv over packed rows, the mixer under attention TP,
its decode cache, and parity with Hugging Face's NemotronH Mamba2 mixer."""

import dataclasses
import functools
import json
import math
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from models.inputs.rows import RowsPhase
from models.layers.mixers.mamba2 import (
    Mamba2Cache,
    Mamba2Mixer,
    Mamba2Spec,
    Mamba2Split,
    hf_mixer_params,
)
from models.layers.mixers.ssd import (
    causal_conv1d,
    causal_conv1d_step,
    conv_states,
    gated_rms_norm,
    ssd_chunked_scan,
    ssd_reference,
    time_step,
)
from tests.models import make_mesh, row_spec, run_sharded, sum_over

GOLDEN = Path(__file__).parents[3] / "golden" / "nemotron_h_mamba2_mixer"

# Packed rows: (segment, length) per sequence, then padding. Slot 3 holds two sequences one
# after the other (the second restarts at position 0), as rows built by hand may.
LAYOUT = ((0, 9), (2, 1), (3, 4), (3, 6), (1, 13))
PADDING = 3


def layout_rows(layout=LAYOUT, padding=PADDING) -> tuple[np.ndarray, np.ndarray]:
    positions = np.concatenate([np.arange(n) for _, n in layout] + [np.zeros(padding)])
    segments = np.concatenate([np.full(n, s) for s, n in layout] + [np.full(padding, -1)])
    return positions.astype(np.int32), segments.astype(np.int32)


def numpy_ssd(x, dt, a, b, c, d, positions, segments, slots):
    """The recurrence in float64 NumPy, row by row: the spec."""
    heads, groups = x.shape[1], b.shape[1]
    group = np.arange(heads) // (heads // groups)
    state = np.zeros((heads, x.shape[2], b.shape[2]))
    finals = np.zeros((slots, *state.shape))
    y = np.zeros(x.shape)
    for t in range(x.shape[0]):
        if t == 0 or segments[t] != segments[t - 1] or positions[t] == 0:
            state = np.zeros_like(state)
        if segments[t] < 0:
            continue
        update = (dt[t, :, None] * x[t])[..., None] * b[t, group][:, None, :]
        state = np.exp(dt[t] * a)[:, None, None] * state + update
        y[t] = np.einsum("hpn,hn->hp", state, c[t, group]) + d[:, None] * x[t]
        finals[segments[t]] = state
    return y, finals


def random_ssd_inputs(rows: int, heads=4, groups=2, head_dim=3, state=5, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((rows, heads, head_dim)),
        rng.uniform(0.02, 0.9, (rows, heads)),
        -rng.uniform(0.1, 1.5, heads),
        rng.standard_normal((rows, groups, state)),
        rng.standard_normal((rows, groups, state)),
        rng.standard_normal(heads),
    )


@pytest.mark.parametrize("chunk_size", [1, 7])
def test_chunked_scan_equals_float64_recurrence(chunk_size):
    """The chunked scan equals the row-by-row recurrence within 1e-10 in float64, on ragged
    packed sequences whose lengths the chunk size does not divide, final states per slot too."""
    positions, segments = layout_rows()
    inputs = random_ssd_inputs(len(positions))
    want_y, want_finals = numpy_ssd(*inputs, positions, segments, slots=5)
    with jax.enable_x64(True):
        y, finals = ssd_chunked_scan(
            *inputs, positions, segments, chunk_size=chunk_size, num_slots=5
        )
        assert y.dtype == finals.dtype == jnp.float64
        np.testing.assert_allclose(y, want_y, rtol=0, atol=1e-10)
        np.testing.assert_allclose(finals, want_finals, rtol=0, atol=1e-10)
        if chunk_size == 7:
            ref_y, ref_finals = ssd_reference(*inputs, positions, segments, num_slots=5)
            np.testing.assert_allclose(ref_y, want_y, rtol=0, atol=1e-12)
            np.testing.assert_allclose(ref_finals, want_finals, rtol=0, atol=1e-12)
    assert not want_finals[4].any() and np.abs(want_y).max() > 1


def test_chunked_scan_float32_keeps_float32_state():
    """Float32 inputs give float32 outputs and states close to the float64 recurrence, also
    with one chunk longer than all the rows."""
    positions, segments = layout_rows()
    inputs = random_ssd_inputs(len(positions), heads=8, groups=8, seed=1)
    want_y, want_finals = numpy_ssd(*inputs, positions, segments, slots=4)
    single = [np.asarray(v, np.float32) for v in inputs]
    y, finals = ssd_chunked_scan(*single, positions, segments, chunk_size=64, num_slots=4)
    assert y.dtype == finals.dtype == jnp.float32
    np.testing.assert_allclose(y, want_y, atol=2e-5 * np.abs(want_y).max())
    np.testing.assert_allclose(finals, want_finals, atol=2e-5 * np.abs(want_finals).max())


def test_conv_restarts_with_each_sequence_and_steps_on():
    """The packed conv equals each sequence's own zero-padded conv; conv_states holds each
    slot's last K - 1 inputs; a decode step from them equals the conv one row further."""
    positions, segments = layout_rows()
    rng = np.random.default_rng(2)
    kernel, channels = 4, 6
    x = rng.standard_normal((len(positions), channels))
    weight, bias = rng.standard_normal((kernel, channels)), rng.standard_normal(channels)
    with jax.enable_x64(True):
        got = np.asarray(causal_conv1d(x, weight, bias, positions, segments))
        states = np.asarray(conv_states(x, positions, segments, num_slots=5, width=kernel - 1))
        step_in = rng.standard_normal((5, channels))
        valid = np.array([True, True, True, True, False])
        stepped, new = causal_conv1d_step(states, step_in, weight, bias, valid)
    start = 0
    for slot, length in LAYOUT:
        seq = np.concatenate([np.zeros((kernel - 1, channels)), x[start : start + length]])
        want = bias + sum(seq[k : k + length] * weight[k] for k in range(kernel))
        np.testing.assert_allclose(got[start : start + length], want, atol=1e-12)
        start += length
        if slot in [s for s, _ in LAYOUT[LAYOUT.index((slot, length)) + 1 :]]:
            continue  # the slot's later sequence holds its state
        np.testing.assert_allclose(states[slot], seq[-(kernel - 1) :], atol=0)
        longer = np.concatenate([seq[-(kernel - 1) :], step_in[slot][None]])
        np.testing.assert_allclose(stepped[slot], bias + np.sum(longer * weight, 0), atol=1e-12)
        np.testing.assert_allclose(new[slot], longer[1:], atol=0)
    assert not states[4].any() and np.array_equal(new[4], states[4])


def test_gated_group_norm_and_time_step():
    """The gated norm normalizes each group of channels of y * silu(z) on its own; the time
    step is softplus(dt + bias) clipped to its limits."""
    rng = np.random.default_rng(3)
    y, z, weight = rng.standard_normal((5, 12)), rng.standard_normal((5, 12)), rng.random(12)
    with jax.enable_x64(True):
        got = np.asarray(gated_rms_norm(y, z, weight, group_size=4, eps=1e-5))
        dt = np.asarray(time_step(np.array([[-20.0, 0.0, 30.0]]), np.zeros(3), (1e-3, 10.0)))
    gated = (y * z / (1 + np.exp(-z))).reshape(5, 3, 4)
    want = gated / np.sqrt(np.mean(gated**2, -1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got, want.reshape(5, 12) * weight, atol=1e-12)
    np.testing.assert_allclose(dt, [[1e-3, math.log(2), 10.0]], atol=1e-12)


# The golden mixer's spec: hidden 32, 8 heads of 4, 2 groups of state 6, conv 4, chunks of 5,
# time steps clipped at 1e-3. The tests share its compiled one-device prefill and decode.
SPEC = Mamba2Spec.from_hf_config(json.loads((GOLDEN / "config.json").read_text()))
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
def one_device(spec: Mamba2Spec):
    """Jitted one-device prefill and decode calls, each `(params, h, positions, segments, cache)
    -> (out, cache)` with `params` a mixer's pure parameter dict (`params_of`), so that mixers
    built for any topology share them."""
    graphdef, template = nnx.split(Mamba2Mixer(spec, topology=bj.Topology(), rngs=nnx.Rngs(5)))

    def call(phase, params, h, positions, segments, cache):
        state = jax.tree.map(lambda v: v, template)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)(h, positions, segments, cache, phase=phase)

    prefill = jax.jit(functools.partial(call, RowsPhase.PREFILL))
    return prefill, jax.jit(functools.partial(call, RowsPhase.DECODE))


def params_of(mixer: Mamba2Mixer) -> dict:
    """The mixer's global parameter values as a pure dict (no sharding metadata)."""
    return nnx.to_pure_dict(nnx.state(mixer, nnx.Param))


def conv_rank_blocks(conv: np.ndarray, spec: Mamba2Spec, split: Mamba2Split) -> np.ndarray:
    """A one-device conv state [slots, K - 1, I + 2GN] in the rank-block layout of the global
    cache at `split` (each rank's x channels, then its groups' B and C)."""
    inner, width, state = spec.intermediate_size, spec.n_groups * spec.state_size, spec.state_size
    blocks = []
    for rank in range(split.attn_tp):
        heads = inner // split.attn_tp
        first = rank // split.ranks_per_group * split.local_groups
        groups = slice(inner + first * state, inner + (first + split.local_groups) * state)
        c_groups = slice(groups.start + width, groups.stop + width)
        blocks += [
            conv[..., rank * heads : (rank + 1) * heads],
            conv[..., groups],
            conv[..., c_groups],
        ]
    return np.concatenate(blocks, axis=-1)


def rank_block(value, rows: int, *, dp: int, rank: int) -> np.ndarray:
    """DP rank `rank`'s block of `rows` rows of a [dp * rows, ...] array."""
    return np.asarray(value).reshape(dp, rows, *np.shape(value)[1:])[rank]


# TP 4 (each group shared by 2 of 4 ranks) runs by default; DP 2 x TP 2 (the groups split, DP
# rows) runs under -m slow: the Nemotron-H golden parity runs that split under DP 2 x TP 2.
@pytest.mark.parametrize("dp,tp", [pytest.param(2, 2, marks=pytest.mark.slow), (1, 4)], ids=str)
def test_mixer_under_attention_tp_equals_one_device(dp, tp):
    """Summed over attention TP, the out_proj partials of a prefill and of a decode step equal
    the one-device mixer on each DP rank's rows, and the caches hold the same states (the 2
    groups split over 2 ranks, or each shared by 2 of 4)."""
    spec, groups = SPEC, SPEC.n_groups
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    mixer = Mamba2Mixer(spec, topology=topology, rngs=nnx.Rngs(7))
    split = Mamba2Split.of(spec, topology)
    assert split.groups_sharded == (groups % tp == 0)
    h = jax.random.normal(jax.random.key(1), (dp * ROWS, spec.hidden_size))
    step_h = jax.random.normal(jax.random.key(2), (dp * SLOTS, spec.hidden_size))
    positions, segments = packed(dp)
    step_segments = decode_segments(dp)
    step_positions = np.full(dp * SLOTS, 20, np.int32)
    cache = Mamba2Cache.create(spec, topology, slots=dp * SLOTS)
    rows, cache_specs = row_spec(topology), Mamba2Cache.specs(topology)

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
        want_cache = Mamba2Cache.create(spec, bj.Topology(), slots=SLOTS)
        rows_in = (block(v, ROWS) for v in (h, positions, segments))
        want_out, want_cache = prefill(state, *rows_in, want_cache)
        step_in = (block(v, SLOTS) for v in (step_h, step_positions, step_segments))
        want_step, want_cache = decode(state, *step_in, want_cache)
        chex.assert_trees_all_close(block(out, ROWS), want_out, atol=2e-5)
        chex.assert_trees_all_close(block(step, SLOTS), want_step, atol=2e-5)
        chex.assert_trees_all_close(block(cache.ssm, SLOTS), want_cache.ssm, atol=2e-5)
        want_conv = conv_rank_blocks(np.asarray(want_cache.conv), spec, split)
        chex.assert_trees_all_close(block(cache.conv, SLOTS), want_conv, atol=1e-6)
    padding = np.asarray(segments) < 0
    assert np.all(np.asarray(out)[padding] == 0) and np.all(
        np.asarray(step)[step_segments < 0] == 0
    )
    assert not np.asarray(cache.ssm)[step_segments < 0].any()


def test_prefill_then_decode_equals_a_longer_prefill():
    """Prefill, then three decode steps from the cache, give the outputs the mixer gives the
    whole sequences prefilled at once; an idle slot's state stays zero, and a prefill writes
    only the slots it has rows of."""
    prefill, decode = one_device(SPEC)
    state = params_of(Mamba2Mixer(SPEC, topology=bj.Topology(), rngs=nnx.Rngs(3)))
    lengths, steps = (11, 1, 6), 3
    h = jax.random.normal(jax.random.key(4), (ROWS, SPEC.hidden_size))
    whole = tuple((s, n + steps) for s, n in enumerate(lengths))
    whole = layout_rows(whole, padding=ROWS - sum(n for _, n in whole))
    empty = Mamba2Cache.create(SPEC, bj.Topology(), slots=SLOTS)
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
    assert not np.asarray(cache.ssm[3]).any() and not np.asarray(cache.conv[3]).any()
    # A later prefill into slot 3 alone leaves the other slots' states as they were.
    later = layout_rows(((3, 5),), padding=ROWS - 5)
    alone = prefill(state, h, *later, empty)[1]
    both = prefill(state, h, *later, cache)[1]
    for field in ("conv", "ssm"):
        kept, new = np.asarray(getattr(both, field)), np.asarray(getattr(alone, field))
        np.testing.assert_array_equal(kept[:3], np.asarray(getattr(cache, field))[:3])
        np.testing.assert_array_equal(kept[3], new[3])
        assert new[3].any()


def golden_params(golden: dict) -> dict:
    """The golden mixer's parameters as a one-device mixer's pure parameter dict."""
    params = params_of(Mamba2Mixer(SPEC, topology=bj.Topology(), rngs=nnx.Rngs(0)))
    for path, value in hf_mixer_params(golden, SPEC).items():
        *parents, leaf = path.split(".")
        owner = functools.reduce(dict.__getitem__, parents, params)
        assert owner[leaf].shape == value.shape, (path, owner[leaf].shape, value.shape)
        owner[leaf] = jnp.asarray(value)
    return params


def test_mixer_equals_hugging_face():
    """Packed sequences, three decode steps after them, and a prefill whose time steps are
    clipped at time_step_min equal transformers' NemotronHMamba2Mixer (golden, float32)."""
    prefill, decode = one_device(SPEC)
    golden = dict(np.load(GOLDEN / "mixer.npz"))
    state = golden_params(golden)
    lengths = golden["lengths"].tolist()
    rows = np.zeros((ROWS, SPEC.hidden_size), np.float32)
    rows[: sum(lengths)] = np.concatenate([golden["rows"][s, :n] for s, n in enumerate(lengths)])
    packing = layout_rows(tuple(enumerate(lengths)), padding=ROWS - sum(lengths))
    empty = Mamba2Cache.create(SPEC, bj.Topology(), slots=SLOTS)
    out, cache = prefill(state, rows, *packing, empty)
    want = np.concatenate([golden["output"][s, :n] for s, n in enumerate(lengths)])
    np.testing.assert_allclose(out[: len(want)], want, atol=2e-5)
    slots = np.arange(SLOTS, dtype=np.int32)
    for step in range(golden["decode_rows"].shape[1]):
        now = np.asarray(lengths, np.int32) + step
        got, cache = decode(state, golden["decode_rows"][:, step], now, slots, cache)
        np.testing.assert_allclose(got, golden["decode_output"][:, step], atol=2e-5)
    state["dt_bias"] = jnp.asarray(golden["dt_bias_clamped"])
    clamped = np.concatenate([golden["output_clamped"][s, :n] for s, n in enumerate(lengths)])
    np.testing.assert_allclose(
        prefill(state, rows, *packing, empty)[0][: len(want)], clamped, atol=2e-5
    )


def test_rejects_splits_that_do_not_divide():
    """Heads must split evenly over attention TP and groups divide it or be divided by it."""
    with pytest.raises(ValueError, match="num_heads .* multiple of the attention-TP"):
        Mamba2Mixer(
            dataclasses.replace(SPEC, num_heads=6),
            topology=bj.Topology(attn_tp=4),
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match="n_groups .* must divide one another"):
        Mamba2Mixer(
            dataclasses.replace(SPEC, num_heads=12, n_groups=3),
            topology=bj.Topology(attn_tp=2),
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match="multiple of n_groups"):
        dataclasses.replace(SPEC, n_groups=3)
    mixer = Mamba2Mixer(SPEC, topology=bj.Topology(), rngs=nnx.Rngs(0))
    h, rows = jnp.zeros((4, SPEC.hidden_size)), np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="DECODE call needs a cache"):
        mixer(h, rows, rows, phase=RowsPhase.DECODE)
    wrong = Mamba2Cache.create(dataclasses.replace(SPEC, n_groups=4), bj.Topology(), slots=4)
    with pytest.raises(ValueError, match="Mamba2 cache must be"):
        mixer(h, rows, rows, wrong)


def test_spec_from_hf_config_reads_legacy_keys_and_rejects_biases():
    """Older config.json spellings give the same spec; projection biases are refused."""
    config = json.loads((GOLDEN / "config.json").read_text())
    legacy = {k: v for k, v in config.items() if k not in ("n_groups", "conv_kernel")}
    legacy |= {"mamba_n_groups": config["n_groups"], "mamba_d_conv": config["conv_kernel"]}
    legacy |= {"mamba_dt_min": config["time_step_min"], "time_step_min": 0.5}
    assert Mamba2Spec.from_hf_config(legacy) == SPEC
    assert SPEC.time_step_limit == (1e-3, math.inf) and SPEC.n_groups == 2
    with pytest.raises(NotImplementedError, match="biases"):
        Mamba2Spec.from_hf_config(config | {"use_bias": True})
