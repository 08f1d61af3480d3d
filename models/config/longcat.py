"""LongCat-Flash configurations: the reader and writer of `LongcatFlashForCausalLM`'s Hugging Face
`config.json`.

What transformers 5 reads from it (`LongcatFlashConfig`): `num_layers` layers (its
`num_hidden_layers` is twice that: each layer holds two attentions), each with two latent
attentions (DeepSeek-V3's MLA with q LoRA always, interleaved RoPE pairs over `head_dim`
dimensions, and LongCat's LoRA scales), two dense SwiGLUs of width `ffn_hidden_size` and one
MoE: `n_routed_experts` SwiGLU experts of width `expert_ffn_hidden_size` and `zero_expert_num`
zero-computation (identity) experts, `moe_topk` of them chosen by a softmax router with a
correction bias, the chosen scores times `routed_scaling_factor`. The hub checkpoints' own keys
(`mla_scale_q_lora`, `mla_scale_kv_lora`, `zero_expert_type`, `router_bias`) are checked
against what transformers computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .deepseek import (
    DeepseekRouting,
    ExpertScoring,
    MlaConfig,
    mla_rope_parameters,
    read_deepseek_rope,
)
from .types import Architecture, DecoderConfig, MoeConfig

MODEL_TYPE = "longcat_flash"
DEFAULT_HEAD_DIM = 64
"""`LongcatFlashConfig.head_dim` when the file has none: the dimension its RoPE rotates."""


def read_longcat_config(config: Mapping[str, Any]) -> DecoderConfig:
    """Reads a LongCat-Flash `config.json` (as a dict) into a `DecoderConfig` with its `mla`
    attention (`lora_scaled`) and its `moe.routing` rule (`zero_experts`); `num_layers` is
    LongCat's layer count, `intermediate_size` the dense FFNs' width.

    Raises:
      ValueError: Another `model_type`, a required key missing, or what transformers does not
        run: a hidden activation other than SiLU, attention biases, kv heads other than the
        query heads, a RoPE dimension (`head_dim`) other than `qk_rope_head_dim`, LoRA scales
        switched off, zero-computation experts other than the identity, or a router bias
        (transformers builds `classifier.bias` and never adds it; LongCat's own code adds it:
        refusing to guess).
    """
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"LongcatFlashForCausalLM needs model_type {MODEL_TYPE!r}; got "
            f"{config.get('model_type')!r}"
        )
    layers = config.get("num_layers")
    if layers is None and config.get("num_hidden_layers") is not None:
        layers = config["num_hidden_layers"] // 2  # transformers' setter
    required = (
        "vocab_size",
        "hidden_size",
        "num_attention_heads",
        "ffn_hidden_size",
        "expert_ffn_hidden_size",
        "n_routed_experts",
        "moe_topk",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
    )
    missing = [key for key in required if config.get(key) is None]
    if layers is None or missing:
        raise ValueError(
            f"config.json has no {missing + ['num_layers'] * (layers is None)}; they are "
            "required to build the decoder"
        )
    _check_unsupported(config)
    theta, scaling = read_deepseek_rope(config)
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads") not in (None, heads):
        raise ValueError(
            "MLA expands every head's key and value from the latent; num_key_value_heads "
            f"must equal num_attention_heads ({heads}); got {config['num_key_value_heads']}"
        )
    mla = MlaConfig(
        hidden_size=config["hidden_size"],
        num_heads=heads,
        q_lora_rank=config["q_lora_rank"],
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleaved=True,
        lora_scaled=True,
    )
    routing = DeepseekRouting(
        config["n_routed_experts"],
        config["moe_topk"],
        ExpertScoring.SOFTMAX,
        correction_bias=True,
        scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        zero_experts=config.get("zero_expert_num") or 0,
    )
    return DecoderConfig(
        architecture=Architecture.LONGCAT_FLASH,
        vocab_size=config["vocab_size"],
        hidden_size=mla.hidden_size,
        intermediate_size=config["ffn_hidden_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=mla.qk_head_dim,
        rms_norm_eps=float(config["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=False,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=None,
        max_position_embeddings=config["max_position_embeddings"],
        moe=MoeConfig(
            num_experts=routing.num_experts,
            top_k=routing.top_k,
            expert_intermediate_size=config["expert_ffn_hidden_size"],
            renormalize=False,
            routing=routing,
        ),
        mla=mla,
        initializer_range=float(config.get("initializer_range", 0.02)),
    )


def _check_unsupported(config: Mapping[str, Any]) -> None:
    """Raises for a LongCat-Flash option transformers computes otherwise than the file says."""
    checks = {
        "hidden_act": ("silu", "silu"),
        "attention_bias": (False, False),
        "mla_scale_q_lora": (True, True),
        "mla_scale_kv_lora": (True, True),
        "zero_expert_type": ("identity", "identity"),
        "router_bias": (False, False),
    }
    for key, (default, runs) in checks.items():
        if config.get(key, default) != runs:
            raise ValueError(
                f"LongcatFlashForCausalLM with {key}={config[key]!r} is not supported "
                f"(transformers runs {key}={runs!r}); use a checkpoint without it"
            )
    rope = config.get("qk_rope_head_dim")
    if config.get("head_dim", DEFAULT_HEAD_DIM) != rope:
        raise ValueError(
            "transformers' LongCat-Flash rotates head_dim dimensions of the rope part; "
            f"head_dim ({config.get('head_dim', DEFAULT_HEAD_DIM)}) must equal "
            f"qk_rope_head_dim ({rope})"
        )


def write_longcat_config(config: DecoderConfig) -> dict[str, Any]:
    """The Hugging Face `config.json` (as a dict) of a LongCat-Flash `config`, in transformers
    5's format; `read_longcat_config` reads it back."""
    mla, moe = config.mla, config.moe
    return {
        "architectures": [Architecture.LONGCAT_FLASH.value],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": mla_rope_parameters(mla),
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "ffn_hidden_size": config.intermediate_size,
        "expert_ffn_hidden_size": moe.expert_intermediate_size,
        "n_routed_experts": moe.num_experts,
        "zero_expert_num": moe.zero_experts,
        "moe_topk": moe.top_k,
        "routed_scaling_factor": moe.routing.scaling_factor,
        "initializer_range": config.initializer_range,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
    }
