"""Qwen2-MoE (Hugging Face `Qwen2MoeForCausalLM`): q/k/v biases (unless `qkv_bias` says
otherwise), a softmax top-k MoE without renormalization unless `norm_topk_prob`, and a shared
expert every token also goes through, scaled by `sigmoid(x @ shared_expert_gate)`; its default
window alternates below `max_window_layers`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import Activation, DecoderConfig
from ..config.hf import (
    opt_in_windows,
    plain_decoder,
    plain_decoder_json,
    plain_moe,
    plain_moe_json,
    read_activation,
    required,
    window_json,
)
from ..config.registry import register
from ..config.tensors import HFTensor, decoder_tensor_names, dense_layer_tensors, sparse_ffn_tensors
from ..decoder.moe import MoeCausalLM


@register
class Qwen2MoeForCausalLM(MoeCausalLM):
    """Qwen2-MoE: q/k/v biases, a sigmoid-gated shared expert."""

    architectures = ("Qwen2MoeForCausalLM",)
    model_type = "qwen2_moe"
    # transformers' Qwen2MoeConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "decoder_sparse_step": 1,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "moe_intermediate_size": 1408,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 16,
        "qkv_bias": True,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "shared_expert_intermediate_size": 5632,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    lora = True
    experts_optional = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        architecture = cls.architectures[0]
        read_activation(hf_config, Activation.SILU)
        layers = required(hf_config, "num_hidden_layers")
        first = hf_config.get("max_window_layers", layers)
        default = [bool((i + 1) % 2) and i < first for i in range(layers)]
        window, kinds = opt_in_windows(hf_config, layers, default)
        moe = None
        if hf_config.get("num_experts") != 0:
            moe = plain_moe(
                hf_config,
                architecture,
                shared_expert_intermediate_size=required(
                    hf_config, "shared_expert_intermediate_size"
                ),
                shared_expert_gate=True,
            )
        return plain_decoder(
            hf_config,
            architecture,
            # The hub checkpoints predate transformers 5's `qkv_bias` key: biases by default.
            qkv_bias=bool(hf_config.get("qkv_bias", True)),
            sliding_window=window,
            layer_types=kinds,
            moe=moe,
        )

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return (
            plain_decoder_json(config, cls.model_type)
            | window_json(config)
            | plain_moe_json(config)
            | {"qkv_bias": config.qkv_bias}
        )

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        return decoder_tensor_names(
            config,
            scan_layers=scan_layers,
            dense=dense_layer_tensors(config),
            sparse=None if config.moe is None else sparse_ffn_tensors(config),
        )
