"""Llama and Mistral (Hugging Face `LlamaForCausalLM`, `MistralForCausalLM`)."""

from __future__ import annotations

from ..config import Architecture
from ..decoder.model import CausalLM


class LlamaForCausalLM(CausalLM):
    """Llama (with llama3 RoPE scaling) and Mistral-style configs."""

    architectures = (Architecture.LLAMA, Architecture.MISTRAL)
