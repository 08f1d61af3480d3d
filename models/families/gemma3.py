"""Gemma 3, text only (Hugging Face `Gemma3ForCausalLM`)."""

from __future__ import annotations

from ..config import Architecture
from .norm_designs import NormDesignCausalLM


class Gemma3ForCausalLM(NormDesignCausalLM):
    """Gemma 3 (text): sandwich norms (pre-norm read, a norm of each complete output before the
    update), `1 + w` RMSNorms, embeddings scaled by sqrt(hidden), GeGLU, per-head q/k norm,
    sliding-window layers with the local RoPE base, `query_pre_attn_scalar`."""

    architectures = (Architecture.GEMMA3,)
