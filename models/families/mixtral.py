"""Mixtral (Hugging Face `MixtralForCausalLM`): grouped-query attention (a sliding window on every
layer where the config gives one) and a softmax top-k MoE on every layer, the k weights always
renormalized; its experts' tensors are `block_sparse_moe.experts.{e}.w1 / w3 / w2`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import Activation, DecoderConfig
from ..config.hf import (
    plain_decoder,
    plain_decoder_json,
    plain_moe,
    read_activation,
    window_json,
)
from ..config.registry import register
from ..config.tensors import HFTensor, decoder_tensor_names, dense_layer_tensors, sparse_ffn_tensors
from ..decoder.moe import MoeCausalLM


@register
class MixtralForCausalLM(MoeCausalLM):
    """Mixtral: every layer sparse, experts as wide as `intermediate_size`."""

    architectures = ("MixtralForCausalLM",)
    model_type = "mixtral"
    # transformers' attribute_map: two names config.json may give one key.
    config_aliases = {
        "num_experts": "num_local_experts",
    }
    # transformers' MixtralConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
    }
    lora = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        architecture = cls.architectures[0]
        read_activation(hf_config, Activation.SILU)
        moe = plain_moe(
            hf_config,
            architecture,
            expert_width="intermediate_size",
            renormalize=True,
            mlp_only_layers=(),
            decoder_sparse_step=1,
        )
        window = hf_config.get("sliding_window") or None
        return plain_decoder(hf_config, architecture, sliding_window=window, moe=moe)

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        experts = {
            "num_experts_per_tok": config.moe.top_k,
            "num_local_experts": config.moe.num_experts,
        }
        return (
            plain_decoder_json(config, cls.model_type)
            | window_json(config, layer_types=False)
            | experts
        )

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        sparse = sparse_ffn_tensors(config, prefix="block_sparse_moe.", experts=("w1", "w3", "w2"))
        return decoder_tensor_names(
            config, scan_layers=scan_layers, dense=dense_layer_tensors(config), sparse=sparse
        )
