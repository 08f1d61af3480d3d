"""EXAONE 4.0 (Hugging Face `Exaone4ForCausalLM`)."""

from __future__ import annotations

from ..config import Architecture
from .norm_designs import NormDesignCausalLM


class Exaone4ForCausalLM(NormDesignCausalLM):
    """EXAONE 4.0: post-norm, per-head q/k RMSNorm, sliding-window and global layers
    (`layer_types`); with a window, the global layers apply no RoPE."""

    architectures = (Architecture.EXAONE4,)
