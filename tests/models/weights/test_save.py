"""Writing a checkpoint is atomic: the destination holds the old checkpoint or the whole new one,
never a mix, and no temporary directory stays; a directory holding files is replaced only when
asked; a kept source config.json must describe the model; every family's config is written."""

import dataclasses
import json
import pathlib

import pytest
from flax import nnx

import boundary_jax as bj
from models.build import build_model
from models.config import PRESETS, read_hf_config, write_hf_config
from models.training.trainer import FlatParams
from models.weights import (
    load_config,
    read_hf_config_file,
    replace_directory,
    save_checkpoint,
    stage_checkpoint,
)

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
CONFIG = PRESETS["tiny-qwen3"]


@pytest.fixture(scope="module")
def params():
    """tiny-qwen3's parameters by path, every one different from zero."""
    _, state = nnx.split(build_model(CONFIG, bj.Topology()))
    return FlatParams(state).flatten(state)


def _files(directory: pathlib.Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_an_interrupted_write_leaves_the_old_checkpoint(params, tmp_path):
    """A write that fails while staging (here: a file to copy is missing) leaves the old
    checkpoint as it was and no temporary directory beside it."""
    out = tmp_path / "ckpt"
    save_checkpoint(CONFIG, params, out)
    before = {name: (out / name).read_bytes() for name in _files(out)}
    with pytest.raises(FileNotFoundError):
        save_checkpoint(CONFIG, params, out, overwrite=True, copy_files=[tmp_path / "none"])
    assert {name: (out / name).read_bytes() for name in _files(out)} == before
    assert _files(tmp_path) == ["ckpt"]


def test_overwrite_replaces_a_sharded_checkpoint_whole(params, tmp_path):
    """Over a sharded checkpoint, the new one leaves no old shard or index behind (an index
    left beside the new weights would make loaders read the old ones)."""
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text("{}")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
    with pytest.raises(FileExistsError, match="already holds files; pass overwrite=True"):
        save_checkpoint(CONFIG, params, out)
    assert _files(tmp_path) == ["ckpt"]
    save_checkpoint(CONFIG, params, out, overwrite=True)
    assert _files(out) == ["config.json", "model.safetensors"]
    assert _files(tmp_path) == ["ckpt"]
    assert load_config(out) == CONFIG


def test_replace_directory_refuses_a_file_and_cleans_up(params, tmp_path):
    """A destination that is a file is refused, and the staged directory removed."""
    (tmp_path / "file").write_text("x")
    staged = stage_checkpoint(CONFIG, params, tmp_path / "file")
    assert staged.parent == tmp_path and staged.name.startswith(".file.partial-")
    with pytest.raises(FileExistsError, match="is a file"):
        replace_directory(staged, tmp_path / "file", overwrite=True)
    assert _files(tmp_path) == ["file"]


def test_a_kept_config_must_describe_the_model(params, tmp_path):
    """hf_config is written as given (its extra keys and token ids kept, dtype float32) only
    if it reads back to the model's config."""
    kept = write_hf_config(CONFIG) | {"bos_token_id": 7, "custom": [1], "torch_dtype": "bfloat16"}
    save_checkpoint(CONFIG, params, tmp_path / "kept", hf_config=kept)
    written = read_hf_config_file(tmp_path / "kept")
    assert written == {k: v for k, v in kept.items() if k != "torch_dtype"} | {"dtype": "float32"}
    other = kept | {"num_hidden_layers": 3}
    with pytest.raises(ValueError, match="hf_config must describe the saved model"):
        save_checkpoint(CONFIG, params, tmp_path / "other", hf_config=other)
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize(
    "name", sorted(p.name for p in GOLDEN.iterdir() if (p / "model.safetensors").is_file())
)
def test_every_family_writes_a_config_that_reads_back(name):
    """write_hf_config writes every family read_hf_config reads (OLMo 2, EXAONE 4 and Gemma 3
    included), back to the same config; transformers loads these (checked once: each golden
    checkpoint's logits within 2e-5 under the written config.json)."""
    config = load_config(GOLDEN / name)
    written = json.loads(json.dumps(write_hf_config(config)))
    assert read_hf_config(written) == config
    assert (
        written["model_type"]
        == json.loads((GOLDEN / name / "config.json").read_text())["model_type"]
    )


def test_a_config_without_a_hugging_face_form_is_refused():
    """A combination the family's config.json cannot say is refused, not written wrong."""
    with pytest.raises(ValueError, match="cannot say this configuration"):
        write_hf_config(dataclasses.replace(PRESETS["small-llama"], sliding_window=8))
    assert all(read_hf_config(write_hf_config(c)) == c for c in PRESETS.values())
