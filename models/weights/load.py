"""Loading Hugging Face safetensors checkpoints onto a mesh, one shard per device.

Every parameter is built with `jax.make_array_from_callback`: each addressable device's callback
reads only its block of the tensor from the memory-mapped file (`safe_open(...).get_slice`), so no
process ever materializes a whole sharded tensor, and a replicated one only once at a time.
Hugging Face `nn.Linear` weights are [out, in]; our kernels are [in, out], so a kernel block is
read transposed. Vocab-padding rows (embedding) and columns (LM head) are zeros.

Mixture-of-experts checkpoints store one tensor per expert (`...experts.{e}.gate_proj.weight`,
or `...experts.{e}.w1.weight`); the model stacks them into one [experts, ...] parameter, and
a device whose shard covers experts [a, b) (and a slice of their width) reads only those tensors,
and only that slice of each. A model built with `scan_layers` stacks a run of layers' parameters
on a leading layer axis; each is read layer by layer, each device reading its shard of each.
Projections that one matmul computes together (k and v; gate and up) are one parameter with a
parts axis, each part read from its own tensor, or cut from one tensor that interleaves them
(GPT-OSS's fused experts, `HFTensor.interleaved`): a device reads its columns of all parts at
once. A checkpoint whose experts are stored fused (one tensor [experts, ...]) is read like any
tensor, each device reading its experts' rows of it. A tensor that feeds several parameters (a
Mamba2 mixer's fused `in_proj`: z, x, B, C and dt) is read by row ranges (`HFTensor.rows`), each
device reading only its rows of its range. The tensors a family's causal LM never reads (multi-
token-prediction layers, zero-computation experts' weights: its `unread_tensors`) are skipped with
a one-line notice. An MXFP4 checkpoint's packed tensors (`X_blocks`, `X_scales`) read as the float
tensor `X` they encode, each device dequantizing only its shard (`models.weights.mxfp4`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import SafetensorError, safe_open

from ..config import DecoderConfig, family_of, hf_name_map, read_hf_config
from ..config.multimodal import language_model_tensors
from ..config.registry import image_text_family
from ..config.tensors import IGNORED_SUFFIXES, HFTensor
from ..layers.fp8_linear import Fp8Quantization
from .fp8 import (
    FP8_DTYPE,
    OTHER_FP8,
    STORED_FP8,
    Fp8Dequantized,
    Fp8Source,
    fp8_sources,
    read_stored_fp8,
    stored_fp8,
)
from .mxfp4 import Mxfp4Tensors, stored_mxfp4

_LOG = logging.getLogger(__name__)
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_json(path: str | Path) -> Any:
    """The value a JSON file holds.

    Raises:
      FileNotFoundError: No file at `path`.
      ValueError: The file is not valid UTF-8 JSON (the message names the file and the spot).
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no file {file}")
    try:
        return json.loads(file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from None


def read_hf_config_file(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The checkpoint directory's `config.json` as a dict.

    Raises:
      FileNotFoundError: The directory has no `config.json`.
      ValueError: It is not a JSON object.
    """
    path = Path(checkpoint_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {checkpoint_dir}")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object; got {type(config).__name__}")
    return config


def load_config(checkpoint_dir: str | Path) -> DecoderConfig:
    """The `DecoderConfig` of the checkpoint directory's `config.json`.

    Raises:
      FileNotFoundError: The directory has no `config.json`.
      ValueError: It is not JSON, or describes a decoder the models here do not build (the
        message names the file).
    """
    path = Path(checkpoint_dir) / CONFIG_FILE
    try:
        return read_hf_config(read_hf_config_file(checkpoint_dir))
    except ValueError as error:
        message = str(error)
        if str(path) in message:
            raise
        if message.startswith(CONFIG_FILE):  # "config.json has no ...": say which one
            raise ValueError(f"{path}{message.removeprefix(CONFIG_FILE)}") from None
        raise ValueError(f"{path}: {message}") from None


def check_checkpoint_files(checkpoint_dir: str | Path) -> None:
    """Checks, before any weight is read, that the checkpoint's weights files are all there
    and readable: the index (if any) is JSON naming existing files, and every safetensors
    file's header parses (a truncated or corrupt file fails here, in a fraction of a second).

    Raises:
      FileNotFoundError: The directory has neither weights layout, or a named file is missing.
      ValueError: The index or a safetensors file is corrupt (the message names the file).
    """
    with _Checkpoint(Path(checkpoint_dir)) as checkpoint:
        checkpoint.open_all()


def load_params(
    checkpoint_dir: str | Path,
    abstract_state: nnx.State,
    mesh: Mesh,
    dtype: np.dtype,
    *,
    scan_layers: bool = False,
    layers: range | None = None,
    quantization: Fp8Quantization | None = None,
) -> nnx.State:
    """Fills an abstract parameter state from a checkpoint, each device reading only its shard.

    Args:
      checkpoint_dir: A directory with `config.json` and `model.safetensors`, or
        `model.safetensors.index.json` and the shard files it names.
      abstract_state: The parameters of `nnx.eval_shape(model_factory)` (e.g.
        `nnx.split(abstract_model, nnx.Param, ...)[1]`), with global shapes and `out_sharding`
        metadata naming the mesh axes.
      mesh: The mesh the arrays are placed on.
      dtype: The dtype of every loaded parameter (the checkpoint's values are cast), except
        FP8 values and scales, which keep their float8_e4m3fn and float32.
      scan_layers: The model was built with `scan_layers` (its paths are `hf_name_map`'s with
        it).
      layers: The model layers the state holds when it is a pipeline stage's (its `layers.j`
        is model layer `layers.start + j`; it holds the embedding, final norm and LM head only
        where the stage does): its layers' tensors must all be there, and the checkpoint's
        other tensors are the other stages'. None: the whole model.
      quantization: The model was built with FP8 projections (`models.weights.fp8`): read
        from a fine-grained FP8 checkpoint, or quantized on load from another. None: a
        fine-grained FP8 checkpoint's weights are dequantized on load (`Fp8Dequantized`).

    Returns:
      `abstract_state` with every leaf replaced by a global array sharded as its metadata says.

    Raises:
      FileNotFoundError: The directory lacks the config or weights files.
      ValueError: A parameter has no tensor in the map or checkpoint, a tensor's shape does not
        fit its parameter, or the checkpoint holds tensors the model has no parameter for
        (other than tensors of no elements).
    """
    config = load_config(checkpoint_dir)
    sources = hf_name_map(config, scan_layers=scan_layers)
    if layers is not None:
        sources = _stage_sources(sources, layers)
    fp8 = stored_fp8(checkpoint_dir)
    if quantization is not None:
        sources = fp8_sources(sources, quantization, stored=fp8)
    leaves = nnx.to_flat_state(abstract_state)
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(abstract_state)))
    paths = {_dotted(path) for path, _ in leaves}
    unmapped = sorted(paths - sources.keys())
    if unmapped:
        raise ValueError(
            f"model parameters {unmapped} have no Hugging Face tensor; expected the module paths "
            "of models.config.hf_name_map"
        )
    absent = sorted(
        path for path in sources.keys() - paths if layers is None or path.startswith("layers.")
    )
    if absent:
        raise ValueError(
            f"the checkpoint's config needs parameters {absent}, which the model lacks; build "
            f"the model from the same config as {checkpoint_dir}"
        )
    dequantize = fp8 and quantization is None
    with _Checkpoint(Path(checkpoint_dir), dequantize_fp8=dequantize) as checkpoint:
        used = {name for path in paths for name in sources[path].tensor_names()}
        unread, notice = family_of(config).unread_tensors(config, checkpoint.names)
        if notice is not None:
            _LOG.warning("%s: %s", checkpoint_dir, notice)
        unread = frozenset(unread)
        unused = sorted(
            name
            for name in checkpoint.names
            if name not in used
            and not name.endswith(IGNORED_SUFFIXES)
            and name not in unread
            and (name != "lm_head.weight" or "lm_head.kernel" in sources)
            and layers is None  # a stage's: the other stages read the rest
            # Nothing to read (transformers writes them for a Kimi-Linear of no shared experts).
            and 0 not in checkpoint.shape(name, name)
        )
        if unused:
            raise ValueError(
                f"checkpoint {checkpoint_dir} has tensors the model does not use: {unused}"
                + _unused_hint(unused, used)
            )
        if "lm_head.kernel" not in sources and "lm_head.weight" in checkpoint.names:
            _check_tied_head(checkpoint, sources["embed.embedding"].name, checkpoint_dir)
        # Check every tensor's presence and shape before reading any data.
        stored_shapes = {
            path: _fitted_shape(checkpoint, sources[_dotted(path)], _dotted(path), variable.shape)
            for path, variable in leaves
        }
        loaded = []
        for path, variable in leaves:
            value = _make_array(
                checkpoint,
                sources[_dotted(path)],
                variable.shape,
                stored_shapes[path],
                NamedSharding(mesh, specs[path].get_value()),
                _loaded_dtype(_dotted(path), variable, dtype),
            )
            loaded.append((path, variable.replace(value=value)))
    return nnx.from_flat_state(loaded)


def load_tensor(
    checkpoint_dir: str | Path,
    source: HFTensor,
    shape: tuple[int, ...],
    mesh: Mesh,
    spec: PartitionSpec,
    dtype: np.dtype,
) -> jax.Array:
    """One parameter from a checkpoint as a global array split by `spec`, each device reading
    only its block (for stacked experts: only its experts' tensors, and only its slice of each).

    Args:
      checkpoint_dir: As `load_params`.
      source: Where the parameter comes from (a single tensor or a stack of per-expert ones).
      shape: The parameter's global shape (in the parameter's layout, e.g. [experts, hidden,
        width] for stacked gate projections).
      mesh: The mesh the array is placed on.
      spec: The parameter's `PartitionSpec` over `mesh`.
      dtype: The array's dtype (the checkpoint's values are cast).

    Raises:
      FileNotFoundError: The directory lacks the weights files.
      ValueError: A tensor is missing or its shape does not fit `shape`.
    """
    path = f"<{source.name}>"
    with _Checkpoint(Path(checkpoint_dir)) as checkpoint:
        logical = _fitted_shape(checkpoint, source, path, tuple(shape))
        return _make_array(
            checkpoint, source, tuple(shape), logical, NamedSharding(mesh, spec), dtype
        )


def _stage_sources(sources: Mapping[str, HFTensor], layers: range) -> dict[str, HFTensor]:
    """`sources` under a pipeline stage's paths: model layer `layers.start + j` is its
    `layers.j`; the layers it does not hold are left out."""
    staged = {}
    for path, source in sources.items():
        head, _, rest = path.partition(".")
        if head != "layers":
            staged[path] = source
            continue
        index, _, tail = rest.partition(".")
        if int(index) in layers:
            staged[f"layers.{int(index) - layers.start}.{tail}"] = source
    return staged


def _make_array(checkpoint, source, shape, logical, sharding, dtype) -> jax.Array:
    read = functools.partial(_read_block, checkpoint, source, shape, logical, np.dtype(dtype))
    return jax.make_array_from_callback(shape, sharding, read)


def _loaded_dtype(path: str, variable, dtype: np.dtype) -> np.dtype:
    """FP8 values and their scales keep their dtypes; every other parameter takes `dtype`."""
    if variable.dtype == FP8_DTYPE or path.endswith("_scale_inv"):
        return np.dtype(variable.dtype)
    return dtype


def _dotted(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def _fitted_shape(
    checkpoint: _Checkpoint, source: HFTensor | Fp8Source, path: str, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """The stored tensor's shape in the parameter's layout, checked to fit `shape`.

    For stacked experts, "stored" is (experts, *one expert's shape), and only the expert's own
    axes are transposed; for stacked layers, (layers, *one layer's)."""
    if isinstance(source, Fp8Source):
        return source.fitted_shape(checkpoint, path, shape, _fitted_shape)
    if source.layers is not None:
        parts = source.layer_parts()
        if shape[:1] != (len(parts),):
            raise ValueError(
                f"parameter {path} stacks {len(parts)} layers on axis 0; its shape is {shape}"
            )
        fitted = {_fitted_shape(checkpoint, part, path, shape[1:]) for part in parts}
        if len(fitted) != 1:
            raise ValueError(f"the layers of {source.name} (parameter {path}) differ: {fitted}")
        return (len(parts), *fitted.pop())
    if source.interleaved:  # the parts axis and the next one are one stored axis
        axis, count = source.part_axis, len(source.parts)
        if not 0 <= axis < len(shape) - 1 or shape[axis] != count:
            raise ValueError(
                f"parameter {path} interleaves {count} parts on axis {axis}; its shape is {shape}"
            )
        fused = (*shape[:axis], count * shape[axis + 1], *shape[axis + 2 :])
        one = _fitted_shape(checkpoint, source.fused_parts(), path, fused)
        return (*one[:axis], count, one[axis] // count, *one[axis + 1 :])
    if source.parts is not None:
        axis = source.part_axis
        if not 0 <= axis < len(shape) or shape[axis] != len(source.parts):
            raise ValueError(
                f"parameter {path} stacks {len(source.parts)} parts on axis {axis}; its shape is "
                f"{shape}"
            )
        inner = shape[:axis] + shape[axis + 1 :]
        fitted = {_fitted_shape(checkpoint, part, path, inner) for part in source.stacked_parts()}
        if len(fitted) != 1:
            raise ValueError(f"the parts of {source.name} (parameter {path}) differ: {fitted}")
        one = fitted.pop()
        return (*one[:axis], len(source.parts), *one[axis:])
    shapes = {name: checkpoint.shape(name, path) for name in source.tensor_names()}
    if len(set(shapes.values())) != 1:
        raise ValueError(
            f"the experts of {source.name} (parameter {path}) differ in shape: {shapes}"
        )
    one = next(iter(shapes.values()))
    if source.rows is not None:
        start, stop = source.rows
        if stop > one[0]:
            raise ValueError(
                f"parameter {path} reads rows [{start}, {stop}) of checkpoint tensor "
                f"{source.name}, which has {one[0]}; build the model from the checkpoint's "
                "config.json"
            )
        one = (stop - start, *one[1:])
    one_logical = one[::-1] if source.transpose else one
    if source.experts is None:
        stored, logical = one, one_logical
    else:
        stored, logical = (source.experts, *one), (source.experts, *one_logical)
    fits = len(logical) == len(shape) and all(
        have == want or (axis == source.padded_axis and have == source.padded_from)
        for axis, (have, want) in enumerate(zip(logical, shape, strict=False))
    )
    if not fits:
        layout = (
            f" (read transposed, as {logical}: HF Linear weights are [out, in])"
            if source.transpose
            else ""
        )
        raise ValueError(
            f"checkpoint tensor {source.name} has shape {stored}{layout}; parameter {path} is "
            f"{shape}. Build the model from the checkpoint's config.json."
        )
    return logical


def _read_block(
    checkpoint: _Checkpoint,
    source: HFTensor | Fp8Source,
    shape: tuple[int, ...],
    logical: tuple[int, ...],
    dtype: np.dtype,
    index: tuple[slice, ...],
) -> np.ndarray:
    """One device's block of a parameter of global `shape`; `logical` is the stored tensor's
    shape in the parameter's layout (smaller along a padded axis)."""
    if isinstance(source, Fp8Source):
        return source.read_block(checkpoint, shape, logical, dtype, index, _read_block)
    wanted = [part.indices(size) for part, size in zip(index, shape, strict=True)]
    block = np.zeros(tuple(stop - start for start, stop, _ in wanted), dtype)
    # Clip to the stored extent: rows or columns past it are vocab padding, left zero.
    reads = tuple(
        slice(start, min(stop, size))
        for (start, stop, _), size in zip(wanted, logical, strict=True)
    )
    if any(part.stop <= part.start for part in reads):
        return block
    if source.layers is not None:  # axis 0 picks the layers; each layer's part gives the rest
        parts = source.layer_parts()[reads[0]]
        inner = tuple(slice(part.start, part.stop) for part in reads[1:])
        values = np.stack(
            [_read_block(checkpoint, part, shape[1:], logical[1:], dtype, inner) for part in parts]
        )
    elif source.interleaved:  # one read of the columns of every part, then split
        axis, count = source.part_axis, len(source.parts)
        width = reads[axis + 1]
        fused_read = slice(count * width.start, count * width.stop)
        fused_index = (*reads[:axis], fused_read, *reads[axis + 2 :])
        fuse = lambda sizes: (*sizes[:axis], count * sizes[axis + 1], *sizes[axis + 2 :])  # noqa: E731
        values = _read_block(
            checkpoint, source.fused_parts(), fuse(shape), fuse(logical), dtype, fused_index
        )
        split = (*values.shape[:axis], width.stop - width.start, count, *values.shape[axis + 1 :])
        values = np.moveaxis(values.reshape(split), axis + 1, axis)[
            (slice(None),) * axis + (reads[axis],)
        ]
    elif source.parts is not None:  # the parts axis picks the parts; each gives the rest
        axis = source.part_axis
        parts = source.stacked_parts()[reads[axis]]
        inner = tuple(slice(part.start, part.stop) for part in reads[:axis] + reads[axis + 1 :])
        cut = lambda sizes: sizes[:axis] + sizes[axis + 1 :]  # noqa: E731
        blocks = [_read_block(checkpoint, p, cut(shape), cut(logical), dtype, inner) for p in parts]
        values = np.stack(blocks, axis=axis)
    elif source.experts is None:
        values = _read_tensor(checkpoint, source.name, source, reads)
    else:  # axis 0 picks the experts; each expert's tensor gives the rest of the block
        names = source.tensor_names()[reads[0]]
        values = np.stack([_read_tensor(checkpoint, name, source, reads[1:]) for name in names])
    block[tuple(slice(0, part.stop - part.start) for part in reads)] = values.astype(dtype)
    return block


def _read_tensor(
    checkpoint: _Checkpoint, name: str, source: HFTensor, reads: tuple[slice, ...]
) -> np.ndarray:
    """The block `reads` (in the parameter's layout) of one stored tensor, read as `source`
    says: transposed, and within its row range."""
    index = reads[::-1] if source.transpose else reads
    if source.rows is not None:  # the range's rows, offset into the stored tensor
        first = source.rows[0]
        index = (slice(first + index[0].start, first + index[0].stop), *index[1:])
    stored = checkpoint.read(name, index)
    return stored.T if source.transpose else stored


def _unused_hint(unused: list[str], used: set[str]) -> str:
    """Why a checkpoint's tensors may go unused, where their names show a layout transformers
    writes for another model: a base model's (no `model.` prefix) or fused experts."""
    if any(f"model.{name}" in used for name in unused):
        return (
            " (named without the 'model.' prefix, as a base model's: save the ForCausalLM "
            "model, which holds the LM head too)"
        )
    if any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in unused):
        return (
            " (experts fused per layer, as transformers holds them in memory: this family reads "
            "one tensor per expert, which save_pretrained writes)"
        )
    return ""


def _check_tied_head(checkpoint: _Checkpoint, embedding: str, checkpoint_dir: Path) -> None:
    """A tied model's checkpoint may hold `lm_head.weight` too (torch's files hold both):
    equal to the embedding, it is the same head.

    Raises:
      ValueError: It differs: transformers then unties the two, which the config read here
        does not say.
    """
    whole = (slice(None), slice(None))
    if not np.array_equal(
        checkpoint.read("lm_head.weight", whole), checkpoint.read(embedding, whole)
    ):
        raise ValueError(
            f"checkpoint {checkpoint_dir}'s config.json ties the embeddings, but its "
            f"lm_head.weight differs from {embedding} (transformers then unties them); set "
            "tie_word_embeddings to false in config.json"
        )


class _Checkpoint(contextlib.AbstractContextManager):
    """The tensors of one checkpoint directory, each file opened (memory-mapped) once; an
    image-text checkpoint's language model's, named as its text checkpoint's
    (`models.config.multimodal`), the vision tower's left out."""

    def __init__(self, directory: Path, *, dequantize_fp8: bool = False):
        self._directory = directory
        self._files = contextlib.ExitStack()
        self._handles: dict[str, object] = {}
        self._held: dict[str, set[str]] = {}
        self._mxfp4 = Mxfp4Tensors({})
        self._fp8 = Fp8Dequantized({})
        self._dequantize_fp8 = dequantize_fp8
        index = directory / INDEX_FILE
        if (directory / SINGLE_FILE).is_file():  # beside an index, it wins (as in transformers)
            self._file_of = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}  # noqa: SIM118
        elif index.is_file():
            weight_map = read_json(index)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, Mapping) or not all(
                isinstance(file, str) for file in weight_map.values()
            ):
                raise ValueError(f"{index} must hold a 'weight_map' of tensor names to files")
            self._file_of = dict(weight_map)
        else:
            raise FileNotFoundError(
                f"checkpoint directory {directory} has neither {SINGLE_FILE} nor {INDEX_FILE}"
            )
        self._stored = {name: name for name in self._file_of}
        config_file = directory / CONFIG_FILE
        if config_file.is_file() and image_text_family(read_hf_config_file(directory)):
            # The language model's tensors, named as its text checkpoint's.
            self._stored = language_model_tensors(self._file_of)
            self._file_of = {text: self._file_of[name] for text, name in self._stored.items()}
        if (directory / CONFIG_FILE).is_file() and stored_mxfp4(directory):
            self._mxfp4 = Mxfp4Tensors.of(self._file_of)
        if dequantize_fp8:
            self._fp8 = Fp8Dequantized.of(self._file_of)

    @property
    def names(self) -> list[str]:
        """The tensors' names, an MXFP4 pair's as the name of the tensor it encodes, and an FP8
        weight's scale left out where the weights are dequantized."""
        return self._fp8.names(self._mxfp4.names(self._file_of))

    def shape(self, name: str, path: str) -> tuple[int, ...]:
        if name in self._mxfp4.pairs:
            return self._mxfp4.shape(name, lambda stored: self.shape(stored, path))
        if name not in self._file_of:
            raise ValueError(
                f"checkpoint {self._directory} has no tensor {name!r}, needed for parameter {path}"
            )
        self._check_held(name)
        tensor = self._open(self._file_of[name]).get_slice(self._stored[name])
        shape = tuple(tensor.get_shape())
        if tensor.get_dtype() in OTHER_FP8:
            raise ValueError(
                f"checkpoint {self._directory} stores {name} as {tensor.get_dtype()}; FP8 "
                "weights load from float8_e4m3fn (F8_E4M3) tensors only"
            )
        if name in self._fp8.scales:
            self._fp8.check(name, shape, self.shape(self._fp8.scales[name], path))
        elif self._dequantize_fp8 and tensor.get_dtype() in STORED_FP8:
            raise ValueError(
                f"checkpoint {self._directory} stores {name} in FP8 without its "
                f"{name.removesuffix('.weight')}.weight_scale_inv"
            )
        return shape

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if name in self._mxfp4.pairs:
            return self._mxfp4.read(name, index, self.read)
        if name in self._fp8.scales:
            return self._fp8.read(name, index, self._read_stored)
        return self._read_stored(name, index)

    def _read_stored(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        stored = self._stored[name]
        tensor = self._open(self._file_of[name]).get_slice(stored)
        if tensor.get_dtype() in STORED_FP8:  # the safetensors numpy reader cannot slice FP8
            return read_stored_fp8(self._directory / self._file_of[name], stored, index)
        return tensor[index]

    def open_all(self) -> None:
        """Opens every weights file (reading each header only); each tensor must be in the file
        the index names for it."""
        for file in sorted(set(self._file_of.values())):
            self._open(file)
        for name in self._file_of:
            self._check_held(name)

    def _check_held(self, name: str) -> None:
        file = self._file_of[name]
        if file not in self._held:
            self._held[file] = set(self._open(file).keys())
        if self._stored[name] not in self._held[file]:
            raise ValueError(
                f"checkpoint {self._directory}'s {INDEX_FILE} maps {self._stored[name]} to "
                f"{file}, which does not hold it"
            )

    def _open(self, file: str):
        if file not in self._handles:
            path = self._directory / file
            if not path.is_file():
                raise FileNotFoundError(
                    f"checkpoint file {path} (named in {INDEX_FILE}) is missing"
                )
            try:
                handle = safe_open(str(path), framework="numpy")
            except SafetensorError as error:
                raise ValueError(f"{path} is not a readable safetensors file: {error}") from None
            self._handles[file] = self._files.enter_context(handle)
        return self._handles[file]

    def __exit__(self, *exc_info):
        self._files.close()
        self._handles.clear()
