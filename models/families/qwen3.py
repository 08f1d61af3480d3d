"""Qwen3 (Hugging Face `Qwen3ForCausalLM`): q/k RMSNorm per head before RoPE, usually tied
embeddings; a sliding window only with `use_sliding_window`, on the layers from
`max_window_layers` on (or as `layer_types` says)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..config import Activation, DecoderConfig
from ..config.hf import (
    attention_bias,
    opt_in_windows,
    plain_decoder,
    plain_decoder_json,
    read_activation,
    required,
    window_json,
)
from ..config.registry import add_presets, register
from ..decoder.model import CausalLM


@register
class Qwen3ForCausalLM(CausalLM):
    """Qwen3: q/k RMSNorm per head before RoPE, usually tied embeddings."""

    architectures = ("Qwen3ForCausalLM",)
    image_text_architectures = ("Qwen3VLForConditionalGeneration",)
    model_type = "qwen3"
    # transformers' Qwen3Config defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 22016,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    # transformers' Qwen3VLTextConfig defaults, where they differ.
    image_text_defaults = {
        "Qwen3VLForConditionalGeneration": {
            "max_position_embeddings": 128000,
            "rope_theta": 500000.0,
        }
    }
    lora = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        architecture = cls.architectures[0]
        read_activation(hf_config, Activation.SILU)
        layers = required(hf_config, "num_hidden_layers")
        first = hf_config.get("max_window_layers", layers)
        window, kinds = opt_in_windows(hf_config, layers, [i >= first for i in range(layers)])
        return plain_decoder(
            hf_config,
            architecture,
            **attention_bias(hf_config),
            qk_norm=True,
            sliding_window=window,
            layer_types=kinds,
        )

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return plain_decoder_json(config, cls.model_type) | window_json(config)


TINY = DecoderConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
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
add_presets(
    {
        "tiny-qwen3": TINY,
        # Widths of whole 128 x 128 blocks at up to 4 ranks per split, for FP8 weights.
        "tiny-qwen3-fp8": dataclasses.replace(
            TINY,
            hidden_size=256,
            intermediate_size=512,
            num_layers=2,
            num_heads=4,
            num_kv_heads=4,
            head_dim=128,
        ),
    }
)
