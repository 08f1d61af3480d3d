"""Qwen3.5 text (Hugging Face `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`): Qwen3-Next's layers
(`models.families.qwen3_next`) with the Gated DeltaNet's input projections held apart
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`); dense MLPs on every layer, or an MoE on
every layer whose router always renormalizes its top k. Text positions only: the multimodal
RoPE sections (`mrope_section`) rotate alike when every axis holds the token's position."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from ..config import DecoderConfig, DeltaProjections, LinearAttentionLayers
from ..config.registry import add_presets, register
from .qwen3_next import TINY as QWEN3_NEXT_TINY
from .qwen3_next import Qwen3NextBase, read_qwen3_next, write_qwen3_next

UNREAD_PREFIXES = ("mtp.", "model.visual.")
"""Checkpoint tensors a Qwen3.5 causal LM never reads: its multi-token-prediction layers and a
multimodal checkpoint's vision tower."""


class Qwen3_5Base(Qwen3NextBase):
    """What the two Qwen3.5 text families share: separate Gated DeltaNet projections and the
    tensors they leave unread."""

    projections = DeltaProjections.SEPARATE

    @classmethod
    def unread_tensors(
        cls, config: DecoderConfig, names: Iterable[str]
    ) -> tuple[tuple[str, ...], str | None]:
        """The multi-token-prediction and vision tensors, with a notice when there are any."""
        del config
        unread = tuple(name for name in names if name.startswith(UNREAD_PREFIXES))
        notice = (
            f"{len(unread)} multi-token-prediction / vision tensors not read" if unread else None
        )
        return unread, notice


@register
class Qwen3_5ForCausalLM(Qwen3_5Base):
    """Qwen3.5 (dense): Gated DeltaNet and gated attention, a dense gated MLP on every layer."""

    architectures = ("Qwen3_5ForCausalLM",)
    image_text_architectures = ("Qwen3_5ForConditionalGeneration",)
    model_type = "qwen3_5_text"
    # transformers' Qwen3_5TextConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": False,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 32768,
        "num_attention_heads": 16,
        "num_hidden_layers": 32,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    }
    has_experts = False

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        dense = dict(hf_config) | {"num_experts": 0}
        return read_qwen3_next(dense, cls.architectures[0], cls.projections)

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        out = write_qwen3_next(config, cls.model_type)
        del out["num_experts"]
        return out


@register
class Qwen3_5MoeForCausalLM(Qwen3_5Base):
    """Qwen3.5-MoE: Gated DeltaNet and gated attention, an MoE with a sigmoid-gated shared expert
    on every layer, its top-k weights always renormalized."""

    architectures = ("Qwen3_5MoeForCausalLM",)
    image_text_architectures = ("Qwen3_5MoeForConditionalGeneration",)
    model_type = "qwen3_5_moe_text"
    # transformers' Qwen3_5MoeTextConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": False,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 32768,
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    }

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        # No dense layers: its config.json has no MLP width; the expert width stands in for it.
        moe = dict(hf_config) | {"norm_topk_prob": True, "mlp_only_layers": []}
        moe.setdefault("intermediate_size", hf_config.get("moe_intermediate_size"))
        moe["decoder_sparse_step"] = 1
        return read_qwen3_next(moe, cls.architectures[0], cls.projections)

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        out = write_qwen3_next(config, cls.model_type)
        for key in (
            "intermediate_size",
            "norm_topk_prob",
            "mlp_only_layers",
            "decoder_sparse_step",
        ):
            out.pop(key, None)
        return out


# Qwen3.5 and Qwen3.5-MoE: Qwen3-Next's small stack with Gated DeltaNet's separate projections
# on layers 0 and 3, gated attention on 1 and 2; the MoE one with experts on every layer.
TINY = dataclasses.replace(
    QWEN3_NEXT_TINY,
    architecture="Qwen3_5ForCausalLM",
    num_layers=4,
    moe=None,
    linear_attention=LinearAttentionLayers(
        dataclasses.replace(
            QWEN3_NEXT_TINY.linear_attention.spec, projections=DeltaProjections.SEPARATE
        ),
        (True, False, False, True),
    ),
)
TINY_MOE = dataclasses.replace(
    TINY,
    architecture="Qwen3_5MoeForCausalLM",
    intermediate_size=32,
    moe=dataclasses.replace(QWEN3_NEXT_TINY.moe, mlp_only_layers=()),
)
add_presets({"tiny-qwen3-5": TINY, "tiny-qwen3-5-moe": TINY_MOE})
