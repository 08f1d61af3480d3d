"""Multi-head latent attention: HF parity, heads split over attention TP, absorbed decode over
the latent cache against the expanded prefill, and YaRN RoPE."""

import dataclasses
import functools
import json
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import boundary_jax as bj
from models.config import YarnRopeScaling
from models.families.deepseek import read_mla
from models.inputs.rows import RowsPhase
from models.layers.attention.latent import LatentCache, MlaConfig, MultiHeadLatentAttention
from models.layers.attention.rope import rope_inv_freq
from models.layers.attention.self_attention import AttentionImpl
from tests.models import make_mesh, randomize_norms, row_spec, run_sharded, sum_over

GOLDEN = Path(__file__).parents[3] / "golden"
PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@functools.cache
def golden(name: str) -> tuple[dict, dict, dict]:
    """(config.json, safetensors, modules.npz) of a golden DeepSeek checkpoint."""
    folder = GOLDEN / name
    modules = np.load(folder / "modules.npz")
    return (
        json.loads((folder / "config.json").read_text()),
        load_file(str(folder / "model.safetensors")),
        {key: modules[key] for key in modules.files},
    )


def hf_attention(name: str, topology: bj.Topology, layer: int = 1) -> MultiHeadLatentAttention:
    """The MLA of golden `name`'s layer `layer`, weights as transformers holds them."""
    config, weights, _ = golden(name)
    attn = MultiHeadLatentAttention(read_mla(config), topology=topology, rngs=nnx.Rngs(0))
    prefix = f"model.layers.{layer}.self_attn."
    for proj in PROJECTIONS:
        if getattr(attn, proj) is not None:
            getattr(attn, proj).kernel[...] = weights[f"{prefix}{proj}.weight"].T
    for norm in ("q_a_layernorm", "kv_a_layernorm"):
        if getattr(attn, norm) is not None:
            getattr(attn, norm).weight[...] = weights[f"{prefix}{norm}.weight"]
    return attn


def packed(positions: np.ndarray, segments: np.ndarray, dp: int, rows_per_rank: int):
    """Lays prompt rows out per DP rank (prompt i on rank i % dp, slot i // dp), padded.
    Returns (source row of each packed row or -1, positions, segment ids), [dp * rows] each."""
    source = np.full(dp * rows_per_rank, -1)
    filled = [0] * dp
    for prompt in range(segments.max() + 1):
        rank = prompt % dp
        rows = np.flatnonzero(segments == prompt)
        start = rank * rows_per_rank + filled[rank]
        assert filled[rank] + len(rows) <= rows_per_rank, "rows_per_rank too small"
        source[start : start + len(rows)] = rows
        filled[rank] += len(rows)
    real = source >= 0
    out_positions = np.where(real, positions[source], 0).astype(np.int32)
    out_segments = np.where(real, segments[source] // dp, -1).astype(np.int32)
    return source, out_positions, out_segments


def run_attention(attn, dp, tp, h, positions, segments):
    """The attention's TP partials summed over attention TP, under shard_map."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    rows, hidden = row_spec(topology), row_spec(topology, None)

    def body(module, h, positions, segments):
        return sum_over(module(h, positions, segments)[0], topology, bj.SumGroup.ATTN_TP)

    args = (jnp.asarray(h), jnp.asarray(positions), jnp.asarray(segments))
    return run_sharded(attn, make_mesh(dp, tp), body, args, (hidden, rows, rows), hidden)


# Each golden once by default: DeepSeek-V2 on DP 2 x TP 2, V3 on TP 4; V2 on one device and V3 on
# DP 2 x TP 2 under -m slow.
@pytest.mark.parametrize(
    "name,dp,tp",
    [
        pytest.param("deepseek_v2", 1, 1, marks=pytest.mark.slow),
        ("deepseek_v2", 2, 2),
        ("deepseek_v3", 1, 4),
        pytest.param("deepseek_v3", 2, 2, marks=pytest.mark.slow),
    ],
)
def test_matches_hf_attention(name, dp, tp):
    """Packed prompts through our MLA, heads split over attention TP (each rank's q/kv_b/o
    slices differ) and the partials summed, equal transformers' attention of golden layer 1."""
    _, _, modules = golden(name)
    attn = hf_attention(name, bj.Topology(attn_dp=dp, attn_tp=tp))
    # Prompts of 7, 1, 12 and 5 rows: 25 on one DP rank, or 19 and 6 on two.
    rows_per_rank = 28 if dp == 1 else 20
    source, positions, segments = packed(
        modules["positions"], modules["segments"], dp, rows_per_rank
    )
    h = np.where(source[:, None] >= 0, modules["attn_in_1"][source], 0)
    got = np.asarray(run_attention(attn, dp, tp, h, positions, segments))
    real = source >= 0
    np.testing.assert_allclose(got[real], modules["attn_out_1"][source[real]], atol=2e-5, rtol=1e-5)
    assert np.all(got[~real] == 0)


def test_config_and_cache_from_hf():
    """The golden configs read as transformers runs them; the cache holds the latent only."""
    v2, v3 = (read_mla(golden(name)[0]) for name in ("deepseek_v2", "deepseek_v3"))
    assert (v2.q_lora_rank, v3.q_lora_rank) == (None, 24)
    assert v2.rope_interleaved and v3.rope_interleaved
    assert v2.rope_scaling == YarnRopeScaling(4.0, 32, mscale=0.707, mscale_all_dim=1.0)
    # mscale_all_dim 1 with factor 4: softmax scale x (1 + 0.1 ln 4)^2; cos/sin x 0.9643.
    assert v2.softmax_scale == pytest.approx(16**-0.5 * (1 + 0.1 * np.log(4)) ** 2, rel=1e-12)
    assert v2.rope_attention_factor == pytest.approx(0.964326914892074, rel=1e-12)
    assert v3.rope_attention_factor == 1.0
    assert LatentCache.bytes_per_token(v3, jnp.bfloat16) == (16 + 8) * 2
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    cache = LatentCache.create(v3, topology, slots=4, max_len=6)
    assert cache.latent.shape == (4, 6, v3.kv_lora_rank + v3.qk_rope_head_dim)
    dp = topology.spec_entry((bj.TokenAxis.ATTN_DP,))
    assert LatentCache.specs(topology).latent == jax.sharding.PartitionSpec(dp, None, None)
    attn = MultiHeadLatentAttention(v2, topology=bj.Topology(attn_tp=4), rngs=nnx.Rngs(0))
    entry = bj.Topology(attn_tp=4).shard_entry(bj.SumGroup.ATTN_TP)
    specs = nnx.get_partition_spec(nnx.state(attn))
    assert specs.kv_a_proj_with_mqa.kernel.get_value() == jax.sharding.PartitionSpec(None, None)
    assert specs.kv_b_proj.kernel.get_value() == jax.sharding.PartitionSpec(None, entry)
    assert specs.o_proj.kernel.get_value() == jax.sharding.PartitionSpec(entry, None)
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple .* \(8\)"):
        MultiHeadLatentAttention(v2, topology=bj.Topology(attn_tp=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        read_mla(golden("deepseek_v3")[0] | {"num_key_value_heads": 128})


def test_config_from_hub_style_file():
    """A DeepSeek-V3 hub config (top-level rope_theta, legacy `rope_scaling` with `type`, no
    `rope_interleave`) reads as YaRN factor 40 with the softmax scale x (1 + 0.1 ln 40)^2."""
    hub = {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
    }
    config = read_mla(hub)
    assert config.rope_interleaved and config.latent_width == 576
    assert config.rope_scaling == YarnRopeScaling(40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert config.rope_attention_factor == 1.0
    assert config.softmax_scale == pytest.approx(192**-0.5 * (1 + 0.1 * np.log(40)) ** 2)
    assert LatentCache.bytes_per_token(config, jnp.bfloat16) == 1152


# transformers' `_compute_yarn_parameters` (5.24.0) for qk_rope_head_dim 8: (theta, factor,
# original context, mscale, mscale_all_dim) -> (inv_freq, attention_factor).
YARN_HF = {
    (1e4, 40.0, 4096, 1.0, 1.0): (
        [1.0, 0.10000000149011612, 0.005124999675899744, 2.4999999e-05],
        1.0,
    ),
    (100.0, 4.0, 8, 0.707, 1.0): (
        [1.0, 0.07905694097280502, 0.02500000037252903, 0.007905694656074047],
        0.964326914892074,
    ),
    (1e3, 3.0, 16, None, None): (
        [1.0, 0.05927598103880882, 0.010540924966335297, 0.0018744710832834244],
        1.109861228866811,
    ),
}


@pytest.mark.parametrize("case", sorted(YARN_HF, key=str))
def test_yarn_matches_transformers(case):
    """YaRN's inverse frequencies equal transformers' float32 values bit for bit, and its
    cos/sin factor its `attention_factor`."""
    theta, factor, original, mscale, mscale_all_dim = case
    scaling = YarnRopeScaling(factor, original, mscale=mscale, mscale_all_dim=mscale_all_dim)
    want, attention_factor = YARN_HF[case]
    np.testing.assert_array_equal(rope_inv_freq(8, theta, scaling), np.float32(want))
    assert scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    expected = (1 + 0.1 * mscale_all_dim * np.log(factor)) ** 2 if mscale_all_dim else 1.0
    assert scaling.softmax_scale_factor == pytest.approx(expected, rel=1e-12)


TINY = MlaConfig(
    hidden_size=24,
    num_heads=4,
    q_lora_rank=12,
    kv_lora_rank=10,
    qk_nope_head_dim=6,
    qk_rope_head_dim=4,
    v_head_dim=5,
    rope_theta=100.0,
    rope_scaling=YarnRopeScaling(4.0, 4, mscale=0.8, mscale_all_dim=1.0),
)


@pytest.mark.parametrize("lora_scaled", [False, True], ids=["deepseek", "longcat-scales"])
def test_absorbed_decode_equals_expanded_in_float64(lora_scaled):
    """In float64, each absorbed decode step over the latent cache equals the expanded prefill
    of the whole sequence to 1e-12 (the absorption is exact algebra, not an approximation);
    with LongCat's LoRA scales the cache holds the scaled latent, and both forms read it."""
    config = dataclasses.replace(TINY, lora_scaled=lora_scaled)
    attn = MultiHeadLatentAttention(config, topology=bj.Topology(), rngs=nnx.Rngs(5))
    randomize_norms(attn, seed=6)
    graphdef, state = nnx.split(attn)
    with jax.enable_x64(True):
        # The float32 draws, widened: NumPy leaves become float64 arrays in the program.
        attn = nnx.merge(graphdef, jax.tree.map(lambda x: np.asarray(x, np.float64), state))
        steps, prefill = 3, 5
        h = jax.random.normal(jax.random.key(7), (prefill + steps, 24), jnp.float64)
        positions = jnp.arange(prefill + steps, dtype=jnp.int32)
        call = jax.jit(lambda *args: attn(*args[:4], phase=args[4]), static_argnums=4)
        empty = LatentCache.create(config, bj.Topology(), slots=2, max_len=12, dtype=jnp.float64)
        want = call(h, positions, positions * 0, empty, RowsPhase.PREFILL)[0]
        # The same program: the rows past the prefill are padding.
        segments = jnp.where(positions < prefill, 0, -1).astype(jnp.int32)
        first, cache = call(h, positions, segments, empty, RowsPhase.PREFILL)
        np.testing.assert_allclose(first[:prefill], want[:prefill], atol=1e-12, rtol=0)
        for t in range(prefill, prefill + steps):
            rows = jnp.stack([h[t], h[0]])  # slot 1 idle
            step_positions, slots = jnp.array([t, 0], jnp.int32), jnp.array([0, -1], jnp.int32)
            out, cache = call(rows, step_positions, slots, cache, RowsPhase.DECODE)
            np.testing.assert_allclose(out[0], want[t], atol=1e-12, rtol=0)
            assert np.all(np.asarray(out[1]) == 0)
        written = np.any(np.asarray(cache.latent) != 0, axis=-1)
        np.testing.assert_array_equal(written[0], np.arange(12) < prefill + steps)
        assert not written[1].any()


# Per DP rank: three sequences in slots 0-2 grow by a prefill then DECODE_STEPS one-token steps,
# slot 3 idle in every decode step.
PREFILL = ((5, 1, 3), (2, 4, 1))
DECODE_STEPS, SLOTS, MAX_LEN, ROWS = 3, 4, 12, 12


def schedule(dp: int):
    """(positions, segments, token index) rows of the packed run and of each cached call."""
    packed_rows, calls = [], [[] for _ in range(1 + DECODE_STEPS)]
    for rank in range(dp):
        lengths = PREFILL[rank % 2]
        full = [(s, p) for s, n in enumerate(lengths) for p in range(n + DECODE_STEPS)]
        packed_rows.append(full + [(-1, 0)] * (2 * ROWS - len(full)))
        prefill = [(s, p) for s, n in enumerate(lengths) for p in range(n)]
        calls[0].append(prefill + [(-1, 0)] * (ROWS - len(prefill)))
        for step in range(DECODE_STEPS):
            calls[1 + step].append([(s, n + step) for s, n in enumerate(lengths)] + [(-1, 1)])
    return packed_rows, calls


def as_arrays(rows_per_rank, token_h):
    positions = [p for rows in rows_per_rank for _, p in rows]
    segments = [s for rows in rows_per_rank for s, _ in rows]
    h = [token_h[r, max(s, 0), p] for r, rows in enumerate(rows_per_rank) for s, p in rows]
    return jnp.array(positions, jnp.int32), jnp.array(segments, jnp.int32), jnp.stack(h)


@pytest.mark.parametrize("dp,tp,q_lora", [(1, 4, True), (2, 2, False)])
def test_prefill_and_decode_equal_one_longer_prefill(dp, tp, q_lora):
    """Prefill into the latent cache, then 3 absorbed decode steps (heads split over attention
    TP, the cache replicated there), equal one packed prefill of the longer sequences; nothing
    is written past a sequence's end or for an idle slot."""
    config = TINY if q_lora else dataclasses.replace(TINY, q_lora_rank=None)
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    mesh = make_mesh(dp, tp)
    attn = MultiHeadLatentAttention(config, topology=topology, rngs=nnx.Rngs(1))
    randomize_norms(attn, seed=2)
    token_h = jax.random.normal(jax.random.key(3), (dp, SLOTS, MAX_LEN, 24), jnp.float32)
    packed_rows, calls = schedule(dp)
    rows, hidden = row_spec(topology), row_spec(topology, None)
    cache_spec = LatentCache.specs(topology)

    def body(module, cache, *flat):
        positions, segments, h = flat[:3]
        want = sum_over(module(h, positions, segments)[0], topology, bj.SumGroup.ATTN_TP)
        outs = []
        for i in range(len(calls)):
            positions, segments, h = flat[3 + 3 * i : 6 + 3 * i]
            phase = RowsPhase.PREFILL if i == 0 else RowsPhase.DECODE
            out, cache = module(h, positions, segments, cache, phase=phase)
            outs.append(sum_over(out, topology, bj.SumGroup.ATTN_TP))
        return want, outs, cache

    flat = [a for call in [packed_rows, *calls] for a in as_arrays(call, token_h)]
    cache = LatentCache.create(config, topology, slots=dp * SLOTS, max_len=MAX_LEN, mesh=mesh)
    want, outs, cache = run_sharded(
        attn,
        mesh,
        body,
        (cache, *flat),
        (cache_spec, *[rows, rows, hidden] * (1 + len(calls))),
        (hidden, [hidden] * len(calls), cache_spec),
    )
    want = np.asarray(want)
    by_token = {}
    for index, (s, p) in enumerate(row for rank_rows in packed_rows for row in rank_rows):
        if s >= 0:
            by_token[index // (2 * ROWS), s, p] = want[index]
    for call, out in zip(calls, map(np.asarray, outs), strict=True):
        per_rank = len(call[0])
        for index, (s, p) in enumerate(row for rank_rows in call for row in rank_rows):
            if s >= 0:
                chex.assert_trees_all_close(
                    out[index], by_token[index // per_rank, s, p], atol=2e-5
                )
            else:
                assert np.all(out[index] == 0)
    lengths = np.array([[n + DECODE_STEPS for n in PREFILL[r % 2]] + [0] for r in range(dp)])
    written = np.any(np.asarray(cache.latent) != 0, axis=-1).reshape(dp, SLOTS, MAX_LEN)
    np.testing.assert_array_equal(written, np.arange(MAX_LEN) < lengths[..., None])


def test_bounded_prefill_equals_unbounded():
    """With `max_sequence_rows` the prefill attends block by block (v narrower than q/k) and
    equals the all-pairs prefill, padding rows zero."""
    attn = MultiHeadLatentAttention(TINY, topology=bj.Topology(), rngs=nnx.Rngs(4))
    lengths = (7, 3, 9, 1, 6, 8, 2)
    positions = jnp.array([p for n in lengths for p in range(n)] + [0] * 4, jnp.int32)
    segments = jnp.array([s for s, n in enumerate(lengths) for _ in range(n)] + [-1] * 4)
    h = jax.random.normal(jax.random.key(8), (positions.shape[0], 24), jnp.float32)
    want = jax.jit(lambda h: attn(h, positions, segments)[0])(h)
    got = jax.jit(lambda h: attn(h, positions, segments, max_sequence_rows=9)[0])(h)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    assert np.all(np.asarray(got)[-4:] == 0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
@pytest.mark.parametrize("lengths, window_rows", [((23, 13), None), ((18, 18), 18)])
def test_cudnn_prefill_equals_xla_in_bfloat16(lengths, window_rows):
    """cuDNN's MLA prefill (query/key 192 wide, value 128, DeepSeek-V2's widths) over packed
    sequences and padding, ragged or in windows of equal sequences (every cuDNN call then
    takes [windows, rows]), equals the jnp reference within bf16 rounding; padding rows are 0."""
    config = dataclasses.replace(
        TINY, num_heads=4, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    )
    outputs = []
    real = sum(lengths)
    positions = jnp.concatenate([jnp.arange(n) for n in lengths] + [jnp.zeros(40 - real, int)])
    segments = jnp.array([s for s, n in enumerate(lengths) for _ in range(n)] + [-1] * (40 - real))
    for impl in (AttentionImpl.XLA, AttentionImpl.CUDNN):
        attn = MultiHeadLatentAttention(
            config, topology=bj.Topology(), dtype=jnp.bfloat16, impl=impl, rngs=nnx.Rngs(3)
        )
        h = jax.random.normal(jax.random.key(8), (40, config.hidden_size), jnp.bfloat16)
        call = jax.jit(functools.partial(attn, window_rows=window_rows))
        args = (h, positions.astype(jnp.int32), segments.astype(jnp.int32))
        outputs.append(np.asarray(call(*args)[0], np.float32))
        if impl is AttentionImpl.CUDNN and window_rows:
            text = call.lower(*args).compile().as_text()
            calls = [line for line in text.splitlines() if "__cudnn$fmha" in line]
            assert calls and all(f"[{40 // window_rows},{window_rows}," in c for c in calls)
    np.testing.assert_allclose(outputs[1], outputs[0], atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(outputs[1][real:], 0)
