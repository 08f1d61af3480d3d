"""The language model of a Hugging Face image-text checkpoint (`...ForConditionalGeneration`,
as several families' models are released): its `text_config` read as its text family's config
(the family names the image-text architectures it is the language model of,
`image_text_architectures`), its tensors found under the checkpoint's prefix, the vision
tower's left unread. The model is the checkpoint's language model as transformers runs it on a
prompt without images (where every position of a multimodal RoPE, M-RoPE, is the token's own,
so it rotates as the text family's RoPE); it saves as the text family's checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

ANY_TEXT_MODEL = (
    "LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration",
)
"""Image-text architectures whose language model may be any family's: the one whose
`model_type` its `text_config` names (where it names none, transformers' default: the family
naming the architecture in its `image_text_architectures`)."""
TIES_FROM_TEXT = ("LlavaForConditionalGeneration", "LlavaOnevisionForConditionalGeneration")
"""Image-text architectures (besides a family's `text_tie_architectures`) whose config ties the
LM head where its `text_config` says so and its own `tie_word_embeddings` is false
(transformers' reading of files saved before v5)."""
PREFIXES = ("model.language_model.", "language_model.model.", "model.")
"""Where image-text checkpoints keep the text model's `model.` tensors: transformers 5's module
layout, the layout some were released in, and (beside a `visual.` tower) the oldest."""
LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")
"""Where they keep an untied LM head."""
INHERITED = ("tie_word_embeddings", "quantization_config", "bos_token_id", "eos_token_id")
"""Keys an image-text config states for the whole model, which its language model takes."""


def language_model_config(
    hf_config: Mapping[str, Any], text_architecture: str | None, *, ties_from_text: bool = False
) -> Mapping[str, Any]:
    """The text family's `config.json` of an image-text config whose language model is
    `text_architecture`'s: its `text_config` (or, in the flat form of older files, its own keys
    but the vision tower's) with that architecture and the whole model's `INHERITED` keys (its
    `tie_word_embeddings` true where `ties_from_text` and the `text_config` ties). None:
    `hf_config` as it is."""
    if text_architecture is None:
        return hf_config
    text = hf_config.get("text_config")
    if not isinstance(text, Mapping):
        text = {k: v for k, v in hf_config.items() if k != "vision_config"}
    inherited = {key: hf_config[key] for key in INHERITED if hf_config.get(key) is not None}
    if ties_from_text and text.get("tie_word_embeddings"):
        inherited["tie_word_embeddings"] = True
    return {**text, **inherited, "architectures": [text_architecture]}


def language_model_tensors(names: Iterable[str]) -> dict[str, str]:
    """`{text checkpoint name: stored name}` of an image-text checkpoint's language model: its
    tensors under the first of `PREFIXES` that holds the token embedding, and its LM head; the
    vision tower's and the projector's left out.

    Raises:
      ValueError: No prefix holds an `embed_tokens.weight`.
    """
    names = set(names)
    prefix = next((p for p in PREFIXES if p + "embed_tokens.weight" in names), None)
    if prefix is None:
        raise ValueError(
            f"an image-text checkpoint keeps its language model under one of {PREFIXES}; this "
            "one holds no embed_tokens.weight under any"
        )
    text = {"model." + n.removeprefix(prefix): n for n in names if n.startswith(prefix)}
    if prefix == "model.":  # the vision tower may sit beside the language model
        text = {
            t: n for t, n in text.items() if not t.startswith(("model.visual.", "model.vision"))
        }
    head = next((h for h in LM_HEADS if h in names), None)
    if head is not None:
        text["lm_head.weight"] = head
    return text
