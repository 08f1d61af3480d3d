"""OLMo 2 (Hugging Face `Olmo2ForCausalLM`)."""

from __future__ import annotations

from ..config import Architecture
from .norm_designs import NormDesignCausalLM


class Olmo2ForCausalLM(NormDesignCausalLM):
    """OLMo 2: post-norm, q/k RMSNorm over the whole projection (its sum of squares completes
    over attention TP inside attention)."""

    architectures = (Architecture.OLMO2,)
