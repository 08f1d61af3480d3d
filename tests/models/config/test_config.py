"""DecoderConfig: Hugging Face config.json parsing (dense and MoE), presets and vocab padding."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import boundary_jax as bj
from models.build import load_model
from models.config import (
    PRESETS,
    Activation,
    AttentionKind,
    DecoderConfig,
    DynamicNtkRopeScaling,
    LayerAttention,
    LinearRopeScaling,
    Llama3RopeScaling,
    MoeConfig,
    ResidualDesign,
    YarnRopeScaling,
    padded_vocab,
    read_hf_config,
    write_hf_config,
)
from models.serving.runtime import ShardedCausalLM

F, S = AttentionKind.FULL, AttentionKind.SLIDING

GOLDEN = Path(__file__).parents[2] / "golden"


def golden_config(name: str) -> dict:
    return json.loads((GOLDEN / name / "config.json").read_text())


def test_qwen3_golden_config():
    """A transformers-5 Qwen3 config (rope_parameters, tied, head_dim 16) reads field by field."""
    config = read_hf_config(golden_config("qwen3"))
    assert config == DecoderConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=250,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling=None,
        qk_norm=True,
        tie_word_embeddings=True,
        sliding_window=None,
        max_position_embeddings=128,
    )


def test_llama_legacy_rope_scaling():
    """The legacy rope_theta + rope_scaling (llama3) form gives a Llama3RopeScaling."""
    config = read_hf_config(golden_config("llama"))
    assert config.architecture == "LlamaForCausalLM"
    assert config.rope_theta == 1e4
    assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 100)
    assert (config.head_dim, config.num_kv_heads, config.qk_norm) == (8, 2, False)
    assert not config.tie_word_embeddings and config.sliding_window is None


def test_mistral_config():
    """Mistral reads its kv heads, eps and (null) sliding window."""
    config = read_hf_config(golden_config("mistral"))
    assert config.architecture == "MistralForCausalLM"
    assert (config.num_layers, config.num_kv_heads, config.rms_norm_eps) == (2, 4, 1e-5)
    assert config.sliding_window is None and config.rope_scaling is None
    assert read_hf_config(golden_config("mistral") | {"sliding_window": 32}).sliding_window


def test_mistral_layer_types_name_the_sliding_layers():
    """A Mistral config.json with `layer_types` slides on the layers they mark only (transformers
    builds it as Ministral), and writes them back."""
    kinds = ["full_attention", "sliding_attention"]
    hf = golden_config("mistral") | {"sliding_window": 8, "layer_types": kinds}
    config = read_hf_config(hf)
    assert config.sliding_window == 8
    assert [kind.value for kind in config.layer_types] == kinds
    assert read_hf_config(write_hf_config(config)) == config
    assert read_hf_config(hf | {"layer_types": kinds[1:] * 2}).layer_types is None


def test_rope_scaling_beside_rope_parameters_of_another_base_is_refused():
    """A legacy rope_scaling added to a transformers-5 config (as model cards say to add YaRN)
    leaves the base ambiguous: transformers drops rope_parameters and its rope_theta. Refused,
    unless the top level names the same base."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    hf = golden_config("qwen3") | {"rope_scaling": yarn}
    with pytest.raises(ValueError, match="drops rope_parameters"):
        read_hf_config(hf)
    config = read_hf_config(hf | {"rope_theta": 1e6})
    assert config.rope_theta == 1e6 and config.rope_scaling.factor == 4.0


def test_rope_parameters_llama3_form():
    """transformers-5 rope_parameters with rope_type llama3 equals the legacy form."""
    legacy = golden_config("llama")
    modern = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    modern["rope_parameters"] = legacy["rope_scaling"] | {"rope_theta": legacy["rope_theta"]}
    assert read_hf_config(modern) == read_hf_config(legacy)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize(
    "name",
    [
        "qwen3",
        "llama",
        "mistral",
        "qwen2",
        "qwen3_moe",
        "mixtral",
        "qwen2_moe",
        "olmo2",
        "exaone4",
        "gemma3",
        "apertus",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_moe",
    ],
)
def test_every_rotary_family_reads_yarn(name):
    """YaRN (as Qwen3's long-context configs add it) reads in every family that rotates q and k
    with the rotary path every family shares, and writes back to the same config; random
    configs of each matched transformers within 5e-6 on TP 1 and 2 (closing note, 2026-12-05)."""
    raw = golden_config(name)
    if name == "gemma3":
        parameters = raw["rope_parameters"]
        full = parameters["full_attention"] | YARN
        raw = raw | {"rope_parameters": parameters | {"full_attention": full}}
    else:
        raw = {key: value for key, value in raw.items() if key != "rope_scaling"}
        theta = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta"))
        raw = raw | {"rope_parameters": YARN | {"rope_theta": theta}}
    config = read_hf_config(raw)
    assert config.rope_scaling == YarnRopeScaling(factor=4.0, original_max_position_embeddings=16)
    assert read_hf_config(write_hf_config(config)) == config


def test_rope_scaling_context_defaults_as_transformers():
    """A llama3 or YaRN entry without original_max_position_embeddings takes the config's
    top-level one, else max_position_embeddings, and a top-level one wins over the entry's
    (transformers' `standardize_rope_params`); a YaRN entry without a factor takes the ratio."""
    legacy = {k: v for k, v in golden_config("qwen3").items() if k != "rope_parameters"}
    legacy |= {"rope_theta": 1e6, "max_position_embeddings": 128}
    bare = read_hf_config(legacy | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert bare.rope_scaling == YarnRopeScaling(4.0, 128)
    top = legacy | {"rope_scaling": YARN, "original_max_position_embeddings": 32}
    assert read_hf_config(top).rope_scaling == YarnRopeScaling(4.0, 32)
    ratio = {"rope_type": "yarn", "original_max_position_embeddings": 32}
    assert read_hf_config(legacy | {"rope_scaling": ratio}).rope_scaling == YarnRopeScaling(4.0, 32)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling = read_hf_config(legacy | {"rope_scaling": llama3}).rope_scaling
    assert scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 128)


def test_dynamic_ntk_rope_is_the_unscaled_rope_within_the_context(tmp_path):
    """Dynamic NTK scaling grows the base only past max_position_embeddings (transformers'
    `dynamic_rope_update`), which no input here reaches: the Qwen3 golden with `dynamic` RoPE
    gives transformers' logits of the unscaled model, and writes `dynamic` back."""
    raw = golden_config("qwen3")
    rope = raw["rope_parameters"] | {"rope_type": "dynamic", "factor": 4.0}
    config = read_hf_config(raw | {"rope_parameters": rope})
    assert config.rope_scaling == DynamicNtkRopeScaling(4.0)
    assert read_hf_config(write_hf_config(config)) == config
    checkpoint = tmp_path / "qwen3"
    shutil.copytree(GOLDEN / "qwen3", checkpoint)
    (checkpoint / "config.json").write_text(json.dumps(raw | {"rope_parameters": rope}))
    prompts = json.loads((GOLDEN / "qwen3" / "prompts.json").read_text())
    want = np.load(GOLDEN / "qwen3" / "reference.npz")["logits"]
    mesh = bj.make_mesh(bj.Topology(attn_tp=2))
    logits = ShardedCausalLM(load_model(checkpoint, mesh), mesh).forward(prompts)
    assert np.max(np.abs(logits - want)) <= 1e-4 * np.max(np.abs(want))


def test_head_dim_defaults_to_hidden_over_heads():
    """Without a head_dim key, head_dim is hidden_size // num_attention_heads."""
    raw = golden_config("mistral")
    del raw["head_dim"]
    assert read_hf_config(raw).head_dim == 64 // 8


def test_qwen3_sliding_window_only_when_enabled():
    """Qwen3's window applies only with use_sliding_window, to the layers layer_types marks."""
    raw = golden_config("qwen3") | {"sliding_window": 8}
    assert read_hf_config(raw).sliding_window is None
    all_sliding = raw | {"use_sliding_window": True, "layer_types": ["sliding_attention"] * 3}
    assert read_hf_config(all_sliding).sliding_window == 8
    mixed = all_sliding | {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}
    config = read_hf_config(mixed)
    assert config.layer_types == (F, S, F)
    assert [config.layer_attention(i).sliding_window for i in range(3)] == [None, 8, None]


@pytest.mark.parametrize(
    "change,match",
    [
        ({"architectures": ["GemmaForCausalLM"]}, "exactly one architecture"),
        ({"architectures": None}, "exactly one architecture"),
        ({"hidden_act": "gelu"}, "SiLU"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope' is not"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "llama3 RoPE scaling is"),
        ({"vocab_size": None}, "no 'vocab_size'"),
    ],
)
def test_rejects_unsupported(change, match):
    """Unsupported architectures, biases, activations and RoPE types fail with a clear error."""
    with pytest.raises(ValueError, match=match):
        read_hf_config(golden_config("qwen3") | change)


def test_activations_read_by_transformers_other_names():
    """transformers' `swish` is SiLU and `gelu_new` tanh GELU (`ACT2FN`): read as them."""
    for name, want in (("qwen3", "swish"), ("gemma3", "gelu_new")):
        key = "hidden_activation" if name == "gemma3" else "hidden_act"
        assert read_hf_config(golden_config(name) | {key: want}) == read_hf_config(
            golden_config(name)
        )


def test_validates_head_grouping():
    """num_heads must be a multiple of num_kv_heads."""
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        read_hf_config(golden_config("mistral") | {"num_key_value_heads": 3})


@pytest.mark.parametrize("vocab,shards,want", [(250, 8, 256), (250, 1, 250), (256, 8, 256)])
def test_padded_vocab(vocab, shards, want):
    """padded_vocab rounds up to the next multiple of the shard count."""
    assert padded_vocab(vocab, shards) == want


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_and_small(name):
    """Every preset is a valid, hashable config of at most a few MB of float32 weights."""
    config = PRESETS[name]
    hash(config)
    attn = config.hidden_size * config.head_dim * 2 * (config.num_heads + config.num_kv_heads)
    mlp = 3 * config.hidden_size * config.intermediate_size
    heads = 1 if config.tie_word_embeddings else 2
    params = config.num_layers * (attn + mlp) + heads * config.vocab_size * config.hidden_size
    assert params * 4 < 8e6
    assert PRESETS["tiny-qwen3"].qk_norm and PRESETS["small-llama"].rope_scaling is not None


def test_qwen3_moe_golden_config():
    """Qwen3-MoE: experts (as num_local_experts), top-k, renormalisation, a dense middle layer."""
    config = read_hf_config(golden_config("qwen3_moe"))
    assert config.architecture == "Qwen3MoeForCausalLM"
    assert config.qk_norm and not config.qkv_bias and config.sliding_window is None
    assert config.moe == MoeConfig(
        num_experts=16,
        top_k=4,
        expert_intermediate_size=16,
        renormalize=True,
        mlp_only_layers=(1,),
        decoder_sparse_step=1,
    )
    assert config.intermediate_size == 128  # the dense layer's width
    assert config.sparse_layers == (True, False, True)


def test_qwen3_moe_hub_spelling_and_sparse_step():
    """The hub's num_experts key equals num_local_experts; decoder_sparse_step picks layers."""
    raw = golden_config("qwen3_moe")
    hub = {k: v for k, v in raw.items() if k != "num_local_experts"} | {"num_experts": 16}
    assert read_hf_config(hub) == read_hf_config(raw)
    stepped = read_hf_config(raw | {"mlp_only_layers": [], "decoder_sparse_step": 2})
    assert stepped.sparse_layers == (False, True, False)
    assert not read_hf_config(raw | {"norm_topk_prob": False}).moe.renormalize


@pytest.mark.parametrize("name,window", [("mixtral", None), ("mixtral_sliding", 5)])
def test_mixtral_golden_config(name, window):
    """Mixtral: the expert width is intermediate_size, always renormalised, every layer sparse."""
    config = read_hf_config(golden_config(name))
    assert config.architecture == "MixtralForCausalLM"
    assert config.sliding_window == window
    assert config.moe == MoeConfig(
        num_experts=8, top_k=2, expert_intermediate_size=16, renormalize=True
    )
    assert config.sparse_layers == (True, True)
    assert not config.qk_norm and not config.qkv_bias


def test_qwen2_moe_golden_config():
    """Qwen2-MoE: no renormalisation, a sigmoid-gated shared expert, q/k/v biases."""
    config = read_hf_config(golden_config("qwen2_moe"))
    assert config.architecture == "Qwen2MoeForCausalLM"
    assert config.qkv_bias and not config.qk_norm
    assert config.sliding_window is None  # the file says sliding_window 0, use_sliding_window off
    assert config.moe == MoeConfig(
        num_experts=8,
        top_k=2,
        expert_intermediate_size=16,
        renormalize=False,
        shared_expert_intermediate_size=32,
        shared_expert_gate=True,
        mlp_only_layers=(1,),
    )
    assert config.sparse_layers == (True, False, True, True)
    assert config.intermediate_size == 64
    renormalized = golden_config("qwen2_moe") | {"norm_topk_prob": True}
    assert read_hf_config(renormalized).moe.renormalize
    hub = {k: v for k, v in golden_config("qwen2_moe").items() if k != "qkv_bias"}
    assert read_hf_config(hub).qkv_bias  # hub checkpoints have no key: biased
    assert not read_hf_config(hub | {"qkv_bias": False}).qkv_bias


def test_qwen2_golden_config():
    """Dense Qwen2 always has q/k/v biases and no MoE settings."""
    config = read_hf_config(golden_config("qwen2"))
    assert config.architecture == "Qwen2ForCausalLM"
    assert config.qkv_bias and config.moe is None and config.tie_word_embeddings
    assert config.sparse_layers == (False, False)
    assert (config.intermediate_size, config.head_dim, config.sliding_window) == (96, 8, None)


def test_dense_configs_have_no_bias_or_moe():
    """The existing dense goldens read qkv_bias=False and moe=None."""
    for name in ("qwen3", "llama", "mistral"):
        config = read_hf_config(golden_config(name))
        assert not config.qkv_bias and config.moe is None


def test_qwen_moe_sliding_windows():
    """Qwen3-MoE's window covers every layer when enabled; Qwen2-MoE's default alternates."""
    raw = golden_config("qwen3_moe") | {"sliding_window": 8, "use_sliding_window": True}
    assert read_hf_config(raw).sliding_window == 8
    qwen2 = golden_config("qwen2_moe") | {"sliding_window": 8, "use_sliding_window": True}
    del qwen2["layer_types"]
    layers = qwen2["num_hidden_layers"]
    assert read_hf_config(qwen2).layer_types == (S, F) * (layers // 2)


@pytest.mark.parametrize(
    "name,change,match",
    [
        ("qwen3_moe", {"num_local_experts": None}, "neither 'num_experts' nor"),
        ("qwen3_moe", {"num_experts_per_tok": 17}, "top_k cannot exceed num_experts"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "no 'moe_intermediate_size'"),
        ("qwen3_moe", {"mlp_only_layers": [3]}, "below num_layers=3"),
        ("qwen2_moe", {"shared_expert_intermediate_size": None}, "shared_expert_intermediate"),
        ("mixtral", {"num_experts_per_tok": 0}, "top_k must be a positive int"),
    ],
)
def test_rejects_bad_moe(name, change, match):
    """Missing or inconsistent MoE settings fail at construction with the field named."""
    with pytest.raises(ValueError, match=match):
        read_hf_config(golden_config(name) | change)


def test_moe_config_invariants():
    """MoE settings belong to MoE architectures only; a gate needs a shared expert."""
    dense = read_hf_config(golden_config("qwen3"))
    moe = MoeConfig(num_experts=4, top_k=2, expert_intermediate_size=8, renormalize=True)
    with pytest.raises(ValueError, match="takes no MoE settings"):
        dataclasses.replace(dense, moe=moe)
    sparse = read_hf_config(golden_config("mixtral"))
    with pytest.raises(ValueError, match="needs MoE settings"):
        dataclasses.replace(sparse, moe=None)
    with pytest.raises(ValueError, match="needs a shared expert"):
        dataclasses.replace(moe, shared_expert_gate=True)
    with pytest.raises(TypeError, match="tuple of layer indices"):
        dataclasses.replace(moe, mlp_only_layers=[1])
    hash(dataclasses.replace(sparse, moe=dataclasses.replace(moe, mlp_only_layers=(0,))))


def test_exaone4_golden_config():
    """EXAONE 4.0: post-norm, per-head q/k norm, its layer_types, no RoPE on global layers."""
    config = read_hf_config(golden_config("exaone4"))
    assert config.architecture == "Exaone4ForCausalLM"
    assert config.residual_design is ResidualDesign.POST_NORM
    assert config.qk_norm and not config.qk_norm_whole and not config.unit_offset_norms
    assert config.layer_types == (S, S, F) and config.sliding_window == 4
    assert config.layer_attention(0) == LayerAttention(4, 1e4)
    assert config.layer_attention(2) == LayerAttention(None, None)  # global NoPE
    # Without a window every layer is global and rotates.
    plain = read_hf_config(golden_config("exaone4") | {"sliding_window": None})
    assert plain.layer_types is None and plain.layer_attention(2) == LayerAttention(None, 1e4)
    # Without layer_types, an integer sliding_window_pattern gives them (every 3rd is global).
    raw = {k: v for k, v in golden_config("exaone4").items() if k != "layer_types"}
    assert read_hf_config(raw).layer_types == (S, S, F)
    with pytest.raises(ValueError, match="integer sliding_window_pattern"):
        read_hf_config(raw | {"sliding_window_pattern": "LLG"})
    # A window with no sliding layer (all global by layer_types or a pattern of 1): as in
    # transformers, no layer rotates; written back, it reads the same.
    for every_layer_global in ({"layer_types": [F.value] * 3}, {"sliding_window_pattern": 1}):
        nope = read_hf_config(raw | every_layer_global)
        assert nope.sliding_window is None and nope.layer_types is None
        assert [nope.layer_attention(i) for i in range(3)] == [LayerAttention(None, None)] * 3
        assert read_hf_config(write_hf_config(nope)) == nope


def test_olmo2_golden_config():
    """OLMo 2: post-norm, q/k norm over the whole projection, full attention everywhere."""
    config = read_hf_config(golden_config("olmo2"))
    assert config.architecture == "Olmo2ForCausalLM"
    assert config.residual_design is ResidualDesign.POST_NORM
    assert config.qk_norm and config.qk_norm_whole
    assert config.layer_types is None and config.layer_attention(1) == LayerAttention(None, 1e4)


def test_gemma3_golden_config():
    """Gemma 3: sandwich norms with 1 + w, GeGLU, local RoPE base on sliding layers, linear
    scaling on global ones, query_pre_attn_scalar, scaled embedding."""
    config = read_hf_config(golden_config("gemma3"))
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.residual_design is ResidualDesign.SANDWICH and config.unit_offset_norms
    assert config.activation is Activation.GELU_TANH and config.query_pre_attn_scalar == 24
    assert config.embedding_scale == 8.0 and not config.tie_word_embeddings
    assert config.layer_types == (S, F, S)
    assert config.layer_attention(0) == LayerAttention(4, 1e3)
    assert config.layer_attention(1) == LayerAttention(None, 1e4, LinearRopeScaling(4.0))
    # The hub's legacy keys read the same.
    legacy = {k: v for k, v in golden_config("gemma3").items() if k != "rope_parameters"}
    legacy |= {
        "rope_theta": 1e4,
        "rope_local_base_freq": 1e3,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    }
    assert read_hf_config(legacy) == config
    tied = {k: v for k, v in golden_config("gemma3").items() if k != "tie_word_embeddings"}
    assert read_hf_config(tied).tie_word_embeddings  # Gemma's default


@pytest.mark.parametrize(
    "change,match",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"use_bidirectional_attention": True}, "attend causally"),
        ({"hidden_activation": "gelu"}, "tanh GELU only"),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}}}, "'sliding_attention'"),
        ({"layer_types": ["full_attention"] * 2}, "each of the 3 layers"),
    ],
)
def test_rejects_unsupported_gemma3(change, match):
    """Gemma 3 options the decoder does not implement fail when the config is read."""
    with pytest.raises(ValueError, match=match):
        read_hf_config(golden_config("gemma3") | change)


def test_layer_types_invariants():
    """layer_types names every layer, and sliding layers need a window."""
    config = read_hf_config(golden_config("exaone4"))
    with pytest.raises(ValueError, match="one attention kind per layer"):
        dataclasses.replace(config, layer_types=(S, F))
    with pytest.raises(ValueError, match="sliding_window is None"):
        dataclasses.replace(config, sliding_window=None)
    with pytest.raises(TypeError, match="tuple of AttentionKind"):
        dataclasses.replace(config, layer_types=["sliding_attention"] * 3)
    with pytest.raises(ValueError, match="needs qk_norm=True"):
        dataclasses.replace(config, qk_norm=False, qk_norm_whole=True)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "longcat_flash"])
def test_latent_attention_refuses_mscale_all_dim_under_other_rope_than_yarn(name):
    """transformers scales a latent attention's softmax by yarn_mscale(factor,
    mscale_all_dim) ** 2 under any RoPE scaling; here only YaRN carries it, so another type
    with an effective mscale_all_dim is refused, and without it (or at factor 1) reads."""
    raw = golden_config(name)
    base = raw.get("rope_parameters") or {"rope_theta": raw["rope_theta"]}
    linear = {"rope_theta": base["rope_theta"], "rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="mscale_all_dim=1.0 under 'linear'"):
        read_hf_config(raw | {"rope_parameters": linear | {"mscale_all_dim": 1.0}})
    assert read_hf_config(raw | {"rope_parameters": linear}).mla.softmax_scale == pytest.approx(
        read_hf_config(raw).mla.qk_head_dim ** -0.5
    )
    one = linear | {"factor": 1.0, "mscale_all_dim": 1.0}
    assert read_hf_config(raw | {"rope_parameters": one}).mla.rope_scaling == LinearRopeScaling(1.0)


def test_a_ministral3_rope_entry_without_a_base_takes_its_default_theta():
    """transformers' Ministral3Config fills a rope_parameters without rope_theta with its
    default_theta (1e4), not the 1e6 of its default RoPE entry."""
    config = golden_config("ministral3")
    del config["rope_parameters"]["rope_theta"]
    assert read_hf_config(config).rope_theta == 1e4
    assert (
        read_hf_config({k: v for k, v in config.items() if k != "rope_parameters"}).rope_theta
        == 1e6
    )
