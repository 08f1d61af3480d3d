"""Loading Hugging Face safetensors checkpoints onto a mesh, one shard per device.

Every parameter is built with `jax.make_array_from_callback`: each addressable device's callback
reads only its block of the tensor from the memory-mapped file (`safe_open(...).get_slice`), so no
process ever materializes a whole sharded tensor, and a replicated one only once at a time.
Hugging Face `nn.Linear` weights are [out, in]; our kernels are [in, out], so a kernel block is
read transposed. Vocab-padding rows (embedding) and columns (LM head) are zeros.

Mixture-of-experts checkpoints store one tensor per expert (`...experts.{e}.gate_proj.weight`,
Mixtral's `...experts.{e}.w1.weight`); the model stacks them into one [experts, ...] parameter, and
a device whose shard covers experts [a, b) (and a slice of their width) reads only those tensors,
and only that slice of each. A model built with `scan_layers` stacks a run of layers' parameters
on a leading layer axis; each is read layer by layer, each device reading its shard of each.
Projections that one matmul computes together (k and v; gate and up) are one parameter with a
parts axis, each part read from its own tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import save_file

from .config import Architecture, DecoderConfig, ResidualDesign

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """Where one model parameter comes from in a Hugging Face checkpoint.

    Attributes:
      name: The safetensors tensor name, e.g. "model.layers.0.self_attn.q_proj.weight"; for
        stacked experts a pattern with an `{expert}` field, e.g.
        "model.layers.0.mlp.experts.{expert}.gate_proj.weight".
      transpose: The tensor is an `nn.Linear` weight [out, in]; the parameter is [in, out] (for
        stacked experts: each expert's [out, in] becomes [in, out] behind the expert axis).
      padded_axis: The parameter axis padded past the checkpoint's vocab size with zeros, or
        None when the shapes must match exactly.
      experts: For a stack of per-expert tensors, their number: parameter axis 0 runs over the
        experts 0 .. experts - 1, and expert e comes from `name.format(expert=e)`. None for one
        tensor.
      layers: For a parameter of a scanned run of layers (`boundary_jax.StackedLayers`), the
        model layers it stacks: parameter axis 0 runs over them, and layer l's part (itself
        possibly a stack of experts or parts) comes from the name with `{layer}` replaced by l.
        None for one layer's parameter.
      parts: For projections stacked in one parameter (`ColumnParallelLinear(parts=...)`, the
        experts' `gate_up_proj`), the values of the name's `{part}` field, e.g. ("k", "v") in
        "self_attn.{part}_proj.weight": one layer's parameter axis `part_axis` runs over them,
        and each part may itself be a stack of experts. None for one tensor.
      part_axis: The axis of one layer's parameter that `parts` stack on.
    """

    name: str
    transpose: bool = False
    padded_axis: int | None = None
    experts: int | None = None
    layers: tuple[int, ...] | None = None
    parts: tuple[str, ...] | None = None
    part_axis: int | None = None

    def __post_init__(self):
        stacked = "{expert}" in self.name
        if stacked != (self.experts is not None):
            raise ValueError(
                "a stacked-experts HFTensor needs both an {expert} field in its name and "
                f"experts=N; got name={self.name!r}, experts={self.experts!r}"
            )
        if self.experts is not None and (self.experts < 1 or self.padded_axis is not None):
            raise ValueError(
                f"stacked experts need experts >= 1 and no padded axis; got {self.experts=}, "
                f"{self.padded_axis=}"
            )
        if ("{layer}" in self.name) != (self.layers is not None) or (
            self.layers is not None and (not self.layers or self.padded_axis is not None)
        ):
            raise ValueError(
                "a stacked-layers HFTensor needs a {layer} field in its name, layers=(l, ...) "
                f"and no padded axis; got name={self.name!r}, layers={self.layers!r}, "
                f"padded_axis={self.padded_axis!r}"
            )
        if ("{part}" in self.name) != (self.parts is not None) or (self.parts is None) != (
            self.part_axis is None
        ):
            raise ValueError(
                "a stacked-parts HFTensor needs a {part} field in its name, parts=(name, ...) "
                f"and part_axis; got name={self.name!r}, parts={self.parts!r}, "
                f"part_axis={self.part_axis!r}"
            )
        if self.parts is not None and self.padded_axis is not None:
            raise ValueError(f"stacked parts take no padded axis; got {self.padded_axis=}")

    def layer_parts(self) -> tuple[HFTensor, ...]:
        """Per layer of a stacked-layers parameter, the source of its part; else (self,)."""
        if self.layers is None:
            return (self,)
        return tuple(
            dataclasses.replace(self, name=self.name.replace("{layer}", str(i)), layers=None)
            for i in self.layers
        )

    def stacked_parts(self) -> tuple[HFTensor, ...]:
        """Per part of one layer's stacked-parts parameter, the source of its part."""
        return tuple(
            dataclasses.replace(
                self, name=self.name.replace("{part}", part), parts=None, part_axis=None
            )
            for part in self.parts
        )

    def tensor_names(self) -> tuple[str, ...]:
        """The checkpoint tensors this parameter is made of, in parameter order."""
        if self.layers is not None:
            return tuple(name for part in self.layer_parts() for name in part.tensor_names())
        if self.parts is not None:
            return tuple(name for part in self.stacked_parts() for name in part.tensor_names())
        if self.experts is None:
            return (self.name,)
        return tuple(self.name.format(expert=e) for e in range(self.experts))


# Each design's norms, by the boundary that owns them: its input norm (`norm`), its update's norm
# (post-norm) or its output transform (sandwich).
_NORM_TENSORS = {
    ResidualDesign.PRE_NORM: {
        "attn_boundary.norm.weight": HFTensor("input_layernorm.weight"),
        "ffn_boundary.norm.weight": HFTensor("post_attention_layernorm.weight"),
    },
    ResidualDesign.POST_NORM: {
        "attn_boundary.update.norm.weight": HFTensor("post_attention_layernorm.weight"),
        "ffn_boundary.update.norm.weight": HFTensor("post_feedforward_layernorm.weight"),
    },
    ResidualDesign.SANDWICH: {
        "attn_boundary.norm.weight": HFTensor("input_layernorm.weight"),
        "attn_boundary.output_transform.weight": HFTensor("post_attention_layernorm.weight"),
        "ffn_boundary.norm.weight": HFTensor("pre_feedforward_layernorm.weight"),
        "ffn_boundary.output_transform.weight": HFTensor("post_feedforward_layernorm.weight"),
    },
}
_KV_PARTS = ("k", "v")
_LAYER_TENSORS = {
    "attn.q_proj.kernel": HFTensor("self_attn.q_proj.weight", transpose=True),
    "attn.kv_proj.kernel": HFTensor(
        "self_attn.{part}_proj.weight", transpose=True, parts=_KV_PARTS, part_axis=1
    ),
    "attn.o_proj.kernel": HFTensor("self_attn.o_proj.weight", transpose=True),
    "mlp.gate_up_proj.kernel": HFTensor(
        "mlp.{part}_proj.weight", transpose=True, parts=("gate", "up"), part_axis=1
    ),
    "mlp.down_proj.kernel": HFTensor("mlp.down_proj.weight", transpose=True),
}
_QK_NORM_TENSORS = {
    "attn.q_norm.weight": HFTensor("self_attn.q_norm.weight"),
    "attn.k_norm.weight": HFTensor("self_attn.k_norm.weight"),
}
_QKV_BIAS_TENSORS = {
    "attn.q_proj.bias": HFTensor("self_attn.q_proj.bias"),
    "attn.kv_proj.bias": HFTensor("self_attn.{part}_proj.bias", parts=_KV_PARTS, part_axis=0),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints store


def _sparse_ffn_tensors(config: DecoderConfig) -> dict[str, HFTensor]:
    """The sparse FFN's parameters (paths relative to the layer) for `models.moe.SparseMoe` held
    as the layer's `mlp`, with layer-relative tensor names."""
    moe = config.moe
    if config.architecture is Architecture.MIXTRAL:
        prefix, names = "block_sparse_moe.", {"gate": "w1", "up": "w3", "down": "w2"}
    else:
        prefix, names = "mlp.", {part: f"{part}_proj" for part in ("gate", "up", "down")}
    experts = f"{prefix}experts.{{expert}}."
    tensors = {
        "mlp.router": HFTensor(f"{prefix}gate.weight", transpose=True),
        "mlp.gate_up_proj": HFTensor(
            experts + "{part}.weight",
            transpose=True,
            experts=moe.num_experts,
            parts=(names["gate"], names["up"]),
            part_axis=2,
        ),
        "mlp.down_proj": HFTensor(
            experts + names["down"] + ".weight", transpose=True, experts=moe.num_experts
        ),
    }
    if moe.shared_expert_intermediate_size is not None:
        for part in ("gate", "up", "down"):
            tensors[f"mlp.shared_expert.{part}_proj"] = HFTensor(
                f"mlp.shared_expert.{part}_proj.weight", transpose=True
            )
        if moe.shared_expert_gate:
            tensors["mlp.shared_expert.expert_gate"] = HFTensor(
                "mlp.shared_expert_gate.weight", transpose=True
            )
    return tensors


def hf_name_map(config: DecoderConfig, *, scan_layers: bool = False) -> dict[str, HFTensor]:
    """`{module path: HFTensor}` for every parameter of a decoder described by `config`, built
    with or without `scan_layers`.

    Module paths are the dotted `nnx` state paths: `embed.embedding`,
    `layers.{i}.attn_boundary.norm.weight`, `layers.{i}.ffn_boundary.norm.weight` (each
    stage's input norm, owned by its boundary; a post-norm decoder has instead
    `layers.{i}.{attn,ffn}_boundary.update.norm.weight`, its updates' norms, and a sandwich-norm
    one has both input norms and `layers.{i}.{attn,ffn}_boundary.output_transform.weight`),
    `layers.{i}.attn.{q,o}_proj.kernel`, `layers.{i}.attn.kv_proj.kernel` (k and v stacked on
    axis 1), `layers.{i}.attn.{q,k}_norm.weight` (qk_norm only),
    `layers.{i}.mlp.gate_up_proj.kernel` (gate and up stacked on axis 1),
    `layers.{i}.mlp.down_proj.kernel`, `final_norm.weight`, and `lm_head.kernel` (absent with
    tied embeddings, where the head reads the embedding table).

    With q/k/v biases (Qwen2, Qwen2-MoE): `layers.{i}.attn.q_proj.bias` and
    `layers.{i}.attn.kv_proj.bias` (k and v stacked on axis 0). A sparse layer of
    an MoE decoder (`config.sparse_layers`) has, in place of the dense MLP, the parameters of a
    `models.moe.SparseMoe` at `layers.{i}.mlp`: `mlp.router` [hidden, experts],
    `mlp.gate_up_proj` [experts, hidden, 2, width] (gate and up stacked on axis 2) and
    `mlp.down_proj` [experts, width, hidden] (stacked per-expert tensors), and with a shared
    expert `mlp.shared_expert.{gate,up,down}_proj` and `mlp.shared_expert.expert_gate`
    [hidden, 1].

    The paths above are those of an unscanned model. With `scan_layers`, `layers.{b}` is block
    b of `config.layer_blocks(True)`: an unscanned layer has its paths, and a scanned run has
    `layers.{b}.layer.<path>` with the run's layers stacked on axis 0 (`HFTensor.layers`).
    """
    names = {"embed.embedding": HFTensor("model.embed_tokens.weight", padded_axis=0)}
    dense = (
        _NORM_TENSORS[config.residual_design]
        | _LAYER_TENSORS
        | (_QK_NORM_TENSORS if config.qk_norm else {})
        | (_QKV_BIAS_TENSORS if config.qkv_bias else {})
    )
    sparse = {k: v for k, v in dense.items() if not k.startswith("mlp.")}
    if config.moe is not None:
        sparse |= _sparse_ffn_tensors(config)
    for b, (block, scanned) in enumerate(config.layer_blocks(scan_layers)):
        layer_paths = sparse if config.sparse_layers[block.start] else dense
        for path, tensor in layer_paths.items():
            if not scanned:
                names[f"layers.{b}.{path}"] = dataclasses.replace(
                    tensor, name=f"model.layers.{block.start}.{tensor.name}"
                )
            else:
                names[f"layers.{b}.layer.{path}"] = dataclasses.replace(
                    tensor, name=f"model.layers.{{layer}}.{tensor.name}", layers=tuple(block)
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
    checkpoint_dir: str | Path,
    abstract_state: nnx.State,
    mesh: Mesh,
    dtype: np.dtype,
    *,
    scan_layers: bool = False,
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
      scan_layers: The model was built with `scan_layers` (its paths are `hf_name_map`'s with
        it).

    Returns:
      `abstract_state` with every leaf replaced by a global array sharded as its metadata says.

    Raises:
      FileNotFoundError: The directory lacks the config or weights files.
      ValueError: A parameter has no tensor in the map or checkpoint, a tensor's shape does not
        fit its parameter, or the checkpoint holds tensors the model has no parameter for.
    """
    sources = hf_name_map(load_config(checkpoint_dir), scan_layers=scan_layers)
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
        used = {name for path in paths for name in sources[path].tensor_names()}
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
            value = _make_array(
                checkpoint,
                sources[_dotted(path)],
                variable.shape,
                stored_shapes[path],
                NamedSharding(mesh, specs[path].get_value()),
                dtype,
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


def _make_array(checkpoint, source, shape, logical, sharding, dtype) -> jax.Array:
    read = functools.partial(_read_block, checkpoint, source, shape, logical, np.dtype(dtype))
    return jax.make_array_from_callback(shape, sharding, read)


def _dotted(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def _fitted_shape(
    checkpoint: _Checkpoint, source: HFTensor, path: str, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """The stored tensor's shape in the parameter's layout, checked to fit `shape`.

    For stacked experts, "stored" is (experts, *one expert's shape), and only the expert's own
    axes are transposed; for stacked layers, (layers, *one layer's)."""
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
    one_logical = one[::-1] if source.transpose else one
    if source.experts is None:
        stored, logical = one, one_logical
    else:
        stored, logical = (source.experts, *one), (source.experts, *one_logical)
    fits = len(logical) == len(shape) and all(
        have == want or (axis == source.padded_axis and have <= want)
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
    if source.layers is not None:  # axis 0 picks the layers; each layer's part gives the rest
        parts = source.layer_parts()[reads[0]]
        inner = tuple(slice(part.start, part.stop) for part in reads[1:])
        values = np.stack(
            [_read_block(checkpoint, part, shape[1:], logical[1:], dtype, inner) for part in parts]
        )
    elif source.parts is not None:  # the parts axis picks the parts; each gives the rest
        axis = source.part_axis
        parts = source.stacked_parts()[reads[axis]]
        inner = tuple(slice(part.start, part.stop) for part in reads[:axis] + reads[axis + 1 :])
        cut = lambda sizes: sizes[:axis] + sizes[axis + 1 :]  # noqa: E731
        blocks = [_read_block(checkpoint, p, cut(shape), cut(logical), dtype, inner) for p in parts]
        values = np.stack(blocks, axis=axis)
    elif source.experts is None:
        values = _read_tensor(checkpoint, source.name, source.transpose, reads)
    else:  # axis 0 picks the experts; each expert's tensor gives the rest of the block
        names = source.tensor_names()[reads[0]]
        values = np.stack(
            [_read_tensor(checkpoint, name, source.transpose, reads[1:]) for name in names]
        )
    block[tuple(slice(0, part.stop - part.start) for part in reads)] = values.astype(dtype)
    return block


def _read_tensor(
    checkpoint: _Checkpoint, name: str, transpose: bool, reads: tuple[slice, ...]
) -> np.ndarray:
    """The block `reads` (in the parameter's layout) of one stored tensor."""
    stored = checkpoint.read(name, reads[::-1] if transpose else reads)
    return stored.T if transpose else stored


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


_MODEL_TYPES = {
    Architecture.QWEN3: "qwen3",
    Architecture.LLAMA: "llama",
    Architecture.MISTRAL: "mistral",
    Architecture.QWEN2: "qwen2",
    Architecture.QWEN3_MOE: "qwen3_moe",
    Architecture.MIXTRAL: "mixtral",
    Architecture.QWEN2_MOE: "qwen2_moe",
}


def hf_config(config: DecoderConfig) -> dict[str, Any]:
    """The Hugging Face `config.json` (as a dict) of `config`, in transformers 5's format;
    `DecoderConfig.from_hf` reads it back to `config`."""
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is not None:
        rope |= dataclasses.asdict(config.rope_scaling) | {"rope_type": "llama3"}
    out: dict[str, Any] = {
        "architectures": [config.architecture.value],
        "model_type": _MODEL_TYPES[config.architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "sliding_window": config.sliding_window,
        "use_sliding_window": config.sliding_window is not None,
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
    }
    if config.architecture in (Architecture.QWEN2, Architecture.QWEN2_MOE):
        out["attention_bias"] = config.qkv_bias
        out["qkv_bias"] = config.qkv_bias
    moe = config.moe
    if moe is None:
        return out
    out |= {"num_experts_per_tok": moe.top_k, "num_local_experts": moe.num_experts}
    if config.architecture is Architecture.MIXTRAL:
        return out
    out |= {
        "num_experts": moe.num_experts,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "norm_topk_prob": moe.renormalize,
        "mlp_only_layers": list(moe.mlp_only_layers),
        "decoder_sparse_step": moe.decoder_sparse_step,
    }
    if moe.shared_expert_intermediate_size is not None:
        out["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
    return out


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
    for path, source in sources.items():
        value = np.asarray(jax.device_get(params[path]), np.float32)
        if source.padded_axis is not None:  # drop the vocab padding
            value = np.take(value, np.arange(config.vocab_size), axis=source.padded_axis)
        layer_values = [value] if source.layers is None else list(value)
        for layer_source, layer_value in zip(source.layer_parts(), layer_values, strict=True):
            parts = [layer_value]
            if source.parts is not None:
                parts = list(np.moveaxis(layer_value, source.part_axis, 0))
            if source.experts is not None:  # each part, a stack of experts
                parts = [expert for part in parts for expert in part]
            for name, part in zip(layer_source.tensor_names(), parts, strict=True):
                tensors[name] = np.ascontiguousarray(part.T if source.transpose else part)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(hf_config(config), indent=2) + "\n")
    save_file(tensors, str(out / SINGLE_FILE))
