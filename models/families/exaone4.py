"""EXAONE 4.0 (Hugging Face `Exaone4ForCausalLM`): post-norm layers (each stage reads the residual
as is and adds the norm of its output), q/k RMSNorm per head, sliding-window and global layers
from `layer_types` (or every `sliding_window_pattern`-th layer global), and no RoPE on the
global layers of a model with a window (also where every layer is global)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import Activation, AttentionKind, DecoderConfig, ResidualDesign
from ..config.hf import (
    every_nth_full,
    layer_windows,
    plain_decoder,
    plain_decoder_json,
    read_activation,
    required,
    window_json,
)
from ..config.registry import register
from ..decoder.model import CausalLM


@register
class Exaone4ForCausalLM(CausalLM):
    """EXAONE 4.0: post-norm, per-head q/k norm, local and global layers."""

    architectures = ("Exaone4ForCausalLM",)
    model_type = "exaone4"
    # transformers' Exaone4Config defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 16384,
        "max_position_embeddings": 2048,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "vocab_size": 102400,
    }
    lora = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        architecture = cls.architectures[0]
        read_activation(hf_config, Activation.SILU)
        layers = required(hf_config, "num_hidden_layers")
        default = None
        if hf_config.get("sliding_window") and not hf_config.get("layer_types"):
            pattern = hf_config.get("sliding_window_pattern")
            default = every_nth_full(pattern, layers, "EXAONE 4.0")
        window, kinds = layer_windows(hf_config, layers, default)
        return plain_decoder(
            hf_config,
            architecture,
            qk_norm=True,
            sliding_window=window,
            layer_types=kinds,
            # transformers rotates no global layer of a config with a window, even where no
            # layer slides.
            nope_full_layers=bool(hf_config.get("sliding_window")),
            residual_design=ResidualDesign.POST_NORM,
        )

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        keys = plain_decoder_json(config, cls.model_type) | window_json(config)
        if config.nope_full_layers and config.sliding_window is None:
            # Global layers without RoPE and none sliding: a window that no layer uses.
            keys |= {
                "sliding_window": config.max_position_embeddings,
                "layer_types": [AttentionKind.FULL.value] * config.num_layers,
            }
        return keys
