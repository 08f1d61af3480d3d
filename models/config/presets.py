"""Named decoder configurations for demos and tests; none needs a checkpoint."""

from __future__ import annotations

import dataclasses

from .hf_hybrid import NO_ROPE_THETA
from .hybrid import HybridConfig, HybridMoeConfig, Mamba2Spec, parse_pattern
from .types import Architecture, DecoderConfig, Llama3RopeScaling, MoeConfig

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
