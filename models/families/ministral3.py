"""Ministral 3 (Hugging Face `Ministral3ForCausalLM`, the language model of the Ministral 3
image-text releases): grouped-query attention with an optional sliding window and a SwiGLU MLP,
YaRN RoPE, and queries scaled by their position (`rope_parameters.llama_4_scaling_beta`:
`1 + beta * log(1 + floor(p / original_max_position_embeddings))` after RoPE,
`models.config.QueryScaling`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import Activation, DecoderConfig, QueryScaling
from ..config.hf import plain_decoder, plain_decoder_json, read_activation, window_json
from ..config.registry import register
from ..decoder.model import CausalLM

BETA, PERIOD = "llama_4_scaling_beta", "original_max_position_embeddings"


@register
class Ministral3ForCausalLM(CausalLM):
    """Ministral 3: a plain decoder with Llama 4's position-dependent query scale."""

    architectures = ("Ministral3ForCausalLM",)
    model_type = "ministral3"
    # transformers' Ministral3Config defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 262144,
        "num_attention_heads": 32,
        "num_hidden_layers": 34,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 16384,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale_all_dim": 1.0,
            "mscale": 1.0,
            BETA: 0.1,
        },
        "rope_theta": 10000.0,  # its default_theta, for a rope_parameters that names none
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": 131072,
        "pad_token_id": 11,
    }
    lora = True
    query_scaling = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        """A plain decoder's config (its window where it has one) and the query scale of its
        RoPE entry.

        Raises:
          ValueError: The RoPE entry lacks `llama_4_scaling_beta` or
            `original_max_position_embeddings` (transformers' model reads both).
        """
        architecture = cls.architectures[0]
        read_activation(hf_config, Activation.SILU)
        entry = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
        missing = [key for key in (BETA, PERIOD) if entry.get(key) is None]
        if missing:
            raise ValueError(
                f"{architecture} scales its queries by rope_parameters' {BETA} and {PERIOD}; "
                f"this config.json's RoPE entry has no {missing}"
            )
        return plain_decoder(
            hf_config,
            architecture,
            sliding_window=hf_config.get("sliding_window") or None,
            query_scaling=QueryScaling(float(entry[BETA]), int(entry[PERIOD])),
        )

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        written = plain_decoder_json(config, cls.model_type) | window_json(
            config, layer_types=False
        )
        scaling = config.query_scaling
        written["rope_parameters"] |= {BETA: scaling.beta, PERIOD: scaling.period}
        return written

    @classmethod
    def check_config(cls, config: DecoderConfig) -> None:
        """A Ministral 3 config scales its queries.

        Raises:
          ValueError: `query_scaling` is None.
        """
        super().check_config(config)
        if config.query_scaling is None:
            raise ValueError(f"{config.architecture} needs query_scaling; got None")
