"""Named decoder configurations for demos and tests; none needs a checkpoint."""

from __future__ import annotations

import dataclasses

from .deepseek import DeepseekRouting, ExpertScoring, GroupScore, MlaConfig
from .hf_hybrid import NO_ROPE_THETA
from .hybrid import HybridConfig, HybridMoeConfig, Mamba2Spec, parse_pattern
from .rope_scaling import Llama3RopeScaling, YarnRopeScaling
from .types import Architecture, DecoderConfig, MoeConfig

PRESETS: dict[str, DecoderConfig] = {
    "tiny-qwen3": DecoderConfig(
        architecture=Architecture.QWEN3,
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
        tie_word_embeddings=True,
        sliding_window=None,
        max_position_embeddings=128,
    ),
    "tiny-mistral": DecoderConfig(
        architecture=Architecture.MISTRAL,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        rope_scaling=None,
        qk_norm=False,
        tie_word_embeddings=False,
        sliding_window=16,
        max_position_embeddings=128,
    ),
    # About 0.9M parameters (3.5 MB in float32).
    "small-llama": DecoderConfig(
        architecture=Architecture.LLAMA,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
        rope_scaling=Llama3RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
        qk_norm=False,
        tie_word_embeddings=False,
        sliding_window=None,
        max_position_embeddings=2048,
    ),
}
"""Named configurations for demos and tests; none needs a checkpoint. Every vocabulary holds at
least the 256 byte values, so any preset trains on byte-level text."""
# Qwen3-MoE with a dense layer among three sparse ones (8 experts, top-2 of them).
PRESETS["tiny-qwen3-moe"] = dataclasses.replace(
    PRESETS["tiny-qwen3"],
    architecture=Architecture.QWEN3_MOE,
    tie_word_embeddings=False,
    moe=MoeConfig(
        num_experts=8,
        top_k=2,
        expert_intermediate_size=32,
        renormalize=True,
        mlp_only_layers=(1,),
    ),
)
# Nemotron-H: a Mamba2 mixer, attention (no RoPE), a relu^2 MLP and a MoE of 8 relu^2 experts (top
# 2 of the best 2 of 4 groups, sigmoid router with a score-correction bias, a shared expert): one
# stage per layer, so the mixer's exit faces a mixer, then an FFN, and an FFN an FFN.
PRESETS["tiny-nemotron-h"] = DecoderConfig(
    architecture=Architecture.NEMOTRON_H,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=NO_ROPE_THETA,
    rope_scaling=None,
    qk_norm=False,
    tie_word_embeddings=False,
    sliding_window=None,
    max_position_embeddings=128,
    nope_full_layers=True,
    hybrid=HybridConfig(
        parse_pattern("M*-E"),
        Mamba2Spec(
            hidden_size=64, num_heads=8, head_dim=8, n_groups=2, state_size=16, chunk_size=16
        ),
        HybridMoeConfig(
            num_experts=8,
            top_k=2,
            expert_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_groups=4,
            topk_groups=2,
            scaling_factor=2.5,
        ),
    ),
)
# DeepSeek-V3-style: latent attention with q LoRA and YaRN, one dense layer then three sparse
# ones (8 experts in 4 groups of which 2 are kept, top-2 by sigmoid scores and a correction bias,
# one shared expert).
_TINY_MLA = MlaConfig(
    hidden_size=64,
    num_heads=8,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_theta=1e4,
    rope_scaling=YarnRopeScaling(
        factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0
    ),
)
_TINY_ROUTING = DeepseekRouting(
    num_experts=8,
    top_k=2,
    scoring=ExpertScoring.SIGMOID,
    num_groups=4,
    topk_groups=2,
    group_score=GroupScore.TOP2_SUM,
    correction_bias=True,
    renormalize=True,
    scaling_factor=2.5,
)
PRESETS["tiny-deepseek-v3"] = DecoderConfig(
    architecture=Architecture.DEEPSEEK_V3,
    vocab_size=256,
    hidden_size=_TINY_MLA.hidden_size,
    intermediate_size=128,
    num_layers=4,
    num_heads=_TINY_MLA.num_heads,
    num_kv_heads=_TINY_MLA.num_heads,
    head_dim=_TINY_MLA.qk_head_dim,
    rms_norm_eps=1e-6,
    rope_theta=_TINY_MLA.rope_theta,
    rope_scaling=_TINY_MLA.rope_scaling,
    qk_norm=False,
    tie_word_embeddings=False,
    sliding_window=None,
    max_position_embeddings=128,
    moe=MoeConfig(
        num_experts=_TINY_ROUTING.num_experts,
        top_k=_TINY_ROUTING.top_k,
        expert_intermediate_size=32,
        renormalize=_TINY_ROUTING.renormalize,
        shared_expert_intermediate_size=32,
        mlp_only_layers=(0,),
        routing=_TINY_ROUTING,
    ),
    mla=_TINY_MLA,
)
# LongCat-Flash-style: two layers, each two latent attentions with LongCat's LoRA scales, two dense
# FFNs and a MoE of 8 routed and 4 zero-computation experts (top-3, softmax with a correction
# bias, scaled by 6).
_TINY_LONGCAT_MLA = dataclasses.replace(
    _TINY_MLA, q_lora_rank=32, rope_scaling=None, lora_scaled=True
)
_TINY_LONGCAT_ROUTING = DeepseekRouting(
    num_experts=8,
    top_k=3,
    scoring=ExpertScoring.SOFTMAX,
    correction_bias=True,
    scaling_factor=6.0,
    zero_experts=4,
)
PRESETS["tiny-longcat-flash"] = dataclasses.replace(
    PRESETS["tiny-deepseek-v3"],
    architecture=Architecture.LONGCAT_FLASH,
    num_layers=2,
    rope_scaling=None,
    moe=MoeConfig(
        num_experts=_TINY_LONGCAT_ROUTING.num_experts,
        top_k=_TINY_LONGCAT_ROUTING.top_k,
        expert_intermediate_size=32,
        renormalize=False,
        routing=_TINY_LONGCAT_ROUTING,
    ),
    mla=_TINY_LONGCAT_MLA,
)
# Widths of whole 128 x 128 blocks at up to 4 ranks per split, for FP8 weights (`--quantize fp8`).
PRESETS["tiny-qwen3-fp8"] = dataclasses.replace(
    PRESETS["tiny-qwen3"],
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=128,
)
PRESETS["tiny-qwen3-moe-fp8"] = dataclasses.replace(
    PRESETS["tiny-qwen3-fp8"],
    architecture=Architecture.QWEN3_MOE,
    tie_word_embeddings=False,
    moe=MoeConfig(
        num_experts=8,
        top_k=2,
        expert_intermediate_size=512,
        renormalize=True,
        mlp_only_layers=(1,),
    ),
)
