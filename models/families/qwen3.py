"""Qwen3 (Hugging Face `Qwen3ForCausalLM`)."""

from __future__ import annotations

from ..config import Architecture
from ..decoder.model import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """Qwen3: q/k RMSNorm per head before RoPE, usually tied embeddings."""

    architectures = (Architecture.QWEN3,)
