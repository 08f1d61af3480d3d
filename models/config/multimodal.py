"""The language model of a Hugging Face image-text checkpoint (`...ForConditionalGeneration`,
as Qwen3.5 and Gemma 3 are released): its `text_config` read as the text family's config, its
tensors found under the checkpoint's own prefix, the vision tower's left unread. The model is
the checkpoint's language model as transformers runs it on a prompt without images; it saves
as the text family's checkpoint (`...ForCausalLM`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ImageTextLayout:
    """Where an image-text checkpoint keeps its language model.

    Attributes:
      text_architecture: The text family's architecture, which reads `text_config`.
      prefix: What stands for the text model's `model.` in its tensor names.
      lm_head: The LM head's tensor name.
    """

    text_architecture: str
    prefix: str
    lm_head: str

    def text_name(self, name: str) -> str | None:
        """The text checkpoint's name of tensor `name`; None for a tensor of the vision tower
        or the projector."""
        if name == self.lm_head:
            return "lm_head.weight"
        if name.startswith(self.prefix):
            return "model." + name.removeprefix(self.prefix)
        return None


LAYOUTS = {
    "Qwen3_5ForConditionalGeneration": ImageTextLayout(
        "Qwen3_5ForCausalLM", "model.language_model.", "lm_head.weight"
    ),
    "Qwen3_5MoeForConditionalGeneration": ImageTextLayout(
        "Qwen3_5MoeForCausalLM", "model.language_model.", "lm_head.weight"
    ),
    "Gemma3ForConditionalGeneration": ImageTextLayout(
        "Gemma3ForCausalLM", "language_model.model.", "language_model.lm_head.weight"
    ),
}
"""The image-text architectures whose language model loads, by architecture."""

INHERITED = ("tie_word_embeddings", "quantization_config", "bos_token_id", "eos_token_id")
"""Keys an image-text config states for the whole model, which its language model takes."""


def image_text_layout(hf_config: Mapping[str, Any]) -> ImageTextLayout | None:
    """The layout of an image-text `config.json` (as a dict); None for any other."""
    names = hf_config.get("architectures")
    if isinstance(names, list) and len(names) == 1 and names[0] in LAYOUTS:
        return LAYOUTS[names[0]]
    return None


def language_model_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text family's `config.json` of an image-text config: its `text_config` with the text
    architecture and the whole model's `INHERITED` keys; any other config as it is.

    Raises:
      ValueError: An image-text config without a `text_config` object.
    """
    layout = image_text_layout(hf_config)
    if layout is None:
        return hf_config
    text = hf_config.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(
            f"config.json of a {hf_config['architectures'][0]} needs a text_config object; got "
            f"{text!r:.60}"
        )
    inherited = {key: hf_config[key] for key in INHERITED if hf_config.get(key) is not None}
    return {**text, **inherited, "architectures": [layout.text_architecture]}
