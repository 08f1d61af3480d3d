"""The language model of a Hugging Face image-text checkpoint (`...ForConditionalGeneration`,
as Qwen3.5, Gemma 3, Mistral Small 3 and the Qwen VL models are released): its `text_config`
read as the text family's config, its tensors found under the checkpoint's prefix, the vision
tower's left unread. The model is the checkpoint's language model as transformers runs it on a
prompt without images (where every position of a multimodal RoPE, M-RoPE, is the token's own,
so it rotates as the text family's RoPE); it saves as the text family's checkpoint
(`...ForCausalLM`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

TEXT_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Mistral3ForConditionalGeneration": "MistralForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
}
"""The image-text architectures whose language model loads: the text family of each."""

PREFIXES = ("model.language_model.", "language_model.model.", "model.")
"""Where image-text checkpoints keep the text model's `model.` tensors: transformers 5's
module layout, the layout Gemma 3 and Mistral 3 were released in, and Qwen2.5-VL's."""
LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")
"""Where they keep an untied LM head."""
INHERITED = ("tie_word_embeddings", "quantization_config", "bos_token_id", "eos_token_id")
"""Keys an image-text config states for the whole model, which its language model takes."""


def is_image_text(hf_config: Mapping[str, Any]) -> bool:
    """Whether a `config.json` (as a dict) is an image-text model's whose language model
    loads."""
    names = hf_config.get("architectures")
    return isinstance(names, list) and len(names) == 1 and names[0] in TEXT_ARCHITECTURES


def language_model_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text family's `config.json` of an image-text config: its `text_config` (or, in the
    flat form of older Qwen2.5-VL files, its own keys but the vision tower's) with the text
    architecture and the whole model's `INHERITED` keys; any other config as it is."""
    if not is_image_text(hf_config):
        return hf_config
    text = hf_config.get("text_config")
    if not isinstance(text, Mapping):
        text = {k: v for k, v in hf_config.items() if k != "vision_config"}
    inherited = {key: hf_config[key] for key in INHERITED if hf_config.get(key) is not None}
    architecture = TEXT_ARCHITECTURES[hf_config["architectures"][0]]
    return {**text, **inherited, "architectures": [architecture]}


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
    if prefix == "model.":  # the vision tower sits beside the language model
        text = {
            t: n for t, n in text.items() if not t.startswith(("model.visual.", "model.vision"))
        }
    head = next((h for h in LM_HEADS if h in names), None)
    if head is not None:
        text["lm_head.weight"] = head
    return text
