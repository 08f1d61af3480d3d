"""Writing a model's parameters as a Hugging Face checkpoint directory, atomically.

A checkpoint is first written whole into a temporary directory beside its destination
(`stage_checkpoint`), then renamed into place (`replace_directory`): the destination holds either
what it held before or the whole new checkpoint, never new files beside old ones.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from ..config import DecoderConfig, hf_name_map, read_hf_config, write_hf_config
from ..config.registry import as_text_model
from .load import CONFIG_FILE, SINGLE_FILE

SAVED_DTYPE = "float32"
"""The dtype `save_checkpoint` writes every tensor in."""


def save_checkpoint(
    config: DecoderConfig,
    params: Mapping[str, jax.Array],
    directory: str | Path,
    *,
    scan_layers: bool = False,
    overwrite: bool = False,
    hf_config: Mapping[str, Any] | None = None,
    copy_files: Sequence[str | Path] = (),
) -> None:
    """Writes a Hugging Face checkpoint directory (`config.json` + `model.safetensors`, float32)
    that `load_model` (and transformers) reads, atomically (`stage_checkpoint`, then
    `replace_directory`).

    Args:
      config: The model's architecture.
      params: `{module path: global array}` for every parameter (the paths of `hf_name_map`),
        e.g. a flat view of a trained model's state; each array is fetched whole to the host.
      directory: The checkpoint directory; its parent is created if absent.
      scan_layers: `params` are those of a model built with `scan_layers` (a scanned run's
        parameters stacked over its layers); the checkpoint holds each layer's tensors.
      overwrite: Replace a `directory` that holds files; without it such a directory is
        refused (an empty one is always taken).
      hf_config: The `config.json` to write, e.g. the source checkpoint's (its token ids and the
        keys this reader ignores kept), with its dtype set to float32; it must read back to
        `config`. None: `write_hf_config(config)`.
      copy_files: Files copied beside the weights (a tokenizer, `generation_config.json`).

    Raises:
      ValueError: `params` does not hold exactly the parameters `config` needs, or `hf_config`
        reads back to another config.
      FileExistsError: `directory` is a file, or holds files and `overwrite` is False.
    """
    check_destination(directory, overwrite=overwrite)
    staged = stage_checkpoint(
        config,
        params,
        directory,
        scan_layers=scan_layers,
        hf_config=hf_config,
        copy_files=copy_files,
    )
    replace_directory(staged, directory, overwrite=overwrite)


def check_destination(directory: str | Path, *, overwrite: bool) -> None:
    """Raises FileExistsError unless `directory` is absent, an empty directory, or (with
    `overwrite`) a directory."""
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; a checkpoint is a directory")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{out} already holds files; pass overwrite=True to replace them")


def stage_checkpoint(
    config: DecoderConfig,
    params: Mapping[str, jax.Array],
    directory: str | Path,
    *,
    scan_layers: bool = False,
    hf_config: Mapping[str, Any] | None = None,
    copy_files: Sequence[str | Path] = (),
) -> Path:
    """Writes the checkpoint `save_checkpoint` writes into a new temporary directory beside
    `directory` (a hidden `.<name>.partial-*`) and returns it; if the writing fails or is
    interrupted, the temporary directory is removed. Arguments as `save_checkpoint`."""
    sources = hf_name_map(config, scan_layers=scan_layers)
    if set(params) != set(sources):
        raise ValueError(
            f"save_checkpoint needs exactly the parameters of hf_name_map; missing "
            f"{sorted(set(sources) - set(params))}, unexpected {sorted(set(params) - set(sources))}"
        )
    written = _config_json(config, hf_config)
    out = Path(directory).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        staged.chmod(0o755)
        (staged / CONFIG_FILE).write_text(json.dumps(written, indent=2) + "\n")
        save_file(_tensors(config, params, sources), str(staged / SINGLE_FILE))
        for file in copy_files:
            shutil.copyfile(file, staged / Path(file).name)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return staged


def replace_directory(staged: str | Path, directory: str | Path, *, overwrite: bool) -> None:
    """Moves the finished directory `staged` to `directory` by renames in the same parent: an
    absent or empty `directory` is replaced in one rename; one that holds files (with
    `overwrite`) is first renamed aside, then removed. Removes `staged` if it refuses.

    Raises:
      FileExistsError: As `check_destination`.
    """
    staged, out = Path(staged), Path(directory).absolute()
    try:
        check_destination(out, overwrite=overwrite)
    except FileExistsError:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if not (out.is_dir() and any(out.iterdir())):
        os.replace(staged, out)
        return
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    os.replace(out, old)
    os.replace(staged, out)
    shutil.rmtree(old)


def _config_json(config: DecoderConfig, hf_config: Mapping[str, Any] | None) -> dict[str, Any]:
    if hf_config is None:
        return write_hf_config(config)
    # An image-text source's language model saves as its text family's checkpoint.
    hf_config = as_text_model(hf_config)
    written = {key: value for key, value in hf_config.items() if key != "torch_dtype"}
    written["dtype"] = SAVED_DTYPE
    if read_hf_config(written) != config:
        raise ValueError(
            "hf_config must describe the saved model; it reads back as "
            f"{read_hf_config(written)}, the model is {config}"
        )
    return written


def _tensors(config: DecoderConfig, params: Mapping[str, jax.Array], sources) -> dict:
    """The Hugging Face tensors of `params`, float32, on the host."""
    tensors: dict[str, np.ndarray] = {}
    pieces: dict[str, list[tuple[tuple[int, int], np.ndarray]]] = {}  # row ranges of one tensor
    for path, source in sources.items():
        value = np.asarray(jax.device_get(params[path]), np.float32)
        if source.padded_axis is not None:  # drop the vocab padding
            value = np.take(value, np.arange(config.vocab_size), axis=source.padded_axis)
        layer_values = [value] if source.layers is None else list(value)
        for layer_source, layer_value in zip(source.layer_parts(), layer_values, strict=True):
            parts, part_sources = [layer_value], [layer_source]
            if source.interleaved:  # the parts back into one axis, the part fastest
                axis = source.part_axis
                moved = np.moveaxis(layer_value, axis, axis + 1)
                parts = [moved.reshape(*moved.shape[:axis], -1, *moved.shape[axis + 2 :])]
                part_sources = [layer_source.fused_parts()]
            elif source.parts is not None:
                parts = list(np.moveaxis(layer_value, source.part_axis, 0))
                part_sources = list(layer_source.stacked_parts())
            if source.experts is not None:  # each part, a stack of experts
                parts = [expert for part in parts for expert in part]
                part_sources = [p for p in part_sources for _ in range(source.experts)]
            names = layer_source.tensor_names()
            for name, part, part_source in zip(names, parts, part_sources, strict=True):
                # np.array, not np.ascontiguousarray: that makes a scalar (a buffer) [1].
                value = np.array(part.T if source.transpose else part, order="C")
                if part_source.rows is None:
                    tensors[name] = value
                else:
                    pieces.setdefault(name, []).append((part_source.rows, value))
    for name, blocks in pieces.items():
        blocks.sort(key=lambda block: block[0])
        stops = [0] + [stop for (_, stop), _ in blocks]
        if [start for (start, _), _ in blocks] != stops[:-1]:
            ranges = [rows for rows, _ in blocks]
            raise ValueError(
                f"the parameters cut from {name} cover rows {ranges}, not one range from 0 "
                "without gaps; their HFTensor row ranges must tile the tensor"
            )
        tensors[name] = np.concatenate([value for _, value in blocks])
    return tensors
