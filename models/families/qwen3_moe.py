"""Qwen3-MoE (Hugging Face `Qwen3MoeForCausalLM`): attention with q/k RMSNorms per head and a
softmax top-k MoE, with dense layers where `mlp_only_layers` and `decoder_sparse_step` say; a
sliding window on every layer where `use_sliding_window` enables it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..config import Activation, DecoderConfig, MoeConfig
from ..config.hf import (
    attention_bias,
    opt_in_windows,
    plain_decoder,
    plain_decoder_json,
    plain_moe,
    plain_moe_json,
    read_activation,
    required,
    window_json,
)
from ..config.registry import add_presets, register
from ..config.tensors import HFTensor, decoder_tensor_names, dense_layer_tensors, sparse_ffn_tensors
from ..decoder.moe import MoeCausalLM


@register
class Qwen3MoeForCausalLM(MoeCausalLM):
    """Qwen3-MoE: per-head q/k norms, softmax top-k experts (renormalized where
    `norm_topk_prob`), dense and sparse layers in one stack."""

    architectures = ("Qwen3MoeForCausalLM",)
    model_type = "qwen3_moe"
    # transformers' attribute_map: two names config.json may give one key.
    config_aliases = {
        "num_experts": "num_local_experts",
    }
    # transformers' Qwen3MoeConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 32768,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 24,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
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
        window, _ = opt_in_windows(hf_config, required(hf_config, "num_hidden_layers"), None)
        return plain_decoder(
            hf_config,
            architecture,
            **attention_bias(hf_config),
            qk_norm=True,
            sliding_window=window,
            moe=None if hf_config.get("num_experts") == 0 else plain_moe(hf_config, architecture),
        )

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return (
            plain_decoder_json(config, cls.model_type)
            | window_json(config, layer_types=False)
            | plain_moe_json(config)
        )

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        return decoder_tensor_names(
            config,
            scan_layers=scan_layers,
            dense=dense_layer_tensors(config),
            sparse=None if config.moe is None else sparse_ffn_tensors(config),
        )


TINY = DecoderConfig(
    architecture="Qwen3MoeForCausalLM",
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
    tie_word_embeddings=False,
    sliding_window=None,
    max_position_embeddings=128,
    # A dense layer among three sparse ones (8 experts, top-2 of them).
    moe=MoeConfig(
        num_experts=8, top_k=2, expert_intermediate_size=32, renormalize=True, mlp_only_layers=(1,)
    ),
)
add_presets(
    {
        "tiny-qwen3-moe": TINY,
        # Widths of whole 128 x 128 blocks at up to 4 ranks per split, for FP8 weights.
        "tiny-qwen3-moe-fp8": dataclasses.replace(
            TINY,
            hidden_size=256,
            intermediate_size=512,
            num_layers=2,
            num_heads=4,
            num_kv_heads=4,
            head_dim=128,
            moe=dataclasses.replace(TINY.moe, expert_intermediate_size=512),
        ),
    }
)
