"""Attention: TP partials, KV sharing, packed segments, padding, the KV cache and HF parity."""

import dataclasses
import json
import math
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

import boundary_jax as bj
from models.config import PRESETS, DecoderConfig, Llama3RopeScaling, read_hf_config
from models.inputs.rows import RowsPhase
from models.layers.attention.kv_cache import HeadSplit, KVCache
from models.layers.attention.self_attention import Attention, AttentionImpl
from tests.models import (
    MESHES,
    make_mesh,
    randomize_norms,
    row_spec,
    run_sharded,
    sum_over,
    unsharded_copy,
)

GOLDEN = Path(__file__).parents[3] / "golden"
# Weights of order 1/sqrt(fan_in) (not the presets' 0.02), so outputs are of order one and the
# absolute tolerances below stay tight.
BASE = dataclasses.replace(
    PRESETS["tiny-qwen3"], hidden_size=32, head_dim=8, initializer_range=32**-0.5
)
CONFIGS = {
    "qwen3-kv2": BASE,
    "window3-kv4": dataclasses.replace(BASE, num_kv_heads=4, qk_norm=False, sliding_window=3),
    "llama3-kv8": dataclasses.replace(
        BASE, num_kv_heads=8, qk_norm=False, rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 6)
    ),
    # Qwen2: q/k/v biases; at TP 4 and 8 its 2 kv heads (and their biases) are shared by ranks.
    "qwen2-bias-kv2": dataclasses.replace(BASE, qk_norm=False, qkv_bias=True),
    # OLMo 2's q/k norm over the whole projection: its mean of squares spans every rank's heads
    # (kv heads shared by ranks at attention TP 4 and 8).
    "whole-qk-norm-kv2": dataclasses.replace(BASE, qk_norm_whole=True),
}

# One DP rank's packed rows: (segment id, length) per sequence, then padding rows.
PACKINGS = (((0, 5), (1, 3), (2, 2)), ((1, 1), (0, 6)))
ROWS = 12


def packed_rows(dp: int) -> tuple[jax.Array, jax.Array]:
    """Positions and segment ids [dp * ROWS]: DP rank r uses PACKINGS[r % 2], padded with -1."""
    positions, segments = [], []
    for rank in range(dp):
        pos, seg = [], []
        for segment, length in PACKINGS[rank % 2]:
            pos += list(range(length))
            seg += [segment] * length
        pos += [0] * (ROWS - len(pos))
        seg += [-1] * (ROWS - len(seg))
        positions += pos
        segments += seg
    return jnp.array(positions, jnp.int32), jnp.array(segments, jnp.int32)


def build(config: DecoderConfig, topology: bj.Topology, dtype=jnp.float32) -> Attention:
    attn = Attention(config.attention_spec(0), topology=topology, dtype=dtype, rngs=nnx.Rngs(0))
    randomize_norms(attn, seed=1)
    return attn


def reference_blocks(attn, config, h, positions, segments, dp):
    """The one-device Attention applied to each DP rank's rows separately."""
    reference = unsharded_copy(
        attn, lambda t: Attention(config.attention_spec(0), topology=t, rngs=nnx.Rngs(9))
    )
    block = jax.jit(lambda *rows: reference(*rows)[0])
    blocks = [
        block(*(a.reshape(dp, ROWS, *a.shape[1:])[r] for a in (h, positions, segments)))
        for r in range(dp)
    ]
    return jnp.concatenate(blocks)


SLOW = pytest.mark.slow
# By default qwen3-kv2 on TP 2, window3-kv4 on TP 4 (one kv head a rank), qwen2-bias-kv2 on TP 4
# (shared heads and biases) and whole-qk-norm-kv2 on DP 2 x TP 2 (a mean over every rank's
# heads); llama3-kv8 and the rest slow.
PARTIALS_DEFAULT = {
    "qwen3-kv2": {(1, 2)},
    "window3-kv4": {(1, 4)},
    "llama3-kv8": set(),
    "qwen2-bias-kv2": {(1, 4)},
    "whole-qk-norm-kv2": {(2, 2)},
}


@pytest.mark.parametrize(
    "dp,tp,name",
    [
        pytest.param(*mesh, name, id=f"{mesh[0]}-{mesh[1]}-{name}", marks=() if default else SLOW)
        for mesh in MESHES
        for name in sorted(CONFIGS)
        for default in [mesh in PARTIALS_DEFAULT[name]]
    ],
)
def test_partials_sum_to_unsharded(dp, tp, name):
    """Summed over attention TP the o_proj partials equal one-device attention on each DP rank."""
    config = CONFIGS[name]
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    attn = build(config, topology)
    h = jax.random.normal(jax.random.key(2), (dp * ROWS, config.hidden_size), jnp.float32)
    positions, segments = packed_rows(dp)
    rows = row_spec(topology)

    def body(module, h, positions, segments):
        out, cache = module(h, positions, segments)
        assert cache is None
        return sum_over(out, topology, bj.SumGroup.ATTN_TP)

    got = run_sharded(
        attn,
        make_mesh(dp, tp),
        body,
        (h, positions, segments),
        (row_spec(topology, None), rows, rows),
        row_spec(topology, None),
    )
    want = reference_blocks(attn, config, h, positions, segments, dp)
    chex.assert_trees_all_close(got, want, atol=2e-5)
    padding = np.asarray(segments) < 0
    assert np.all(np.asarray(got)[padding] == 0) and np.isfinite(np.asarray(got)).all()


@pytest.mark.parametrize("tp,kv,sharded", [(4, 2, False), (8, 2, False), (2, 2, True)])
def test_kv_head_split(tp, kv, sharded):
    """Kv heads split when attn_tp divides them; else k/v stay replicated, one kv head a rank."""
    config = dataclasses.replace(BASE, num_kv_heads=kv)
    topology = bj.Topology(attn_tp=tp)
    attn = build(config, topology)
    entry = topology.shard_entry(bj.SumGroup.ATTN_TP)
    specs = nnx.get_partition_spec(nnx.state(attn))
    assert specs.kv_proj.kernel.get_value() == P(None, None, entry if sharded else None)
    assert specs.q_proj.kernel.get_value() == P(None, entry)
    heads = HeadSplit.of(config, topology)
    assert (heads.kv_sharded, heads.local_kv_heads) == (sharded, kv // tp if sharded else 1)
    cache = KVCache.create(config, topology, slots=2, max_len=4)
    assert cache.k.shape == (2, 4, heads.cache_heads, config.head_dim)


@pytest.mark.parametrize("tp,sharded", [(2, True), (4, False)])
def test_qkv_biases_split_with_their_heads_and_count(tp, sharded):
    """q/k/v biases split as their kernels' columns (k/v whole where kv heads are shared); the
    output without them differs, so the parity tests above see a dropped or misplaced bias."""
    config = CONFIGS["qwen2-bias-kv2"]
    topology = bj.Topology(attn_tp=tp)
    attn = build(config, topology)
    entry = topology.shard_entry(bj.SumGroup.ATTN_TP)
    specs = nnx.get_partition_spec(nnx.state(attn))
    assert specs.q_proj.bias.get_value() == P(entry)
    assert specs.kv_proj.bias.get_value() == P(None, entry if sharded else None)
    h = jax.random.normal(jax.random.key(2), (ROWS, config.hidden_size), jnp.float32)
    positions, segments = packed_rows(1)
    one = unsharded_copy(
        attn, lambda t: Attention(config.attention_spec(0), topology=t, rngs=nnx.Rngs(9))
    )
    biased = one(h, positions, segments)[0]
    for proj, part in ((one.q_proj, ...), (one.kv_proj, 0), (one.kv_proj, 1)):
        kept = proj.bias[...]
        proj.bias[...] = kept.at[part].set(0)
        assert float(jnp.max(jnp.abs(one(h, positions, segments)[0] - biased))) > 0.1
        proj.bias[...] = kept


def test_bf16_partials_close_to_float32():
    """In bf16 the summed partials stay close to the float32 one-device result."""
    config, dp, tp = CONFIGS["qwen3-kv2"], 2, 2
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    attn = build(config, topology)
    low = build(config, topology, dtype=jnp.bfloat16)
    nnx.update(low, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(attn, nnx.Param)))
    h = jax.random.normal(jax.random.key(3), (dp * ROWS, config.hidden_size), jnp.float32)
    positions, segments = packed_rows(dp)
    rows = row_spec(topology)

    def body(module, h, positions, segments):
        return sum_over(module(h, positions, segments)[0], topology, bj.SumGroup.ATTN_TP)

    got = run_sharded(
        low,
        make_mesh(dp, tp),
        body,
        (h.astype(jnp.bfloat16), positions, segments),
        (row_spec(topology, None), rows, rows),
        row_spec(topology, None),
    )
    assert got.dtype == jnp.bfloat16
    want = reference_blocks(attn, config, h, positions, segments, dp)
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))) < 3e-2 * scale


def test_padding_rows_have_zero_output_and_finite_gradient():
    """Padding rows (segment -1) attend to nothing: zero output, no NaN in value or gradient."""
    config = CONFIGS["window3-kv4"]
    attn = build(config, bj.Topology())
    h = jax.random.normal(jax.random.key(4), (ROWS, config.hidden_size), jnp.float32)
    positions, segments = packed_rows(1)

    def loss(h):
        return jnp.sum(attn(h, positions, segments)[0] ** 2)

    out = jax.jit(lambda h: attn(h, positions, segments)[0])(h)
    grad = jax.jit(jax.grad(loss))(h)
    padding = np.asarray(segments) < 0
    assert padding.any() and np.all(np.asarray(out)[padding] == 0)
    assert np.isfinite(np.asarray(grad)).all() and np.all(np.asarray(grad)[padding] == 0)


def test_segments_do_not_mix():
    """Changing one sequence's rows leaves every other sequence's outputs unchanged."""
    config = CONFIGS["qwen3-kv2"]
    attn = build(config, bj.Topology())
    h = jax.random.normal(jax.random.key(5), (ROWS, config.hidden_size), jnp.float32)
    positions, segments = packed_rows(1)
    changed = jnp.where((segments == 1)[:, None], h + 1.0, h)
    run = jax.jit(lambda h: attn(h, positions, segments)[0])
    before, after = run(h), run(changed)
    other = np.asarray(segments) != 1
    chex.assert_trees_all_close(before[other], after[other], atol=0)
    assert not np.allclose(np.asarray(before)[~other & (np.asarray(segments) >= 0)], 0)


def test_sliding_window_sees_last_window_positions():
    """With window W, a row attends exactly to positions p - W < q <= p (RoPE is relative)."""
    windowed = CONFIGS["window3-kv4"]
    full = dataclasses.replace(windowed, sliding_window=None)
    attn = build(windowed, bj.Topology())
    unwindowed = unsharded_copy(
        attn, lambda t: Attention(full.attention_spec(0), topology=t, rngs=nnx.Rngs(9))
    )
    h = jax.random.normal(jax.random.key(7), (7, windowed.hidden_size), jnp.float32)
    positions, segments = jnp.arange(7, dtype=jnp.int32), jnp.zeros(7, jnp.int32)
    got = jax.jit(attn)(h, positions, segments)[0][-1]
    tail = windowed.sliding_window
    want = jax.jit(unwindowed)(h[-tail:], positions[:tail], segments[:tail])[0][-1]
    chex.assert_trees_all_close(got, want, atol=1e-5)


# Cache test: per DP rank, three sequences in slots 0-2 grow by prefill then DECODE_STEPS
# one-token steps; each decode step has one row per slot, slot 3 idle (a padding row whose write
# must be dropped).
PREFILL = ((5, 1, 3), (2, 4, 1))
DECODE_STEPS = 3
SLOTS = 4
MAX_LEN = 16


def cache_schedule(dp):
    """Rows of the packed run and of each cached call, as (positions, segments, token index)."""
    calls = [[] for _ in range(1 + DECODE_STEPS)]
    packed = []
    for rank in range(dp):
        lengths = PREFILL[rank % 2]
        full = [(s, p) for s, n in enumerate(lengths) for p in range(n + DECODE_STEPS)]
        packed.append(full + [(-1, 0)] * (ROWS * 2 - len(full)))
        prefill = [(s, p) for s, n in enumerate(lengths) for p in range(n)]
        calls[0].append(prefill + [(-1, 0)] * (ROWS - len(prefill)))
        for step in range(DECODE_STEPS):
            calls[1 + step].append([(s, n + step) for s, n in enumerate(lengths)] + [(-1, 2)])
    return packed, calls


def as_arrays(rows_per_rank, token_h):
    """Concatenated positions, segments and inputs of every DP rank's rows."""
    positions = [p for rows in rows_per_rank for _, p in rows]
    segments = [s for rows in rows_per_rank for s, _ in rows]
    h = [
        token_h[r, s, p] if s >= 0 else token_h[r, 0, MAX_LEN - 1]
        for r, rows in enumerate(rows_per_rank)
        for s, p in rows
    ]
    return jnp.array(positions, jnp.int32), jnp.array(segments, jnp.int32), jnp.stack(h)


# By default qwen3-kv2 on TP 8 (its 2 kv heads shared by ranks), window3-kv4 on TP 4 (one kv
# head a rank) and DP 2 x TP 2 (each DP rank its own slots); the rest under -m slow.
CACHE_DEFAULT = {("qwen3-kv2", 1, 8), ("window3-kv4", 1, 4), ("window3-kv4", 2, 2)}


@pytest.mark.parametrize(
    "dp,tp,name",
    [
        pytest.param(*mesh, name, id=f"{mesh[0]}-{mesh[1]}-{name}", marks=() if default else SLOW)
        for mesh in MESHES
        for name in ("qwen3-kv2", "window3-kv4")
        for default in [(name, *mesh) in CACHE_DEFAULT]
    ],
)
def test_cache_prefill_and_decode_equal_packed(dp, tp, name):
    """Prefill then 3 one-token decode steps through the cache equal one packed forward."""
    config = CONFIGS[name]
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    mesh = make_mesh(dp, tp)
    attn = build(config, topology)
    token_h = jax.random.normal(
        jax.random.key(6), (dp, SLOTS, MAX_LEN, config.hidden_size), jnp.float32
    )
    packed, calls = cache_schedule(dp)
    rows, hidden = row_spec(topology), row_spec(topology, None)

    def packed_body(module, h, positions, segments):
        return sum_over(module(h, positions, segments)[0], topology, bj.SumGroup.ATTN_TP)

    positions, segments, h = as_arrays(packed, token_h)
    want = np.asarray(
        run_sharded(attn, mesh, packed_body, (h, positions, segments), (hidden, rows, rows), hidden)
    )
    want_by_token = {}
    for index, (s, p) in enumerate(row for rank_rows in packed for row in rank_rows):
        rank = index // (2 * ROWS)
        if s >= 0:
            want_by_token[rank, s, p] = want[index]

    call_arrays = [as_arrays(call, token_h) for call in calls]
    cache = KVCache.create(config, topology, slots=dp * SLOTS, max_len=MAX_LEN, mesh=mesh)

    def cached_body(module, cache, *flat):
        outs = []
        for i in range(len(calls)):
            positions, segments, h = flat[3 * i : 3 * i + 3]
            phase = RowsPhase.PREFILL if i == 0 else RowsPhase.DECODE
            out, cache = module(h, positions, segments, cache, phase=phase)
            outs.append(sum_over(out, topology, bj.SumGroup.ATTN_TP))
        return outs, cache

    flat = [a for arrays in call_arrays for a in arrays]
    outs, cache = run_sharded(
        attn,
        mesh,
        cached_body,
        (cache, *flat),
        (KVCache.specs(topology), *[rows, rows, hidden] * len(calls)),
        ([hidden] * len(calls), KVCache.specs(topology)),
    )
    for call, out in zip(calls, map(np.asarray, outs), strict=True):
        per_rank = len(call[0])
        for index, (s, p) in enumerate(row for rank_rows in call for row in rank_rows):
            if s >= 0:
                chex.assert_trees_all_close(
                    out[index], want_by_token[index // per_rank, s, p], atol=2e-5
                )
            else:
                assert np.all(out[index] == 0)
    # Nothing was written past each sequence's last position (padding writes were dropped).
    lengths = np.array([[n + DECODE_STEPS for n in PREFILL[r % 2]] + [0] for r in range(dp)])
    written = np.any(np.asarray(cache.k) != 0, axis=(2, 3)).reshape(dp, SLOTS, MAX_LEN)
    np.testing.assert_array_equal(written, np.arange(MAX_LEN) < lengths[..., None])


def test_rejects_unsplittable_heads():
    """Heads that cannot split over attention TP, and a cache not split over DP, fail at build."""
    with pytest.raises(ValueError, match=r"num_heads \(8\) must be a multiple .* \(3\)"):
        Attention(BASE.attention_spec(0), topology=bj.Topology(attn_tp=3), rngs=nnx.Rngs(0))
    config = dataclasses.replace(BASE, num_heads=6, num_kv_heads=3, head_dim=8)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) and the attention-TP size \(2\)"):
        Attention(config.attention_spec(0), topology=bj.Topology(attn_tp=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="slots"):
        KVCache.create(BASE, bj.Topology(attn_dp=2), slots=3, max_len=4)


def qwen3_layer0_reference(weights, config, ids):
    """HF Qwen3 attention of layer 0 on one prompt, in float64 NumPy: returns (h, o_proj out)."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    eps, hd = config["rms_norm_eps"], config["head_dim"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]

    def rms(x, g):
        return g * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    t = len(ids)
    p = "model.layers.0."
    h = rms(w["model.embed_tokens.weight"][ids], w[p + "input_layernorm.weight"])
    q = rms(
        (h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, nh, hd),
        w[p + "self_attn.q_norm.weight"],
    )
    k = rms(
        (h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, hd),
        w[p + "self_attn.k_norm.weight"],
    )
    v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, hd)
    inv = 1.0 / config["rope_parameters"]["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    angles = np.arange(t)[:, None] * inv[None, :]
    angles = np.concatenate([angles, angles], axis=-1)[:, None, :]

    def rope(x):
        rotated = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)
        return x * np.cos(angles) + rotated * np.sin(angles)

    q, k = rope(q), rope(k)
    k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = np.where(np.tril(np.ones((t, t), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hts,shd->thd", probs, v).reshape(t, nh * hd)
    return h, out @ w[p + "self_attn.o_proj.weight"].T


# TP 4 and DP 2 x TP 2 by default; one device and TP 2 under -m slow.
@pytest.mark.parametrize(
    "dp,tp", [pytest.param(1, 1, marks=SLOW), pytest.param(1, 2, marks=SLOW), (1, 4), (2, 2)]
)
def test_matches_hf_qwen3_layer0(dp, tp):
    """Packed prompts through our Attention with the golden layer-0 weights equal HF's math."""
    raw = json.loads((GOLDEN / "qwen3" / "config.json").read_text())
    config = read_hf_config(raw)
    weights = load_file(str(GOLDEN / "qwen3" / "model.safetensors"))
    reference = np.load(GOLDEN / "qwen3" / "reference.npz")
    prompts = [
        reference["input_ids"][i, : reference["lengths"][i]]
        for i in range(len(reference["lengths"]))
    ]
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    attn = Attention(config.attention_spec(0), topology=topology, rngs=nnx.Rngs(0))
    layer = "model.layers.0.self_attn"
    for name in ("q_proj", "o_proj"):
        getattr(attn, name).kernel[...] = weights[f"{layer}.{name}.weight"].T
    kv = [weights[f"{layer}.{part}_proj.weight"].T for part in "kv"]
    attn.kv_proj.kernel[...] = np.stack(kv, axis=1)
    attn.q_norm.weight[...] = weights["model.layers.0.self_attn.q_norm.weight"]
    attn.k_norm.weight[...] = weights["model.layers.0.self_attn.k_norm.weight"]

    # DP rank r packs prompts r, r + dp, ... (segment = order within the rank), padded to 32.
    rows_per_rank, width = [], 32
    for rank in range(dp):
        rows = [
            (seg, i, pos)
            for seg, i in enumerate(range(rank, len(prompts), dp))
            for pos in range(len(prompts[i]))
        ]
        rows_per_rank.append(rows + [(-1, 0, 0)] * (width - len(rows)))
    expected = {i: qwen3_layer0_reference(weights, raw, prompts[i]) for i in range(len(prompts))}
    flat = [row for rows in rows_per_rank for row in rows]
    h = np.stack([expected[i][0][pos] if seg >= 0 else np.zeros(64) for seg, i, pos in flat])
    positions = jnp.array([pos for _, _, pos in flat], jnp.int32)
    segments = jnp.array([seg for seg, _, _ in flat], jnp.int32)
    rows_spec = row_spec(topology)

    def body(module, h, positions, segments):
        return sum_over(module(h, positions, segments)[0], topology, bj.SumGroup.ATTN_TP)

    got = run_sharded(
        attn,
        make_mesh(dp, tp),
        body,
        (jnp.asarray(h, jnp.float32), positions, segments),
        (row_spec(topology, None), rows_spec, rows_spec),
        row_spec(topology, None),
    )
    want = np.stack([expected[i][1][pos] if seg >= 0 else np.zeros(64) for seg, i, pos in flat])
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("dp,tp", [(1, 1), (1, 2)])
def test_cudnn_equals_reference_in_prefill_and_decode(dp, tp):
    """On GPU, cuDNN packed prefill and cache decode equal the jnp reference (bf16 rounding)."""
    if jax.device_count() < dp * tp:
        pytest.skip(f"needs {dp * tp} devices")
    config = dataclasses.replace(BASE, hidden_size=256, head_dim=64, num_heads=8, num_kv_heads=4)
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    mesh = make_mesh(dp, tp)
    rows, hidden = row_spec(topology), row_spec(topology, None)
    # Irregular packing: segment 1 before segment 0, a slot with no rows (2), padding at the end.
    lengths = ((1, 37), (0, 64), (3, 9))
    segments = [s for s, n in lengths for _ in range(n)] + [-1] * 18
    positions = [p for _, n in lengths for p in range(n)] + [0] * 18
    positions, segments = jnp.array(positions * dp, jnp.int32), jnp.array(segments * dp, jnp.int32)
    h = jax.random.normal(jax.random.key(3), (dp * 128, config.hidden_size), jnp.bfloat16)
    step_h = jax.random.normal(jax.random.key(4), (dp * 4, config.hidden_size), jnp.bfloat16)
    step_pos = jnp.array([64, 37, 0, 9] * dp, jnp.int32)
    step_seg = jnp.array([0, 1, -1, 3] * dp, jnp.int32)
    outs = {}
    for impl in (AttentionImpl.XLA, AttentionImpl.CUDNN):
        attn = Attention(
            config.attention_spec(0),
            topology=topology,
            dtype=jnp.bfloat16,
            impl=impl,
            rngs=nnx.Rngs(0),
        )
        cache = KVCache.create(config, topology, slots=dp * 4, max_len=80, mesh=mesh)
        cache = jax.tree.map(lambda a: a.astype(jnp.bfloat16), cache)

        def body(module, cache, h, positions, segments, step_h, step_pos, step_seg):
            first, cache = module(h, positions, segments, cache)
            second, cache = module(step_h, step_pos, step_seg, cache, phase=RowsPhase.DECODE)
            done = [sum_over(o, topology, bj.SumGroup.ATTN_TP) for o in (first, second)]
            return done, cache

        outs[impl] = run_sharded(
            attn,
            mesh,
            body,
            (cache, h, positions, segments, step_h, step_pos, step_seg),
            (KVCache.specs(topology), hidden, rows, rows, hidden, rows, rows),
            ([hidden, hidden], KVCache.specs(topology)),
        )
    (want, want_cache), (got, got_cache) = outs[AttentionImpl.XLA], outs[AttentionImpl.CUDNN]
    # Padding rows of the prefill are zero on both paths; an idle decode slot is unspecified.
    for g, w, active in zip(
        got, want, (np.ones(dp * 128, bool), np.asarray(step_seg) >= 0), strict=True
    ):
        g, w = np.asarray(g, np.float32)[active], np.asarray(w, np.float32)[active]
        assert np.max(np.abs(g - w)) <= 2e-2 * np.max(np.abs(w))
    np.testing.assert_array_equal(np.asarray(got_cache.k), np.asarray(want_cache.k))


# Packed prefill rows that cross the key blocks of a bounded reach: (segment, length), then
# padding to BOUNDED_ROWS.
BOUNDED_PACKING = ((0, 7), (1, 3), (2, 9), (3, 1), (4, 6), (5, 8))
BOUNDED_ROWS = 40


def bounded_rows(config):
    positions = [p for _, n in BOUNDED_PACKING for p in range(n)]
    segments = [s for s, n in BOUNDED_PACKING for _ in range(n)]
    pad = BOUNDED_ROWS - len(positions)
    positions = jnp.array(positions + [0] * pad, jnp.int32)
    segments = jnp.array(segments + [-1] * pad, jnp.int32)
    h = jax.random.normal(jax.random.key(11), (BOUNDED_ROWS, config.hidden_size), jnp.float32)
    return h, positions, segments


# By default the sliding window at bound 9 (key blocks within reach of a window); the bound 33
# (the T x T scores), the full-attention config and the bound 12 under -m slow.
@pytest.mark.parametrize(
    "name,bound",
    [
        pytest.param("qwen3-kv2", 9, marks=SLOW),
        pytest.param("qwen3-kv2", 12, marks=SLOW),
        pytest.param("qwen3-kv2", 33, marks=SLOW),
        ("window3-kv4", 9),
        pytest.param("window3-kv4", 12, marks=SLOW),
        pytest.param("window3-kv4", 33, marks=SLOW),
    ],
)
def test_bounded_prefill_equals_each_sequence_alone(name, bound):
    """With `max_sequence_rows`, queries attend block by block to the keys within reach; every
    row equals its sequence run alone, padding rows stay zero, and gradients match the unbounded
    call's (the bound 9 is the longest sequence, so a key block left out of a window shows; at
    33 the window would span all 40 rows, and the call keeps the T x T scores)."""
    config = CONFIGS[name]
    attn = build(config, bj.Topology())
    h, positions, segments = bounded_rows(config)
    bounded = jax.jit(lambda h: attn(h, positions, segments, max_sequence_rows=bound)[0])
    got = np.asarray(bounded(h))
    one_sequence = jax.jit(lambda h, positions: attn(h, positions, jnp.zeros_like(positions))[0])
    start = 0
    for _, length in BOUNDED_PACKING:
        rows = slice(start, start + length)
        alone = one_sequence(h[rows], positions[rows])
        np.testing.assert_allclose(got[rows], alone, rtol=1e-5, atol=1e-5)
        start += length
    assert np.all(got[start:] == 0)

    def loss(h, bound):
        return jnp.sum(jnp.sin(attn(h, positions, segments, max_sequence_rows=bound)[0]))

    grads = [jax.jit(jax.grad(lambda h, b=b: loss(h, b)))(h) for b in (bound, None)]
    chex.assert_trees_all_close(*grads, rtol=1e-5, atol=1e-5)


def test_bounded_prefill_computes_a_fraction_of_the_scores():
    """A bound of 128 rows in 1024 packed rows: the compiled layer's FLOPs (forward and
    backward) drop to about the window's share of the T x T scores."""
    config = CONFIGS["qwen3-kv2"]
    attn = build(config, bj.Topology())
    rows = 1024
    h = jnp.ones((rows, config.hidden_size), jnp.float32)
    positions = jnp.arange(rows, dtype=jnp.int32) % 128
    segments = jnp.arange(rows, dtype=jnp.int32) // 128

    def flops(bound):
        def loss(h):
            return jnp.sum(attn(h, positions, segments, max_sequence_rows=bound)[0])

        cost = jax.jit(jax.value_and_grad(loss)).lower(h).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    # Blocks of 64 query rows each see 3 key blocks: 192 of 1024 key rows.
    assert flops(128) < 0.3 * flops(None)
