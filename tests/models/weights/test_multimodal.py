"""The language model of an image-text checkpoint (Qwen3.5's and Gemma 3's
`...ForConditionalGeneration`, as released): its `text_config` read as the text family's, its
tensors under the checkpoint's prefix, the vision tower's left unread, and saved as the text
family's checkpoint. Each checkpoint here is a text golden repackaged in the image-text layout
transformers writes (random tiny image-text models matched transformers' logits on text
prompts the same way, closing note of 2026-12-05): its logits must be the golden's."""

import json
import pathlib

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import boundary_jax as bj
from models.build import load_model
from models.config import read_hf_config
from models.config.registry import as_text_model, family_for
from models.families.gemma3 import Gemma3ForCausalLM
from models.serving.runtime import ShardedCausalLM
from models.training.trainer import FlatParams
from models.weights import load_config, save_checkpoint
from tests.models.families.test_decoder import golden

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
VISION = {
    "model.visual.patch_embed.proj.weight",
    "vision_tower.embeddings.patch.weight",
    "visual.blocks.0.attn.qkv.weight",
}
# Each golden's image-text architecture, with the layout its released checkpoints have (the
# older Qwen2.5-VL files: a flat config, the language model's tensors under `model.`).
IMAGE_TEXT = {
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "model.language_model.", "lm_head.weight"),
    "gemma3": (
        "Gemma3ForConditionalGeneration",
        "language_model.model.",
        "language_model.lm_head.weight",
    ),
    "qwen2": ("Qwen2_5_VLForConditionalGeneration", "model.", "lm_head.weight"),
    "ministral3": ("Mistral3ForConditionalGeneration", "model.language_model.", "lm_head.weight"),
    "llama": (
        "LlavaForConditionalGeneration",
        "language_model.model.",
        "language_model.lm_head.weight",
    ),
}


def image_text_checkpoint(name: str, directory: pathlib.Path) -> pathlib.Path:
    """The text golden `name` as an image-text checkpoint: its config as `text_config`, its
    tensors under the layout's prefix, and a vision tensor the loader must leave unread."""
    architecture, prefix, head = IMAGE_TEXT[name]
    text = json.loads((GOLDEN / name / "config.json").read_text())
    tied = text.pop("tie_word_embeddings", False)
    if architecture.startswith("Llava"):  # a sparse text_config, as LLaVA's released ones
        defaults = family_for(text).config_defaults
        text = {k: v for k, v in text.items() if defaults.get(k, object()) != v}
    config = {
        "architectures": [architecture],
        "model_type": "image_text",
        "text_config": {k: v for k, v in text.items() if k != "architectures"},
        "vision_config": {"hidden_size": 8},
        "tie_word_embeddings": tied,
    }
    if prefix == "model.":
        config = {**config.pop("text_config"), **config}
    tensors = {}
    stored_files = sorted((GOLDEN / name).glob("model*.safetensors"))  # llama's is sharded
    for tensor, value in {k: v for f in stored_files for k, v in load_file(f).items()}.items():
        stored = head if tensor == "lm_head.weight" else prefix + tensor.removeprefix("model.")
        tensors[stored] = value
    tensors.update({vision: np.ones((2, 2), np.float32) for vision in VISION})
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "model.safetensors")
    return directory


@pytest.mark.parametrize(
    "name,dp,tp",
    [("qwen3_5", 1, 2), ("gemma3", 2, 2), ("qwen2", 1, 2), ("llama", 2, 2), ("ministral3", 1, 2)],
)
def test_language_model_of_an_image_text_checkpoint_is_the_golden(tmp_path, name, dp, tp):
    """The image-text checkpoint (nested or flat config; LLaVA's text_config naming the family
    by model_type and leaving transformers' defaults out) reads as its text family's config and
    loads the golden's weights (the vision tensors left unread): transformers' logits of the
    text golden."""
    checkpoint = image_text_checkpoint(name, tmp_path / name)
    assert load_config(checkpoint) == load_config(GOLDEN / name)
    prompts, reference = golden(name)
    mesh = bj.make_mesh(bj.Topology(attn_dp=dp, attn_tp=tp))
    logits = ShardedCausalLM(load_model(checkpoint, mesh), mesh).forward(prompts)
    want = reference["logits"]
    assert np.max(np.abs(logits - want)) <= 1e-4 * np.max(np.abs(want))


def test_a_trained_image_text_language_model_saves_as_its_text_family(tmp_path):
    """Saved with its source's config.json kept (as `train` keeps it), the language model
    writes the text family's config and tensor names, which load back as the golden."""
    checkpoint = image_text_checkpoint("qwen3_5", tmp_path / "source")
    source = json.loads((checkpoint / "config.json").read_text())
    assert as_text_model(source)["architectures"] == ["Qwen3_5ForCausalLM"]
    model = load_model(checkpoint, bj.make_mesh(bj.Topology()))
    state = nnx.state(model)
    out = tmp_path / "saved"
    save_checkpoint(model.config, FlatParams(state).flatten(state), out, hf_config=source)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Qwen3_5ForCausalLM"] and "text_config" not in written
    assert set(load_file(out / "model.safetensors")) == set(
        load_file(GOLDEN / "qwen3_5" / "model.safetensors")
    )
    assert read_hf_config(written) == load_config(GOLDEN / "qwen3_5")


def test_an_image_text_checkpoint_without_a_language_model_is_refused(tmp_path):
    checkpoint = image_text_checkpoint("qwen3_5", tmp_path / "qwen3_5")
    vision = {name: np.ones((2, 2), np.float32) for name in VISION}
    save_file(vision, checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match="holds no embed_tokens.weight"):
        load_model(checkpoint, bj.make_mesh(bj.Topology()))


def test_a_quantization_of_the_text_model_alone_is_refused(tmp_path):
    """transformers quantizes by a `quantization_config` inside `text_config` too; one there
    that the top level does not carry is refused, never read as float weights."""
    checkpoint = image_text_checkpoint("qwen3_5", tmp_path / "qwen3_5")
    config = json.loads((checkpoint / "config.json").read_text())
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    config["text_config"]["quantization_config"] = gptq
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="text_config has its own quantization_config"):
        load_model(checkpoint, bj.make_mesh(bj.Topology()))


def test_a_sparse_gemma3_text_config_takes_transformers_defaults():
    """Gemma 3's released image-text configs name only what differs from transformers'
    `Gemma3TextConfig` (a random tiny one so written matched transformers, closing note of
    2026-12-05): the golden's config without the keys equal to those defaults reads as the
    whole one, and without `layer_types` its layers follow the default pattern (every sixth
    full, here none of three)."""
    full = json.loads((GOLDEN / "gemma3" / "config.json").read_text())
    sparse = {
        k: v for k, v in full.items() if Gemma3ForCausalLM.config_defaults.get(k, object()) != v
    }
    assert {
        "num_attention_heads",
        "rms_norm_eps",
        "hidden_activation",
    } <= full.keys() - sparse.keys()
    assert read_hf_config(sparse) == read_hf_config(full)
    patterned = read_hf_config({k: v for k, v in sparse.items() if k != "layer_types"})
    assert {patterned.layer_attention(i).sliding_window for i in range(3)} == {4}


def nested(name: str, architecture: str, drop: tuple[str, ...] = (), **top) -> dict:
    """The text golden `name`'s config as `architecture`'s `text_config`, without `drop`."""
    text = json.loads((GOLDEN / name / "config.json").read_text())
    text = {k: v for k, v in text.items() if k not in {"architectures", *drop}}
    return {"architectures": [architecture], "text_config": text, **top}


def test_a_sparse_vl_text_config_takes_its_own_class_defaults():
    """Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's text config classes have defaults of their own
    (a helper's tiny checkpoints without these keys were 0.9-1.0 off transformers)."""
    drop = ("rope_parameters", "rms_norm_eps", "max_position_embeddings")
    for architecture in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"):
        config = read_hf_config(nested("qwen2", architecture, drop))
        assert (config.rope_theta, config.rms_norm_eps) == (1e6, 1e-5)
        assert config.max_position_embeddings == 32768
    config = read_hf_config(nested("qwen3", "Qwen3VLForConditionalGeneration", drop))
    assert (config.rope_theta, config.rms_norm_eps) == (5e5, 1e-6)
    assert config.max_position_embeddings == 128000
    assert read_hf_config(nested("qwen2", "Qwen2ForCausalLM", drop)["text_config"] | {
        "architectures": ["Qwen2ForCausalLM"]
    }).rope_theta == 1e4  # fmt: skip


def test_the_head_ties_where_transformers_ties_it():
    """LLaVA, LLaVA-OneVision, Qwen2-VL and Qwen2.5-VL tie where their text_config says so and
    the top level says false (files saved before transformers 5); Qwen3-VL and LLaVA-NeXT
    follow the top level; a top-level true ties everywhere."""
    for architecture, name, ties in (
        ("LlavaForConditionalGeneration", "llama", True),
        ("LlavaOnevisionForConditionalGeneration", "qwen2", True),
        ("Qwen2VLForConditionalGeneration", "qwen2", True),
        ("Qwen2_5_VLForConditionalGeneration", "qwen2", True),
        ("Qwen3VLForConditionalGeneration", "qwen3", False),
        ("LlavaNextForConditionalGeneration", "llama", False),
    ):
        config = nested(name, architecture, tie_word_embeddings=False)
        config["text_config"]["tie_word_embeddings"] = True
        assert read_hf_config(config).tie_word_embeddings is ties, architecture
        config["text_config"]["tie_word_embeddings"] = False
        assert not read_hf_config(config).tie_word_embeddings
        assert read_hf_config(config | {"tie_word_embeddings": True}).tie_word_embeddings


def test_a_wrapper_of_any_text_model_reads_the_text_model_it_names():
    """LLaVA's, LLaVA-NeXT's, LLaVA-OneVision's and Mistral 3's language model is the family
    its text_config's model_type names (transformers' default where it names none; Mistral 3
    over `ministral3` is Ministral 3, not Mistral); one that no family builds is refused,
    naming it."""
    for architecture, name, family in (
        ("LlavaForConditionalGeneration", "llama", "LlamaForCausalLM"),
        ("LlavaNextForConditionalGeneration", "llama", "LlamaForCausalLM"),
        ("LlavaOnevisionForConditionalGeneration", "qwen2", "Qwen2ForCausalLM"),
        ("Mistral3ForConditionalGeneration", "mistral", "MistralForCausalLM"),
        ("Mistral3ForConditionalGeneration", "llama", "LlamaForCausalLM"),
        ("Mistral3ForConditionalGeneration", "ministral3", "Ministral3ForCausalLM"),
    ):
        config = nested(name, architecture)
        assert as_text_model(config)["architectures"] == [family]
        del config["text_config"]["model_type"]
        if name not in ("llama", "ministral3") or not architecture.startswith("Mistral3"):
            assert read_hf_config(config) == load_config(GOLDEN / name)
    config = nested("llama", "LlavaForConditionalGeneration")
    config["text_config"]["model_type"] = "gpt2"
    with pytest.raises(ValueError, match="a 'gpt2' model .* which no family builds"):
        read_hf_config(config)
