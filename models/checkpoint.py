"""Loading Hugging Face safetensors checkpoints onto a mesh, one shard per device.

Every parameter is built with `jax.make_array_from_callback`: each addressable device's callback
reads only its block of the tensor from the memory-mapped file (`safe_open(...).get_slice`), so no
process ever materializes a whole sharded tensor, and a replicated one only once at a time.
Hugging Face `nn.Linear` weights are [out, in]; our kernels are [in, out], so a kernel block is
read transposed. Vocab-padding rows (embedding) and columns (LM head) are zeros.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open

from .config import DecoderConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """Where one model parameter comes from in a Hugging Face checkpoint.

    Attributes:
      name: The safetensors tensor name, e.g. "model.layers.0.self_attn.q_proj.weight".
      transpose: The tensor is an `nn.Linear` weight [out, in]; the parameter is [in, out].
      padded_axis: The parameter axis padded past the checkpoint's vocab size with zeros, or
        None when the shapes must match exactly.
    """

    name: str
    transpose: bool = False
    padded_axis: int | None = None


_LAYER_TENSORS = {
    "attn_boundary.norm.weight": HFTensor("input_layernorm.weight"),
    "ffn_boundary.norm.weight": HFTensor("post_attention_layernorm.weight"),
    "attn.q_proj.kernel": HFTensor("self_attn.q_proj.weight", transpose=True),
    "attn.k_proj.kernel": HFTensor("self_attn.k_proj.weight", transpose=True),
    "attn.v_proj.kernel": HFTensor("self_attn.v_proj.weight", transpose=True),
    "attn.o_proj.kernel": HFTensor("self_attn.o_proj.weight", transpose=True),
    "mlp.gate_proj.kernel": HFTensor("mlp.gate_proj.weight", transpose=True),
    "mlp.up_proj.kernel": HFTensor("mlp.up_proj.weight", transpose=True),
    "mlp.down_proj.kernel": HFTensor("mlp.down_proj.weight", transpose=True),
}
_QK_NORM_TENSORS = {
    "attn.q_norm.weight": HFTensor("self_attn.q_norm.weight"),
    "attn.k_norm.weight": HFTensor("self_attn.k_norm.weight"),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints store


def hf_name_map(config: DecoderConfig) -> dict[str, HFTensor]:
    """`{module path: HFTensor}` for every parameter of a decoder described by `config`.

    Module paths are the dotted `nnx` state paths: `embed.embedding`,
    `layers.{i}.attn_boundary.norm.weight`, `layers.{i}.ffn_boundary.norm.weight` (each
    stage's input norm, owned by its boundary),
    `layers.{i}.attn.{q,k,v,o}_proj.kernel`, `layers.{i}.attn.{q,k}_norm.weight` (qk_norm only),
    `layers.{i}.mlp.{gate,up,down}_proj.kernel`, `final_norm.weight`, and `lm_head.kernel`
    (absent with tied embeddings, where the head reads the embedding table).
    """
    names = {"embed.embedding": HFTensor("model.embed_tokens.weight", padded_axis=0)}
    layer_tensors = _LAYER_TENSORS | (_QK_NORM_TENSORS if config.qk_norm else {})
    for i in range(config.num_layers):
        for path, tensor in layer_tensors.items():
            names[f"layers.{i}.{path}"] = dataclasses.replace(
                tensor, name=f"model.layers.{i}.{tensor.name}"
            )
    names["final_norm.weight"] = HFTensor("model.norm.weight")
    if not config.tie_word_embeddings:
        names["lm_head.kernel"] = HFTensor("lm_head.weight", transpose=True, padded_axis=1)
    return names


def load_config(checkpoint_dir: str | Path) -> DecoderConfig:
    """The `DecoderConfig` of the checkpoint directory's `config.json`."""
    path = Path(checkpoint_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {checkpoint_dir}")
    return DecoderConfig.from_hf(json.loads(path.read_text()))


def load_params(
    checkpoint_dir: str | Path, abstract_state: nnx.State, mesh: Mesh, dtype: np.dtype
) -> nnx.State:
    """Fills an abstract parameter state from a checkpoint, each device reading only its shard.

    Args:
      checkpoint_dir: A directory with `config.json` and `model.safetensors`, or
        `model.safetensors.index.json` and the shard files it names.
      abstract_state: The parameters of `nnx.eval_shape(model_factory)` (e.g.
        `nnx.split(abstract_model, nnx.Param, ...)[1]`), with global shapes and `out_sharding`
        metadata naming the mesh axes.
      mesh: The mesh the arrays are placed on.
      dtype: The dtype of every loaded parameter (the checkpoint's values are cast).

    Returns:
      `abstract_state` with every leaf replaced by a global array sharded as its metadata says.

    Raises:
      FileNotFoundError: The directory lacks the config or weights files.
      ValueError: A parameter has no tensor in the map or checkpoint, a tensor's shape does not
        fit its parameter, or the checkpoint holds tensors the model has no parameter for.
    """
    sources = hf_name_map(load_config(checkpoint_dir))
    leaves = nnx.to_flat_state(abstract_state)
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(abstract_state)))
    paths = {_dotted(path) for path, _ in leaves}
    unmapped = sorted(paths - sources.keys())
    if unmapped:
        raise ValueError(
            f"model parameters {unmapped} have no Hugging Face tensor; expected the module paths "
            "of models.checkpoint.hf_name_map"
        )
    absent = sorted(sources.keys() - paths)
    if absent:
        raise ValueError(
            f"the checkpoint's config needs parameters {absent}, which the model lacks; build "
            f"the model from the same config as {checkpoint_dir}"
        )
    with _Checkpoint(Path(checkpoint_dir)) as checkpoint:
        used = {sources[path].name for path in paths}
        unused = sorted(
            name
            for name in checkpoint.names
            if name not in used
            and not name.endswith(_IGNORED_SUFFIXES)
            and (name != "lm_head.weight" or "lm_head.kernel" in sources)
        )
        if unused:
            raise ValueError(
                f"checkpoint {checkpoint_dir} has tensors the model does not use: {unused}"
            )
        # Check every tensor's presence and shape before reading any data.
        stored_shapes = {
            path: _fitted_shape(checkpoint, sources[_dotted(path)], _dotted(path), variable.shape)
            for path, variable in leaves
        }
        loaded = []
        for path, variable in leaves:
            read = functools.partial(
                _read_block,
                checkpoint,
                sources[_dotted(path)],
                variable.shape,
                stored_shapes[path],
                np.dtype(dtype),
            )
            sharding = NamedSharding(mesh, specs[path].get_value())
            value = jax.make_array_from_callback(variable.shape, sharding, read)
            loaded.append((path, variable.replace(value=value)))
    return nnx.from_flat_state(loaded)


def _dotted(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def _fitted_shape(
    checkpoint: _Checkpoint, source: HFTensor, path: str, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """The stored tensor's shape in the parameter's layout, checked to fit `shape`."""
    stored = checkpoint.shape(source.name, path)
    logical = stored[::-1] if source.transpose else stored
    fits = len(logical) == len(shape) and all(
        have == want or (axis == source.padded_axis and have <= want)
        for axis, (have, want) in enumerate(zip(logical, shape, strict=False))
    )
    if not fits:
        layout = " (read transposed: HF Linear weights are [out, in])" if source.transpose else ""
        raise ValueError(
            f"checkpoint tensor {source.name} has shape {stored}{layout}; parameter {path} is "
            f"{shape}. Build the model from the checkpoint's config.json."
        )
    return logical


def _read_block(
    checkpoint: _Checkpoint,
    source: HFTensor,
    shape: tuple[int, ...],
    logical: tuple[int, ...],
    dtype: np.dtype,
    index: tuple[slice, ...],
) -> np.ndarray:
    """One device's block of a parameter of global `shape`; `logical` is the stored tensor's
    shape in the parameter's layout (smaller along a padded axis)."""
    wanted = [part.indices(size) for part, size in zip(index, shape, strict=True)]
    block = np.zeros(tuple(stop - start for start, stop, _ in wanted), dtype)
    # Clip to the stored extent: rows or columns past it are vocab padding, left zero.
    reads = tuple(
        slice(start, min(stop, size))
        for (start, stop, _), size in zip(wanted, logical, strict=True)
    )
    if any(part.stop <= part.start for part in reads):
        return block
    stored = checkpoint.read(source.name, reads[::-1] if source.transpose else reads)
    values = stored.T if source.transpose else stored
    block[tuple(slice(0, part.stop - part.start) for part in reads)] = values.astype(dtype)
    return block


class _Checkpoint(contextlib.AbstractContextManager):
    """The tensors of one checkpoint directory, each file opened (memory-mapped) once."""

    def __init__(self, directory: Path):
        self._directory = directory
        self._files = contextlib.ExitStack()
        self._handles: dict[str, object] = {}
        index = directory / INDEX_FILE
        if index.is_file():
            weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
            self._file_of = dict(weight_map)
        elif (directory / SINGLE_FILE).is_file():
            self._file_of = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}  # noqa: SIM118
        else:
            raise FileNotFoundError(
                f"checkpoint directory {directory} has neither {SINGLE_FILE} nor {INDEX_FILE}"
            )

    @property
    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str, path: str) -> tuple[int, ...]:
        if name not in self._file_of:
            raise ValueError(
                f"checkpoint {self._directory} has no tensor {name!r}, needed for parameter {path}"
            )
        return tuple(self._open(self._file_of[name]).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self._open(self._file_of[name]).get_slice(name)[index]

    def _open(self, file: str):
        if file not in self._handles:
            path = self._directory / file
            if not path.is_file():
                raise FileNotFoundError(
                    f"checkpoint file {path} (named in {INDEX_FILE}) is missing"
                )
            self._handles[file] = self._files.enter_context(safe_open(str(path), framework="numpy"))
        return self._handles[file]

    def __exit__(self, *exc_info):
        self._files.close()
        self._handles.clear()
