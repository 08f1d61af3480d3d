"""Named decoder configurations for demos and tests; none needs a checkpoint."""

from __future__ import annotations

import dataclasses

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
