"""Writing a model's parameters as a Hugging Face checkpoint directory."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from ..config import DecoderConfig, write_hf_config
from .load import CONFIG_FILE, SINGLE_FILE
from .names import hf_name_map


def save_checkpoint(
    config: DecoderConfig,
    params: Mapping[str, jax.Array],
    directory: str | Path,
    *,
    scan_layers: bool = False,
) -> None:
    """Writes a Hugging Face checkpoint directory (`config.json` + `model.safetensors`, float32)
    that `load_model` (and transformers) reads.

    Args:
      config: The model's architecture.
      params: `{module path: global array}` for every parameter (the paths of `hf_name_map`),
        e.g. a flat view of a trained model's state; each array is fetched whole to the host.
      directory: Created if absent; its config and weights files are overwritten.
      scan_layers: `params` are those of a model built with `scan_layers` (a scanned run's
        parameters stacked over its layers); the checkpoint holds each layer's tensors.

    Raises:
      ValueError: `params` does not hold exactly the parameters `config` needs.
    """
    sources = hf_name_map(config, scan_layers=scan_layers)
    if set(params) != set(sources):
        raise ValueError(
            f"save_checkpoint needs exactly the parameters of hf_name_map; missing "
            f"{sorted(set(sources) - set(params))}, unexpected {sorted(set(params) - set(sources))}"
        )
    tensors: dict[str, np.ndarray] = {}
    pieces: dict[str, list[tuple[tuple[int, int], np.ndarray]]] = {}  # row ranges of one tensor
    for path, source in sources.items():
        value = np.asarray(jax.device_get(params[path]), np.float32)
        if source.padded_axis is not None:  # drop the vocab padding
            value = np.take(value, np.arange(config.vocab_size), axis=source.padded_axis)
        layer_values = [value] if source.layers is None else list(value)
        for layer_source, layer_value in zip(source.layer_parts(), layer_values, strict=True):
            parts, part_sources = [layer_value], [layer_source]
            if source.parts is not None:
                parts = list(np.moveaxis(layer_value, source.part_axis, 0))
                part_sources = list(layer_source.stacked_parts())
            if source.experts is not None:  # each part, a stack of experts
                parts = [expert for part in parts for expert in part]
                part_sources = [p for p in part_sources for _ in range(source.experts)]
            names = layer_source.tensor_names()
            for name, part, part_source in zip(names, parts, part_sources, strict=True):
                value = np.ascontiguousarray(part.T if source.transpose else part)
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
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(write_hf_config(config), indent=2) + "\n")
    save_file(tensors, str(out / SINGLE_FILE))
