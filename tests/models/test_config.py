"""DecoderConfig: Hugging Face config.json parsing, presets and vocab padding."""

import json
from pathlib import Path

import pytest

from models.config import (
    PRESETS,
    Architecture,
    DecoderConfig,
    Llama3RopeScaling,
    padded_vocab,
)

GOLDEN = Path(__file__).parents[1] / "golden"


def golden_config(name: str) -> dict:
    return json.loads((GOLDEN / name / "config.json").read_text())


def test_qwen3_golden_config():
    """A transformers-5 Qwen3 config (rope_parameters, tied, head_dim 16) reads field by field."""
    config = DecoderConfig.from_hf(golden_config("qwen3"))
    assert config == DecoderConfig(
        architecture=Architecture.QWEN3,
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
    config = DecoderConfig.from_hf(golden_config("llama"))
    assert config.architecture is Architecture.LLAMA
    assert config.rope_theta == 1e4
    assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 100)
    assert (config.head_dim, config.num_kv_heads, config.qk_norm) == (8, 2, False)
    assert not config.tie_word_embeddings and config.sliding_window is None


def test_mistral_config():
    """Mistral reads its kv heads, eps and (null) sliding window."""
    config = DecoderConfig.from_hf(golden_config("mistral"))
    assert config.architecture is Architecture.MISTRAL
    assert (config.num_layers, config.num_kv_heads, config.rms_norm_eps) == (2, 4, 1e-5)
    assert config.sliding_window is None and config.rope_scaling is None
    assert DecoderConfig.from_hf(golden_config("mistral") | {"sliding_window": 32}).sliding_window


def test_rope_parameters_llama3_form():
    """transformers-5 rope_parameters with rope_type llama3 equals the legacy form."""
    legacy = golden_config("llama")
    modern = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    modern["rope_parameters"] = legacy["rope_scaling"] | {"rope_theta": legacy["rope_theta"]}
    assert DecoderConfig.from_hf(modern) == DecoderConfig.from_hf(legacy)


def test_head_dim_defaults_to_hidden_over_heads():
    """Without a head_dim key, head_dim is hidden_size // num_attention_heads."""
    raw = golden_config("mistral")
    del raw["head_dim"]
    assert DecoderConfig.from_hf(raw).head_dim == 64 // 8


def test_qwen3_sliding_window_only_when_enabled():
    """Qwen3's window applies only with use_sliding_window; per-layer windows are rejected."""
    raw = golden_config("qwen3") | {"sliding_window": 8}
    assert DecoderConfig.from_hf(raw).sliding_window is None
    all_sliding = raw | {"use_sliding_window": True, "layer_types": ["sliding_attention"] * 3}
    assert DecoderConfig.from_hf(all_sliding).sliding_window == 8
    mixed = all_sliding | {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}
    with pytest.raises(ValueError, match="sliding windows on some layers"):
        DecoderConfig.from_hf(mixed)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"architectures": ["GemmaForCausalLM"]}, "exactly one architecture"),
        ({"architectures": None}, "exactly one architecture"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "SiLU"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "'yarn' is not supported"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "llama3 RoPE scaling is"),
        ({"vocab_size": None}, "no 'vocab_size'"),
    ],
)
def test_rejects_unsupported(change, match):
    """Unsupported architectures, biases, activations and RoPE types fail with a clear error."""
    with pytest.raises(ValueError, match=match):
        DecoderConfig.from_hf(golden_config("qwen3") | change)


def test_validates_head_grouping():
    """num_heads must be a multiple of num_kv_heads."""
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        DecoderConfig.from_hf(golden_config("mistral") | {"num_key_value_heads": 3})


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
