"""OLMo 2 (Hugging Face `Olmo2ForCausalLM`): post-norm layers and a q/k RMSNorm over the whole
projection (all heads; under attention TP its sum of squares completes in one small all-reduce
inside attention); no window."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import Activation, DecoderConfig, ResidualDesign
from ..config.hf import attention_bias, plain_decoder, plain_decoder_json, read_activation
from ..config.registry import register
from ..decoder.model import CausalLM


@register
class Olmo2ForCausalLM(CausalLM):
    """OLMo 2: post-norm, q/k norm over the whole projection."""

    architectures = ("Olmo2ForCausalLM",)
    model_type = "olmo2"
    # transformers' Olmo2Config defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "pad_token_id": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": 50304,
    }
    lora = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        architecture = cls.architectures[0]
        read_activation(hf_config, Activation.SILU)
        return plain_decoder(
            hf_config,
            architecture,
            **attention_bias(hf_config),
            qk_norm=True,
            qk_norm_whole=True,
            residual_design=ResidualDesign.POST_NORM,
        )

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return plain_decoder_json(config, cls.model_type)
