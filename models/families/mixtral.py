"""Mixtral (Hugging Face `MixtralForCausalLM`)."""

from __future__ import annotations

from ..config import Architecture
from ..decoder.moe import MoeCausalLM


class MixtralForCausalLM(MoeCausalLM):
    """Mixtral: every layer sparse, top-k renormalized, sliding-window attention where set."""

    architectures = (Architecture.MIXTRAL,)
