"""Gemma 3, text only (Hugging Face `Gemma3ForCausalLM`): sandwich norms (a pre-norm read, and a
norm of each complete output before the plain add), `1 + w` RMSNorms everywhere, embeddings
scaled by sqrt(hidden), GeGLU (tanh GELU), per-head q/k norms, sliding-window layers with a
local RoPE base and global ones with the (optionally linearly scaled) global base, attention
scores scaled by `query_pre_attn_scalar`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..config import Activation, AttentionKind, DecoderConfig, ResidualDesign, RopeScaling
from ..config.hf import (
    attention_bias,
    every_nth_full,
    integral,
    layer_windows,
    plain_decoder,
    plain_decoder_json,
    read_activation,
    required,
    window_json,
)
from ..config.registry import register
from ..config.rope_scaling import rope_parameters, rope_scaling
from ..decoder.model import CausalLM


@register
class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 (text): sandwich norms, `1 + w` norms, scaled embeddings, GeGLU."""

    architectures = ("Gemma3ForCausalLM",)
    # transformers' Gemma3TextConfig defaults: released image-text checkpoints' text_config
    # names only what differs (e.g. hidden size, layers and RoPE).
    config_defaults = {
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "pad_token_id": 0,
    }
    image_text_architectures = ("Gemma3ForConditionalGeneration",)
    model_type = "gemma3_text"
    lora = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        architecture = cls.architectures[0]
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf_config.get(key) is not None:
                raise ValueError(
                    f"{architecture} with {key}={hf_config[key]!r} is not supported (Gemma 3 "
                    "checkpoints set it null); use a config without softcapping"
                )
        if hf_config.get("use_bidirectional_attention", False):
            raise ValueError(
                f"{architecture} with use_bidirectional_attention=true is not supported: the "
                "decoders here attend causally"
            )
        activation = read_activation(
            hf_config, Activation.GELU_TANH, "hidden_activation", "hidden_act"
        )
        theta, scaling, local_theta = _read_rope(hf_config)
        layers = required(hf_config, "num_hidden_layers")
        default = None
        if hf_config.get("sliding_window") and not hf_config.get("layer_types"):
            pattern = hf_config.get("sliding_window_pattern", 6)
            default = every_nth_full(pattern, layers, "Gemma 3")
        window, kinds = layer_windows(hf_config, layers, default)
        hidden = required(hf_config, "hidden_size")
        return plain_decoder(
            hf_config,
            architecture,
            **attention_bias(hf_config),
            rope=(theta, scaling),
            tie_word_embeddings=True,
            qk_norm=True,
            sliding_window=window,
            layer_types=kinds,
            rope_local_theta=local_theta,
            query_pre_attn_scalar=float(required(hf_config, "query_pre_attn_scalar")),
            activation=activation,
            residual_design=ResidualDesign.SANDWICH,
            unit_offset_norms=True,
            embedding_scale=math.sqrt(hidden),
        )

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        out = plain_decoder_json(config, cls.model_type) | window_json(config)
        del out["hidden_act"]
        return out | {
            "hidden_activation": config.activation.value,
            "query_pre_attn_scalar": integral(config.query_pre_attn_scalar),
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "rope_parameters": {
                AttentionKind.FULL.value: out["rope_parameters"],
                AttentionKind.SLIDING.value: rope_parameters(config.rope_local_theta, None),
            },
        }


def _read_rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None, float]:
    """The global RoPE (base and scaling) and the local base: transformers 5 writes one
    `rope_parameters` entry per layer type; hub files say `rope_theta`, `rope_scaling`
    (global) and `rope_local_base_freq`."""
    parameters = config.get("rope_parameters")
    if parameters is None:
        theta = float(config.get("rope_theta", 1_000_000.0))
        scaling = rope_scaling(config.get("rope_scaling") or {}, config)
        return theta, scaling, float(config.get("rope_local_base_freq", 10_000.0))
    full = parameters.get(AttentionKind.FULL.value)
    local = parameters.get(AttentionKind.SLIDING.value)
    if full is None or local is None or "rope_theta" not in full or "rope_theta" not in local:
        raise ValueError(
            "Gemma 3's rope_parameters needs 'full_attention' and 'sliding_attention' entries "
            f"with a rope_theta each; got {parameters!r}"
        )
    if rope_scaling(local) is not None:
        raise ValueError(
            f"RoPE scaling on Gemma 3's sliding-window layers is not supported; got {local!r}"
        )
    return float(full["rope_theta"]), rope_scaling(full, config), float(local["rope_theta"])
