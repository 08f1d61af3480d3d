"""Qwen3-MoE (Hugging Face `Qwen3MoeForCausalLM`)."""

from __future__ import annotations

from ..config import Architecture
from ..decoder.moe import MoeCausalLM


class Qwen3MoeForCausalLM(MoeCausalLM):
    """Qwen3-MoE: q/k RMSNorm per head, sparse layers by `mlp_only_layers` and
    `decoder_sparse_step`, top-k weights renormalized where `norm_topk_prob`."""

    architectures = (Architecture.QWEN3_MOE,)
