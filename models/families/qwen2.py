"""Qwen2 and Qwen2.5 (Hugging Face `Qwen2ForCausalLM`)."""

from __future__ import annotations

from ..config import Architecture
from ..decoder.model import CausalLM


class Qwen2ForCausalLM(CausalLM):
    """Qwen2 / Qwen2.5: q/k/v projections with biases (split with their heads), no q/k norm."""

    architectures = (Architecture.QWEN2,)
