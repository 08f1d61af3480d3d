"""MXFP4 checkpoints (transformers' `quant_method: "mxfp4"`, as the released GPT-OSS checkpoints
store their experts): reading them onto a mesh, dequantized, and writing one.

The format (transformers' `integrations/mxfp4.py`, `convert_moe_packed_tensors`): a quantized
tensor `X` of [*lead, rows, columns] (an expert stack's [experts, out, in]) is stored as

    X_blocks: uint8 [*lead, rows, columns / 32, 16]   two e2m1 values a byte: element 2j in the
                                                       low nibble, 2j + 1 in the high one
    X_scales: uint8 [*lead, rows, columns / 32]       e8m0: the 32 values' scale is
                                                       2 ** (scale - 127)

and means `X = e2m1 * scale`, transposed on its last two axes: [*lead, columns, rows], the
[experts, in, out] layout transformers' GPT-OSS experts multiply by (`mlp.experts.gate_up_proj`
[experts, hidden, 2 x width], `down_proj` [experts, width, hidden]). The loader sees each such
pair as that one float tensor (`Mxfp4Tensors`): every device reads only the blocks and scales of
its shard (its experts, its rows, the 32-value groups covering its columns) and dequantizes them
to the model's dtype (exact: every e2m1 value times a power of two fits in bfloat16).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

MXFP4_METHOD = "mxfp4"
GROUP = 32
"""Values per e8m0 scale (and per 16 bytes of blocks)."""
SCALE_BIAS = 127
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
"""The e2m1 value of each 4-bit code: sign bit, two exponent bits, one mantissa bit."""
BLOCKS, SCALES = "_blocks", "_scales"
QUANTIZED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""The tensors (by name suffix) the released MXFP4 checkpoints quantize: the routed experts'."""
MXFP4_CONFIG = {
    "quant_method": MXFP4_METHOD,
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
"""The `quantization_config` of a released GPT-OSS checkpoint, as `write_mxfp4_checkpoint`
writes it."""


def stored_mxfp4(checkpoint_dir: str | Path) -> bool:
    """Whether a checkpoint directory's `config.json` declares MXFP4 weights."""
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    quantization = config.get("quantization_config") or {}
    return quantization.get("quant_method") == MXFP4_METHOD


def dequantize_mxfp4(
    blocks: np.ndarray, scales: np.ndarray, dtype: np.dtype = np.float32
) -> np.ndarray:
    """The values MXFP4 `blocks` and `scales` encode, as transformers' `convert_moe_packed_
    tensors` lays them out.

    Args:
      blocks: uint8 [*lead, rows, groups, 16].
      scales: uint8 [*lead, rows, groups].
      dtype: The result's dtype.

    Returns:
      [*lead, groups * 32, rows]: the dequantized rows, their last two axes swapped.

    Raises:
      ValueError: The shapes do not fit.
    """
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[-1:] != (GROUP // 2,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks must be [..., groups, {GROUP // 2}] over scales [..., groups]; got "
            f"{blocks.shape=}, {scales.shape=}"
        )
    pairs = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)
    exponents = scales.astype(np.int32)[..., None] - SCALE_BIAS
    values = np.ldexp(pairs.reshape(*scales.shape, GROUP), exponents)
    values = values.reshape(*scales.shape[:-1], scales.shape[-1] * GROUP)
    return np.ascontiguousarray(np.swapaxes(values, -1, -2), dtype)


def quantize_mxfp4(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 blocks and scales of `values` [*lead, columns, rows] (columns a multiple of 32):
    each 32 consecutive columns of a row share the smallest power-of-two scale that brings
    their largest magnitude within e2m1's 6, and each value rounds to the nearest e2m1 value.
    `dequantize_mxfp4` reads them back.

    Returns:
      (uint8 blocks [*lead, rows, columns / 32, 16], uint8 scales [*lead, rows, columns / 32]).

    Raises:
      ValueError: `columns` is not a multiple of 32, or a value is not finite.
    """
    rows_major = np.swapaxes(np.asarray(values, np.float32), -1, -2)
    *lead, rows, columns = rows_major.shape
    if columns % GROUP or not np.all(np.isfinite(rows_major)):
        raise ValueError(
            f"MXFP4 groups {GROUP} finite values along the columns; got shape "
            f"{np.shape(values)} (columns {columns} on axis -2)"
        )
    groups = rows_major.reshape(*lead, rows, columns // GROUP, GROUP)
    largest = np.max(np.abs(groups), axis=-1)
    exponent = np.ceil(np.log2(np.where(largest > 0, largest, 1.0) / FP4_VALUES[7]))
    exponent = np.clip(exponent, -SCALE_BIAS, SCALE_BIAS).astype(np.int32)
    scaled = groups / np.ldexp(np.float32(1), exponent)[..., None]
    magnitudes = FP4_VALUES[:8]
    codes = np.argmin(np.abs(np.abs(scaled)[..., None] - magnitudes), axis=-1).astype(np.uint8)
    codes |= np.where((scaled < 0) & (codes > 0), np.uint8(8), np.uint8(0))
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = exponent + SCALE_BIAS
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(scales, np.uint8)


@dataclasses.dataclass(frozen=True)
class Mxfp4Tensors:
    """The MXFP4 tensors of a checkpoint, each seen as the float tensor it encodes.

    Attributes:
      pairs: Each encoded tensor's name (`X`) and its stored (`X_blocks`, `X_scales`).
    """

    pairs: dict[str, tuple[str, str]]

    @classmethod
    def of(cls, names: Iterable[str]) -> Mxfp4Tensors:
        """The pairs among a checkpoint's tensor `names` (an `X_blocks` beside an `X_scales`)."""
        names = set(names)
        found = {
            name.removesuffix(BLOCKS): (name, name.removesuffix(BLOCKS) + SCALES)
            for name in names
            if name.endswith(BLOCKS) and name.removesuffix(BLOCKS) + SCALES in names
        }
        return cls(found)

    def names(self, stored: Iterable[str]) -> list[str]:
        """`stored` with each blocks / scales pair replaced by the name of what it encodes."""
        hidden = {name for pair in self.pairs.values() for name in pair}
        return [name for name in stored if name not in hidden] + sorted(self.pairs)

    def shape(self, name: str, stored_shape: Callable[[str], tuple[int, ...]]) -> tuple[int, ...]:
        """The encoded tensor's shape [*lead, columns, rows] (`stored_shape` of a stored name)."""
        *lead, rows, groups, _ = stored_shape(self.pairs[name][0])
        return (*lead, groups * GROUP, rows)

    def read(
        self,
        name: str,
        index: tuple[slice, ...],
        read_stored: Callable[[str, tuple[slice, ...]], np.ndarray],
    ) -> np.ndarray:
        """The block `index` (slices with explicit bounds, step 1) of the encoded tensor, in
        float32: reads only the stored rows of `index`'s last slice and the 32-value groups
        covering its columns (`read_stored` reads a block of a stored tensor)."""
        blocks_name, scales_name = self.pairs[name]
        *lead, columns, rows = index
        first, stop = columns.start // GROUP, -(-columns.stop // GROUP)
        groups = slice(first, stop)
        blocks = read_stored(blocks_name, (*lead, rows, groups, slice(None)))
        scales = read_stored(scales_name, (*lead, rows, groups))
        values = dequantize_mxfp4(blocks, scales)  # [*lead, group columns, rows]
        offset = first * GROUP
        return values[..., columns.start - offset : columns.stop - offset, :]


def write_mxfp4_checkpoint(source_dir: str | Path, target_dir: str | Path) -> list[str]:
    """Writes the released MXFP4 form of a float checkpoint: every tensor named `QUANTIZED`
    becomes its `_blocks` and `_scales` in the same file, the other tensors are copied as
    stored, the weights files keep their names (an index is rewritten with the new names), other
    files are copied, and `config.json` gains `quantization_config` (`MXFP4_CONFIG`).

    Args:
      source_dir: A checkpoint directory (`model.safetensors`, or an index and its files).
      target_dir: Created if absent.

    Returns:
      The names of the quantized tensors.

    Raises:
      ValueError: A quantized tensor's second-to-last axis is not a multiple of 32.
    """
    source, target = Path(source_dir), Path(target_dir)
    target.mkdir(parents=True, exist_ok=True)
    index_file = source / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    quantized, weight_map = [], {}
    for file in files:
        tensors = {}
        with safe_open(str(source / file), framework="numpy") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                value = handle.get_tensor(name)
                if name.endswith(QUANTIZED):
                    tensors[name + BLOCKS], tensors[name + SCALES] = quantize_mxfp4(value)
                    quantized.append(name)
                else:
                    tensors[name] = value
        # safetensors writes an array's buffer as it lies: C order only.
        tensors = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
        save_file(tensors, str(target / file), metadata={"format": "pt"})
        weight_map |= {name: file for name in tensors}
    if index is not None:
        index = {**index, "weight_map": dict(sorted(weight_map.items()))}
        (target / index_file.name).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = dict(MXFP4_CONFIG)
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for other in source.iterdir():
        if other.is_file() and other.name not in {*files, index_file.name, "config.json"}:
            shutil.copyfile(other, target / other.name)
    return sorted(quantized)
