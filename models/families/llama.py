"""Llama (Hugging Face `LlamaForCausalLM`): grouped-query attention with llama3 RoPE scaling where
the config asks for it, no window, no q/k norm; attention and MLP biases where `attention_bias`
and `mlp_bias` ask for them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import Activation, DecoderConfig, Llama3RopeScaling
from ..config.hf import (
    attention_bias,
    plain_decoder,
    plain_decoder_json,
    read_activation,
)
from ..config.registry import add_presets, register
from ..decoder.model import CausalLM


@register
class LlamaForCausalLM(CausalLM):
    """Llama (with llama3 RoPE scaling)."""

    architectures = ("LlamaForCausalLM",)
    # LLaVA's and LLaVA-NeXT's language model where their text_config names no other.
    image_text_architectures = (
        "LlavaForConditionalGeneration",
        "LlavaNextForConditionalGeneration",
    )
    model_type = "llama"
    # transformers' LlamaConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
    }
    lora = True
    mlp_biases = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        read_activation(hf_config, Activation.SILU)
        return plain_decoder(
            hf_config,
            cls.architectures[0],
            **attention_bias(hf_config),
            mlp_bias=bool(hf_config.get("mlp_bias", False)),
        )

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return plain_decoder_json(config, cls.model_type) | {"mlp_bias": config.mlp_bias}


add_presets(
    {
        # About 0.9M parameters (3.5 MB in float32).
        "small-llama": DecoderConfig(
            architecture="LlamaForCausalLM",
            vocab_size=512,
            hidden_size=128,
            intermediate_size=384,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_theta=5e5,
            rope_scaling=Llama3RopeScaling(
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=256,
            ),
            qk_norm=False,
            tie_word_embeddings=False,
            sliding_window=None,
            max_position_embeddings=2048,
        )
    }
)
