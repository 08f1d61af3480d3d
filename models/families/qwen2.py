"""Qwen2 / Qwen2.5 (Hugging Face `Qwen2ForCausalLM`): q, k and v projections with biases (split
with their heads; its config has no key for them), no q/k norm; a sliding window only with
`use_sliding_window`, on the layers from `max_window_layers` on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import Activation, DecoderConfig
from ..config.hf import (
    opt_in_windows,
    plain_decoder,
    plain_decoder_json,
    read_activation,
    required,
    window_json,
)
from ..config.registry import register
from ..decoder.model import CausalLM

QWEN2_VL = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


@register
class Qwen2ForCausalLM(CausalLM):
    """Qwen2 / Qwen2.5: q/k/v biases, no q/k norm."""

    architectures = ("Qwen2ForCausalLM",)
    # Qwen2-VL's and Qwen2.5-VL's language model, and LLaVA-OneVision's by default.
    image_text_architectures = (*QWEN2_VL, "LlavaOnevisionForConditionalGeneration")
    text_tie_architectures = QWEN2_VL
    model_type = "qwen2"
    # transformers' Qwen2Config defaults: a key config.json leaves out reads as there.
    config_defaults = {
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
    # transformers' Qwen2VLTextConfig and Qwen2_5_VLTextConfig defaults, where they differ.
    image_text_defaults = dict.fromkeys(
        QWEN2_VL,
        {
            "hidden_size": 8192,
            "intermediate_size": 29568,
            "max_window_layers": 80,
            "num_attention_heads": 64,
            "num_hidden_layers": 80,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "vocab_size": 152064,
        },
    )
    lora = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        architecture = cls.architectures[0]
        read_activation(hf_config, Activation.SILU)
        layers = required(hf_config, "num_hidden_layers")
        first = hf_config.get("max_window_layers", layers)
        window, kinds = opt_in_windows(hf_config, layers, [i >= first for i in range(layers)])
        return plain_decoder(
            hf_config, architecture, qkv_bias=True, sliding_window=window, layer_types=kinds
        )

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return plain_decoder_json(config, cls.model_type) | window_json(config)
