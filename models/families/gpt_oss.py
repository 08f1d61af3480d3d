"""GPT-OSS (Hugging Face `GptOssForCausalLM`): grouped-query attention with a learned sink logit
per head and q/k/v/o biases, alternating sliding-window and full layers (`layer_types`), YaRN
RoPE, and a MoE on every layer whose router has a bias (top-k of the logits, softmax over the k)
and whose experts have biases and compute the clamped SwiGLU.

Its checkpoints store each layer's experts fused: `mlp.experts.gate_up_proj` [experts, hidden,
2 x width] with gate and up interleaved (gate the even columns), `gate_up_proj_bias` [experts,
2 x width], `down_proj` [experts, width, hidden], `down_proj_bias` [experts, hidden], and the
router `mlp.router.weight` [experts, hidden], `mlp.router.bias`; the released checkpoints hold
the two projections in MXFP4 (`models.weights.mxfp4`), which load dequantized.

What it refuses: FP8 quantization (its experts' biases and clamp are not in the FP8 experts) and
attention CP (as every MoE family). As in transformers, `hidden_act` is not read: the experts
compute the clamped SwiGLU whatever it names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from ..config import AttentionKind, DecoderConfig, MoeConfig, YarnRopeScaling
from ..config.hf import (
    layer_windows,
    plain_decoder,
    plain_decoder_json,
    plain_moe,
    required,
)
from ..config.registry import add_presets, register
from ..config.rope_scaling import read_rope
from ..config.tensors import (
    NORM_TENSORS,
    HFTensor,
    attention_tensors,
    decoder_tensor_names,
)
from ..decoder.moe import MoeCausalLM
from ..layers.clamped_swiglu import ClampedSwiGlu
from ..layers.moe.ffn import MoeFfn

SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702  # transformers' GptOssConfig defaults


def _alternating(layers: int) -> list[bool]:
    """transformers' default `layer_types`: sliding on even layers, full on odd ones."""
    return [bool((i + 1) % 2) for i in range(layers)]


@register
class GptOssForCausalLM(MoeCausalLM):
    """GPT-OSS: attention sinks, biased projections, alternating windows, YaRN; a biased router
    and biased clamped-SwiGLU experts on every layer."""

    architectures = ("GptOssForCausalLM",)
    model_type = "gpt_oss"
    # transformers' attribute_map: two names config.json may give one key.
    config_aliases = {
        "num_experts": "num_local_experts",
    }
    # transformers' GptOssConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": True,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "max_position_embeddings": 131072,
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "num_local_experts": 128,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "rope_theta": 150000.0,
        "sliding_window": 128,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "vocab_size": 201088,
    }
    lora = True
    quantizable = False  # the FP8 experts carry no biases and no clamp

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        architecture = cls.architectures[0]
        layers = required(hf_config, "num_hidden_layers")
        window, kinds = layer_windows(hf_config, layers, _alternating(layers))
        bias = bool(hf_config.get("attention_bias", True))
        moe = plain_moe(
            hf_config,
            architecture,
            expert_width="intermediate_size",
            renormalize=True,
            mlp_only_layers=(),
            decoder_sparse_step=1,
            router_bias=True,
            expert_bias=True,
            swiglu_limit=float(hf_config.get("swiglu_limit", SWIGLU_LIMIT)),
            swiglu_alpha=float(hf_config.get("swiglu_alpha", SWIGLU_ALPHA)),
        )
        return plain_decoder(
            hf_config,
            architecture,
            rope=read_rope(hf_config),
            qkv_bias=bias,
            o_bias=bias,
            attention_sinks=True,
            sliding_window=window,
            layer_types=kinds,
            moe=moe,
        )

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        moe = config.moe
        written = plain_decoder_json(config, cls.model_type)
        del written["use_sliding_window"]  # not a GPT-OSS key
        return written | {
            "attention_bias": config.qkv_bias,
            "sliding_window": config.sliding_window,
            "layer_types": [config.layer_kind(i).value for i in range(config.num_layers)],
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "swiglu_limit": moe.swiglu_limit,
            "swiglu_alpha": moe.swiglu_alpha,
        }

    @classmethod
    def check_config(cls, config: DecoderConfig) -> None:
        """GPT-OSS's attention has sinks and biases on all four projections or none; its MoE a
        biased router with renormalized weights and biased clamped-SwiGLU experts.

        Raises:
          ValueError: Another attention or MoE.
        """
        super().check_config(config)
        moe = config.moe
        if (
            not config.attention_sinks
            or config.qkv_bias != config.o_bias
            or not (moe.router_bias and moe.expert_bias and moe.renormalize)
            or moe.swiglu_limit is None
            or moe.shared_expert_intermediate_size is not None
            or moe.routing is not None
            or not all(config.sparse_layers)
        ):
            raise ValueError(
                "a GptOssForCausalLM config has attention sinks, q/k/v/o biases alike, and on "
                "every layer a biased router (renormalized top-k) with biased clamped-SwiGLU "
                f"experts and no shared expert; got {config}"
            )

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        attention = NORM_TENSORS[config.residual_design] | attention_tensors(config)
        attention |= {"attn.sinks": HFTensor("self_attn.sinks")}
        experts = "mlp.experts."
        gate_up = {"parts": ("gate", "up"), "interleaved": True}
        sparse = {
            "mlp.router": HFTensor("mlp.router.weight", transpose=True),
            "mlp.router_bias": HFTensor("mlp.router.bias"),
            "mlp.gate_up_proj": HFTensor(experts + "gate_up_proj", part_axis=2, **gate_up),
            "mlp.gate_up_proj_bias": HFTensor(
                experts + "gate_up_proj_bias", part_axis=1, **gate_up
            ),
            "mlp.down_proj": HFTensor(experts + "down_proj"),
            "mlp.down_proj_bias": HFTensor(experts + "down_proj_bias"),
        }
        return decoder_tensor_names(config, scan_layers=scan_layers, dense=attention, sparse=sparse)

    def make_mlp(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Layer `index`'s sparse FFN, its experts computing the clamped SwiGLU."""
        del index
        config = self.config
        moe = config.moe
        return MoeFfn(
            config.hidden_size,
            moe,
            self.topology,
            dispatch=self.moe_dispatch,
            capacity=self.options.moe_capacity,
            impl=self.grouped_matmul,
            activation=ClampedSwiGlu(moe.swiglu_limit, moe.swiglu_alpha),
            dtype=dtype,
            init_std=config.initializer_range,
            rngs=rngs,
        )


_SLIDING, _FULL = AttentionKind.SLIDING, AttentionKind.FULL
add_presets(
    {
        # Alternating windows shorter than the demo's longest prompt, YaRN RoPE, 8 experts
        # (top-2) with a clamp reached by random weights of std 0.02 only rarely.
        "tiny-gpt-oss": DecoderConfig(
            architecture="GptOssForCausalLM",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=32,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_theta=150000.0,
            rope_scaling=YarnRopeScaling(
                factor=4.0, original_max_position_embeddings=64, truncate=False
            ),
            qk_norm=False,
            tie_word_embeddings=False,
            sliding_window=8,
            max_position_embeddings=256,
            qkv_bias=True,
            o_bias=True,
            attention_sinks=True,
            layer_types=(_SLIDING, _FULL, _SLIDING, _FULL),
            moe=MoeConfig(
                num_experts=8,
                top_k=2,
                expert_intermediate_size=32,
                renormalize=True,
                router_bias=True,
                expert_bias=True,
                swiglu_limit=SWIGLU_LIMIT,
            ),
        )
    }
)
