"""Mistral (Hugging Face `MistralForCausalLM`): grouped-query attention with a sliding window on
every layer where the config gives one, or on the layers its `layer_types` mark sliding
(transformers then builds the checkpoint as Ministral)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import Activation, DecoderConfig
from ..config.hf import (
    layer_windows,
    plain_decoder,
    plain_decoder_json,
    read_activation,
    required,
    window_json,
)
from ..config.registry import add_presets, register
from ..decoder.model import CausalLM


@register
class MistralForCausalLM(CausalLM):
    """Mistral: every layer within `sliding_window` (or full attention without one), unless
    `layer_types` names each layer's kind."""

    architectures = ("MistralForCausalLM",)
    image_text_architectures = ("Mistral3ForConditionalGeneration",)
    model_type = "mistral"
    # transformers' MistralConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
    }
    lora = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        architecture = cls.architectures[0]
        read_activation(hf_config, Activation.SILU)
        window, kinds = layer_windows(hf_config, required(hf_config, "num_hidden_layers"), None)
        return plain_decoder(hf_config, architecture, sliding_window=window, layer_types=kinds)

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        kinds = config.layer_types is not None
        return plain_decoder_json(config, cls.model_type) | window_json(config, layer_types=kinds)


add_presets(
    {
        "tiny-mistral": DecoderConfig(
            architecture="MistralForCausalLM",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=8,
            num_kv_heads=4,
            head_dim=8,
            rms_norm_eps=1e-5,
            rope_theta=1e4,
            rope_scaling=None,
            qk_norm=False,
            tie_word_embeddings=False,
            sliding_window=16,
            max_position_embeddings=128,
        )
    }
)
