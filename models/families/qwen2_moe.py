"""Qwen2-MoE (Hugging Face `Qwen2MoeForCausalLM`)."""

from __future__ import annotations

from ..config import Architecture
from ..decoder.moe import MoeCausalLM


class Qwen2MoeForCausalLM(MoeCausalLM):
    """Qwen2-MoE: q/k/v biases, top-k weights as the softmax gave them (renormalized only where
    `norm_topk_prob`), and a shared expert scaled by `sigmoid(x @ shared_expert_gate)` that every
    token goes through, summed with the routed experts' output."""

    architectures = (Architecture.QWEN2_MOE,)
