"""Hugging Face fine-grained FP8 checkpoints: reading them onto a mesh, quantizing a checkpoint on
load, and writing one.

The format (transformers' `FineGrainedFP8Config`, as the hub's FP8 checkpoints use it):
`config.json` has a `quantization_config` with `quant_method: "fp8"` and `weight_block_size:
[128, 128]`; each quantized `nn.Linear` weight is float8_e4m3fn [out, in] beside a float32
`weight_scale_inv` [out / 128, in / 128] (the weight is `weight * weight_scale_inv` per
block); activations are quantized dynamically per 128-feature token group. The quantized weights
are the attention and MLP projections and the routed experts'; the embedding, LM head, norms and
routers are not.

An FP8 parameter keeps Hugging Face's [out, in] layout (the FP8 kernels multiply it as stored),
so its blocks are read untransposed. Each device reads only its block of the values and of the
scales: a split always falls on block edges (the model refuses any other when it is built, and
the reader checks every block it reads). A checkpoint in bf16 or float32 is quantized on load
(`--quantize fp8`), each device quantizing its own blocks; under `Fp8Weights.DEQUANTIZED` the
values are multiplied back by their scales (the float64 reference).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from pallas_kernels.quantize import FP8_MAX, INVERSE_FP8_MAX

from ..config import hf_name_map, read_hf_config
from ..config.tensors import HFTensor
from ..layers.fp8_linear import Fp8Quantization, Fp8Weights
from .mxfp4 import MXFP4_METHOD

BLOCK = 128
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
STORED_FP8 = {"F8_E4M3": FP8_DTYPE}
"""Safetensors dtype codes of FP8 tensors, which the safetensors numpy reader cannot slice."""
OTHER_FP8 = ("F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
"""Safetensors codes of 8-bit float formats no checkpoint here stores its weights in."""

FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
"""The `quantization_config` of a fine-grained FP8 checkpoint, as `write_fp8_checkpoint` writes
it."""

# The projections an FP8 decoder quantizes, by their path inside a layer: dense (the kernel of
# a `ColumnParallelLinear` / `RowParallelLinear`) and routed experts (stacked per expert).
_DENSE = ("attn.q_proj", "attn.kv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_EXPERTS = ("mlp.gate_up_proj", "mlp.down_proj")


def stored_fp8(checkpoint_dir: str | Path) -> bool:
    """Whether a checkpoint directory's `config.json` declares fine-grained FP8 weights.

    Raises:
      NotImplementedError: It declares another quantization, other blocks than 128 x 128,
        static activation scales, or a quantization of its text model's own.
    """
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    quantization = config.get("quantization_config")
    inner = (config.get("text_config") or {}).get("quantization_config")
    if inner is not None and inner != quantization:
        raise NotImplementedError(
            f"{checkpoint_dir}: text_config has its own quantization_config {inner}; only the "
            "top-level one is read"
        )
    if quantization is None or quantization.get("quant_method") == MXFP4_METHOD:
        return False  # MXFP4 experts load dequantized (`models.weights.mxfp4`)
    method = quantization.get("quant_method")
    blocks = quantization.get("weight_block_size")
    scheme = quantization.get("activation_scheme", "dynamic")
    if method != "fp8" or blocks != [BLOCK, BLOCK] or scheme != "dynamic":
        raise NotImplementedError(
            f"only fine-grained FP8 checkpoints load quantized (quant_method 'fp8', "
            f"weight_block_size [{BLOCK}, {BLOCK}], dynamic activations); "
            f"{checkpoint_dir} has quantization_config {quantization}"
        )
    return True


class Fp8Role(enum.Enum):
    """What an FP8 layer's parameter holds of its weight."""

    VALUES = "values"  # float8_e4m3fn [..., out, in]
    SCALES = "scales"  # float32 [..., out / 128, in / 128]
    DEQUANTIZED = "dequantized"  # values * scales, in the model's dtype


@dataclasses.dataclass(frozen=True)
class Fp8Source:
    """Where an FP8 layer's parameter comes from, when it is not read as stored.

    Attributes:
      role: What the parameter holds.
      weight: The stored weight in the parameter's [..., out, in] layout (untransposed), with
        its experts, parts and layers.
      scales: The stored `weight_scale_inv` alike, or None where the weight is stored in bf16 or
        float32 and is quantized here.
    """

    role: Fp8Role
    weight: HFTensor
    scales: HFTensor | None

    def tensor_names(self) -> tuple[str, ...]:
        """The checkpoint tensors this parameter is made of."""
        scales = () if self.scales is None else self.scales.tensor_names()
        return self.weight.tensor_names() + scales

    def fitted_shape(self, checkpoint, path: str, shape: tuple[int, ...], fit: Callable):
        """The stored shape in the parameter's layout, checked to fit `shape` (`fit` is the
        loader's check of one `HFTensor`)."""
        if self.role is Fp8Role.SCALES:
            if self.scales is not None:
                return fit(checkpoint, self.scales, path, shape)
            fit(checkpoint, self.weight, path, _weight_shape(shape))
            return shape
        return fit(checkpoint, self.weight, path, shape)

    def read_block(self, checkpoint, shape, logical, dtype: np.dtype, index, read: Callable):
        """One device's block of the parameter (`read` is the loader's block reader of one
        `HFTensor`); `index` is the block's slices of the parameter's axes."""
        index = _normalized(index, shape)
        _check_aligned(index, shape, self.role)
        if self.role is Fp8Role.SCALES and self.scales is not None:
            return read(checkpoint, self.scales, shape, logical, np.dtype(np.float32), index)
        if self.scales is None:  # stored in bf16 / float32: quantize this block here
            scales_only = self.role is Fp8Role.SCALES
            weight_shape = _weight_shape(shape) if scales_only else shape
            weight_index = _weight_index(index) if scales_only else index
            stored = read(
                checkpoint, self.weight, weight_shape, weight_shape, np.float32, weight_index
            )
            values, scales = quantize_blocks(stored)
        else:
            values = read(checkpoint, self.weight, shape, logical, FP8_DTYPE, index)
            scale_shape = _scale_shape(shape)
            scales = read(
                checkpoint, self.scales, scale_shape, scale_shape, np.float32, _scale_index(index)
            )
        match self.role:
            case Fp8Role.VALUES:
                return values
            case Fp8Role.SCALES:
                return scales
            case Fp8Role.DEQUANTIZED:
                return dequantize_blocks(values, scales, dtype)


def fp8_sources(
    sources: dict[str, HFTensor], quantization: Fp8Quantization, *, stored: bool
) -> dict[str, HFTensor | Fp8Source]:
    """`hf_name_map`'s sources for a model built with `quantization`: each quantized projection's
    `kernel` becomes its FP8 parameters (`weight`, `weight_scale_inv`; a routed expert stack's
    `gate_up_proj` / `down_proj` and their `_scale_inv`), read as stored from an FP8 checkpoint
    (`stored`), else quantized on load; under DEQUANTIZED one parameter of values * scales."""
    out: dict[str, HFTensor | Fp8Source] = {}
    for path, source in sources.items():
        kind = _quantized_kind(path, source)
        if kind is None:
            out[path] = source
            continue
        if kind == "dense":
            base = path.removesuffix("kernel")
            values_path, scales_path = base + "weight", base + "weight_scale_inv"
        else:
            values_path, scales_path = path, path + "_scale_inv"
        weight = dataclasses.replace(
            source,
            transpose=False,
            part_axis=None if source.parts is None else int(source.experts is not None),
        )
        scales = _scale_tensor(weight) if stored else None
        if quantization.weights is Fp8Weights.DEQUANTIZED:
            out[values_path] = Fp8Source(Fp8Role.DEQUANTIZED, weight, scales)
            continue
        out[values_path] = weight if stored else Fp8Source(Fp8Role.VALUES, weight, None)
        out[scales_path] = scales if stored else Fp8Source(Fp8Role.SCALES, weight, None)
    return out


def _quantized_kind(path: str, source: HFTensor) -> str | None:
    """ "dense" for a quantized projection's kernel, "experts" for a routed expert stack, None
    for a parameter FP8 decoders keep in the model's dtype."""
    parts = path.split(".")
    if parts[0] != "layers":
        return None
    inner = ".".join(parts[3:] if len(parts) > 2 and parts[2] == "layer" else parts[2:])
    if inner.endswith(".kernel") and inner.removesuffix(".kernel") in _DENSE:
        return "dense"
    if inner in _EXPERTS and source.experts is not None:
        return "experts"
    return None


def _scale_tensor(weight: HFTensor) -> HFTensor:
    name = weight.name.removesuffix(".weight") + ".weight_scale_inv"
    return dataclasses.replace(weight, name=name)


def _weight_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], shape[-2] * BLOCK, shape[-1] * BLOCK)


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], shape[-2] // BLOCK, shape[-1] // BLOCK)


def _normalized(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*part.indices(size)[:2]) for part, size in zip(index, shape, strict=True))


def _weight_index(index: tuple[slice, ...]) -> tuple[slice, ...]:
    return (*index[:-2], *(slice(s.start * BLOCK, s.stop * BLOCK) for s in index[-2:]))


def _scale_index(index: tuple[slice, ...]) -> tuple[slice, ...]:
    return (*index[:-2], *(slice(s.start // BLOCK, s.stop // BLOCK) for s in index[-2:]))


def _check_aligned(index: tuple[slice, ...], shape: tuple[int, ...], role: Fp8Role) -> None:
    """Raises a ValueError where a device's block of a weight cuts a 128 x 128 block."""
    if role is Fp8Role.SCALES:
        return
    for axis in (-2, -1):
        start, stop = index[axis].start, index[axis].stop
        if start % BLOCK or stop % BLOCK:
            raise ValueError(
                f"a device's block [{start}:{stop}] of an FP8 weight's axis of {shape[axis]} "
                f"cuts a {BLOCK} x {BLOCK} block (and its scale); split FP8 weights on block "
                "edges: fewer ranks for this group"
            )


@dataclasses.dataclass(frozen=True)
class Fp8Dequantized:
    """A fine-grained FP8 checkpoint's weights seen as the float tensors they encode, for a
    model built without FP8 (a family that does not build it, or pipeline stages): each device
    reads its block of the FP8 values and the 128 x 128 scales covering it, wherever its block
    starts and ends, and multiplies them in float32.

    Attributes:
      scales: Each FP8 weight's name and its `weight_scale_inv`'s.
    """

    scales: dict[str, str]

    @classmethod
    def of(cls, names: Iterable[str]) -> Fp8Dequantized:
        """The weights among a checkpoint's tensor `names` that have a `weight_scale_inv`."""
        names = set(names)
        scale = lambda name: name.removesuffix(".weight") + ".weight_scale_inv"  # noqa: E731
        return cls({n: scale(n) for n in names if n.endswith(".weight") and scale(n) in names})

    def names(self, stored: Iterable[str]) -> list[str]:
        """`stored` without the scales (each read with its weight)."""
        hidden = set(self.scales.values())
        return [name for name in stored if name not in hidden]

    def check(self, name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
        """Raises a ValueError unless weight `name` is [out, in] and its scales hold one value
        per 128 x 128 block of it (the last blocks of a row or column may be partial)."""
        want = tuple(-(-size // BLOCK) for size in shape)
        if len(shape) != 2 or tuple(scale_shape) != want:
            raise ValueError(
                f"FP8 weight {name} is {tuple(shape)}, so its {self.scales[name]} must be {want} "
                f"(one scale per {BLOCK} x {BLOCK} block, as the quantization_config's "
                f"weight_block_size says); the checkpoint has {tuple(scale_shape)}"
            )

    def read(
        self,
        name: str,
        index: tuple[slice, ...],
        read_stored: Callable[[str, tuple[slice, ...]], np.ndarray],
    ) -> np.ndarray:
        """The block `index` ([out, in] slices with explicit bounds) of weight `name`,
        dequantized to float32 (`read_stored` reads a block of a stored tensor)."""
        values = np.asarray(read_stored(name, index), np.float32)
        first = tuple(part.start // BLOCK for part in index)
        blocks = tuple(
            slice(f, -(-part.stop // BLOCK)) for f, part in zip(first, index, strict=True)
        )
        scales = np.asarray(read_stored(self.scales[name], blocks), np.float32)
        for axis in (0, 1):
            scales = np.repeat(scales, BLOCK, axis=axis)
        crop = tuple(
            slice(part.start - f * BLOCK, part.stop - f * BLOCK)
            for f, part in zip(first, index, strict=True)
        )
        return values * scales[crop]


def quantize_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`pallas_kernels.quantize.quantize_blocks_reference` in numpy, bit for bit: [..., n, k] ->
    (float8 values [..., n, k], float32 scales [..., n / 128, k / 128])."""
    *lead, n, k = w.shape
    squares = np.asarray(w, np.float32).reshape(*lead, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scales = np.max(np.abs(squares), axis=(-3, -1)) * np.float32(INVERSE_FP8_MAX)
    divisor = np.where(scales > 0, scales, np.float32(1))[..., :, None, :, None]
    values = np.clip(squares / divisor, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return values.reshape(w.shape), scales.astype(np.float32)


def dequantize_blocks(values: np.ndarray, scales: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`values * scales` per 128 x 128 block, in float32 (float64 for a float64 `dtype`)."""
    *lead, n, k = values.shape
    acc = np.promote_types(dtype, np.float32)
    squares = values.astype(acc).reshape(*lead, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    return (squares * scales.astype(acc)[..., :, None, :, None]).reshape(values.shape).astype(dtype)


@functools.lru_cache(maxsize=64)
def _header(path: Path, modified: float) -> tuple[int, dict]:
    """(data start, header) of a safetensors file (cached per file version)."""
    del modified
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        return 8 + size, json.loads(handle.read(size))


def read_stored_fp8(path: Path, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """The block `index` of FP8 tensor `name` in safetensors file `path`, read through a memory
    map (only the pages of the block are touched)."""
    start, header = _header(path, path.stat().st_mtime)
    entry = header[name]
    dtype = STORED_FP8[entry["dtype"]]
    first, last = entry["data_offsets"]
    data = np.memmap(path, np.uint8, "r", offset=start + first, shape=(last - first,))
    return np.array(data.view(dtype).reshape(entry["shape"])[index])


def write_fp8_checkpoint(source_dir: str | Path, target_dir: str | Path) -> list[str]:
    """Writes the fine-grained FP8 form of a Hugging Face checkpoint: every weight an FP8
    decoder quantizes becomes float8_e4m3fn [out, in] with its float32 `weight_scale_inv`, the
    other tensors are copied as stored, and `config.json` gains `quantization_config`.

    Args:
      source_dir: A checkpoint `load_model` reads (one `model.safetensors`, bf16 or float32).
      target_dir: Created if absent; its `config.json` and `model.safetensors` are written.

    Returns:
      The names of the quantized weights.

    Raises:
      ValueError: A quantized weight's sides are not multiples of 128.
    """
    source, target = Path(source_dir), Path(target_dir)
    config_json = json.loads((source / "config.json").read_text())
    quantized = {
        name
        for path, tensor in hf_name_map(read_hf_config(config_json)).items()
        if _quantized_kind(path, tensor) is not None
        for name in tensor.tensor_names()
    }
    tensors: dict[str, np.ndarray] = {}
    with safe_open(str(source / "model.safetensors"), framework="numpy") as handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
            value = handle.get_tensor(name)
            if name not in quantized:
                tensors[name] = value
                continue
            if value.shape[0] % BLOCK or value.shape[1] % BLOCK:
                raise ValueError(
                    f"{name} is {value.shape}; FP8 blocks need both sides multiples of {BLOCK}"
                )
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(value)
    target.mkdir(parents=True, exist_ok=True)
    config_json["quantization_config"] = dict(FP8_CONFIG)
    (target / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    write_safetensors(tensors, target / "model.safetensors")
    return sorted(quantized)


_CODES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    FP8_DTYPE: "F8_E4M3",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
}


def write_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """Writes `tensors` as one safetensors file (FP8 included, which the safetensors numpy
    writer refuses): a little-endian header length, the JSON header padded to 8 bytes, then
    each tensor's bytes in name order."""
    header, offset = {}, 0
    ordered = sorted(tensors)
    for name in ordered:
        value = np.ascontiguousarray(tensors[name])
        header[name] = {
            "dtype": _CODES[value.dtype],
            "shape": list(value.shape),
            "data_offsets": [offset, offset + value.nbytes],
        }
        offset += value.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for name in ordered:
            handle.write(np.ascontiguousarray(tensors[name]).tobytes())
