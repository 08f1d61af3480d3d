"""FP8 linear layers: Hugging Face fine-grained FP8 weights multiplied by FP8 rows, float32 sums.

A weight is stored as Hugging Face stores it: [out, in] float8_e4m3fn values (`weight`) with one
float32 scale per 128 x 128 block (`weight_scale_inv`: values * scale gives the weight back).
The input rows are quantized per 128-feature token group (`bj.designs.Fp8TokenGroups`): a stage
whose read quantizes hands its projections a `bj.designs.Quantized`; any other input (attention
output into o_proj, the gated activation into down_proj) is quantized here. The product runs
through `pallas_kernels.fp8_matmul` (the XLA reference on CPU, the Triton decode and Mosaic GPU
prefill kernels on GPU).

A split over ranks must fall on block edges: every rank's share of a split axis is a multiple of
128, so each rank holds whole blocks and their scales and quantizes whole token groups (the
same groups whatever the mesh). A layer built otherwise raises when it is made.

`Fp8Weights.DEQUANTIZED` builds the same layers holding `values * scales` in the model's dtype,
quantizing and dequantizing their inputs the same way: in float64 it is the reference an FP8
model is checked against. FP8 weights are for inference: nothing here is trained.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from boundary_jax import SumGroup, Topology
from boundary_jax.designs import Fp8TokenGroups, Quantized
from pallas_kernels.fp8_matmul import (
    SCALE_BLOCK,
    Fp8GroupedImpl,
    Fp8MatmulImpl,
    default_fp8_grouped_impl,
    default_fp8_matmul_impl,
    fp8_matmul,
)
from pallas_kernels.quantize import dequantize_blocks_reference, quantize_blocks_reference

from .linear import group_size, sharded_param


class Fp8Weights(enum.Enum):
    """What an FP8 layer holds.

    FP8: float8_e4m3fn values and float32 block scales; the product runs on FP8 inputs.
    DEQUANTIZED: the values times their scales in the model's dtype, inputs quantized and
      dequantized as FP8 would see them: the reference (in float64) for tests.
    """

    FP8 = "fp8"
    DEQUANTIZED = "dequantized"


@dataclasses.dataclass(frozen=True)
class Fp8Quantization:
    """A decoder's FP8 option: block-quantized projection weights, FP8 rows into them.

    The attention projections, the dense MLP and the routed experts are quantized; the
    embedding, the LM head, the norms and MoE routers stay in the model's dtype (as in the
    Hugging Face FP8 checkpoints of Qwen3 and DeepSeek-V3). Attention and dense FFN stages read
    their input quantized (`bj.designs.AddNormRead(quantize=...)`); a sparse FFN reads it
    unquantized (its router takes it) and quantizes the rows it sends its experts.

    Attributes:
      weights: What the layers hold (`Fp8Weights`).
      matmul: How the projections' FP8 products run (`pallas_kernels.fp8_matmul`).
      grouped: How the experts' grouped FP8 products run.
    """

    weights: Fp8Weights = Fp8Weights.FP8
    matmul: Fp8MatmulImpl = Fp8MatmulImpl.XLA
    grouped: Fp8GroupedImpl = Fp8GroupedImpl.XLA

    @classmethod
    def for_platform(cls, platform: str, weights: Fp8Weights = Fp8Weights.FP8) -> Fp8Quantization:
        """FP8 weights with the products a JAX platform name runs fastest: the Pallas kernels
        by size on GPU, XLA elsewhere."""
        return cls(weights, default_fp8_matmul_impl(platform), default_fp8_grouped_impl(platform))

    @property
    def activations(self) -> Fp8TokenGroups:
        """The input format of every FP8 projection: 128-feature token groups."""
        return Fp8TokenGroups(SCALE_BLOCK)


class Split(enum.Enum):
    """Which axis of a tensor-parallel weight is split over its group."""

    COLUMNS = "out features"  # the output is complete on each rank (column parallel)
    ROWS = "in features"  # the output is a partial sum (row parallel)


def check_blocks(size: int, ranks: int, what: str) -> None:
    """Raises a ValueError unless `size` features split over `ranks` give every rank whole
    128-feature blocks (their scales cannot be cut)."""
    if size % SCALE_BLOCK or (size // ranks) % SCALE_BLOCK or size % ranks:
        raise ValueError(
            f"FP8 weights are quantized in {SCALE_BLOCK} x {SCALE_BLOCK} blocks, so each rank "
            f"must hold whole blocks: {what} ({size}) over {ranks} ranks gives {size / ranks:g} "
            f"per rank, which splits a block. Use fewer ranks for this group (or a model whose "
            f"widths are multiples of {SCALE_BLOCK} x ranks)"
        )


def quantized_normal(
    rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, quantization: Fp8Quantization, dtype
) -> tuple[jax.Array, jax.Array | None]:
    """N(0, 1/fan_in) weights [..., out, in] quantized per block: `(values, scales)`, or under
    DEQUANTIZED `(values * scales in dtype, None)`; drawn in float32, so every mesh and both
    weight kinds get the same blocks."""
    weight = jax.random.normal(rngs.params(), shape, jnp.float32) / np.sqrt(fan_in)
    values, scales = quantize_blocks_reference(weight, SCALE_BLOCK)
    if quantization.weights is Fp8Weights.DEQUANTIZED:
        return dequantize_blocks_reference(values, scales, dtype), None
    return values, scales


class Fp8Linear(nnx.Module):
    """A tensor-parallel projection with FP8 block weights; like `ColumnParallelLinear` (output
    features split, complete output) or `RowParallelLinear` (input features split, partial sum
    owed over `group`), as `split` says. It never sums.

    Attributes:
      weight: [out, in] global (with parts, [parts, out, in]: projections of one input stacked,
        one matmul) float8_e4m3fn, or the model's dtype under DEQUANTIZED; split over `group`
        on the axis `split` names.
      weight_scale_inv: [out / 128, in / 128] (with parts, [parts, ...]) float32, split like
        the weight; None under DEQUANTIZED.
      bias: [out] (with parts, [parts, out]) in the model's dtype, split with the columns; None
        without one.
      group: The group the split axis divides over; None keeps the weight whole.
      split: Which axis is split.
      quantization: The FP8 option (weights held, matmul).
      out_dtype: The dtype of the output (the model's).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        split: Split,
        group: SumGroup | None,
        topology: Topology,
        quantization: Fp8Quantization,
        parts: int | None = None,
        bias: bool = False,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        ranks = group_size(topology, group)
        whole = Split.ROWS if split is Split.COLUMNS else Split.COLUMNS
        sizes = {Split.COLUMNS: out_features, Split.ROWS: in_features}
        check_blocks(sizes[split], ranks, split.value)
        check_blocks(sizes[whole], 1, whole.value)
        entry = None if group is None else topology.shard_entry(group)
        stacked = () if parts is None else (parts,)
        lead = tuple(None for _ in stacked)
        spec = (*lead, entry, None) if split is Split.COLUMNS else (*lead, None, entry)
        values, scales = quantized_normal(
            rngs, (*stacked, out_features, in_features), in_features, quantization, dtype
        )
        self.weight = sharded_param(values, spec)
        self.weight_scale_inv = None if scales is None else sharded_param(scales, spec)
        # N(0, 1/4) (Hugging Face draws zeros): a dropped or mis-sharded bias shows.
        self.bias = (
            sharded_param(
                (0.5 * jax.random.normal(rngs.params(), (*stacked, out_features))).astype(dtype),
                (*lead, entry if split is Split.COLUMNS else None),
            )
            if bias
            else None
        )
        self.group = group
        self.split = split
        self.quantization = quantization
        self.out_dtype = jnp.dtype(dtype)

    def __call__(self, x: jax.Array | Quantized) -> jax.Array:
        """[T, local in] rows (or their `Quantized` form) -> [T, local out] (with parts, [T,
        parts, local out]) in the model's dtype; a partial sum when the rows are split."""
        scales = None if self.weight_scale_inv is None else self.weight_scale_inv[...]
        bias = None if self.bias is None else self.bias[...]
        return self._project(x, self.weight[...], scales, bias)

    def columns(self, x: jax.Array | Quantized, start: jax.Array, size: int) -> jax.Array:
        """Only this rank's output columns [start, start + size) of each part (`start` may be
        traced; both multiples of 128): e.g. the one kv head a rank computes where the kv
        heads are shared across ranks."""
        check_blocks(size, 1, "a column slice")
        weight = lax.dynamic_slice_in_dim(self.weight[...], start, size, axis=-2)
        scales = None
        if self.weight_scale_inv is not None:
            scales = lax.dynamic_slice_in_dim(
                self.weight_scale_inv[...], start // SCALE_BLOCK, size // SCALE_BLOCK, axis=-2
            )
        bias = None
        if self.bias is not None:
            bias = lax.dynamic_slice_in_dim(self.bias[...], start, size, axis=-1)
        return self._project(x, weight, scales, bias)

    def _project(self, x, weight, scales, bias) -> jax.Array:
        rows = x if isinstance(x, Quantized) else self.quantization.activations.quantize(x)
        *lead, out, depth = weight.shape
        flat = weight.reshape(-1, depth)
        if scales is None:  # DEQUANTIZED: the reference, in the model's dtype
            y = lax.dot_general(
                rows.dequantize(self.out_dtype),
                flat.astype(self.out_dtype),
                (((1,), (1,)), ((), ())),
                precision=lax.Precision.HIGHEST,
            )
        else:
            y = fp8_matmul(
                rows.values,
                rows.scales,
                flat,
                scales.reshape(-1, depth // SCALE_BLOCK),
                out_dtype=self.out_dtype,
                impl=self.quantization.matmul,
            )
        y = y.reshape(y.shape[0], *lead, out)
        return y if bias is None else y + bias[None].astype(y.dtype)


@dataclasses.dataclass(frozen=True)
class Fp8Linears:
    """Makes a layer's tensor-parallel projections with FP8 block weights (`Fp8Linear`); the
    same calls as `linear.DenseLinears`.

    Attributes:
      quantization: The FP8 option every projection gets.
    """

    quantization: Fp8Quantization

    def column(
        self,
        in_features: int,
        out_features: int,
        *,
        group: SumGroup | None,
        topology: Topology,
        parts: int | None = None,
        bias: bool = False,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> Fp8Linear:
        """A column-parallel projection (output features split over `group`)."""
        return Fp8Linear(
            in_features,
            out_features,
            split=Split.COLUMNS,
            group=group,
            topology=topology,
            quantization=self.quantization,
            parts=parts,
            bias=bias,
            dtype=dtype,
            rngs=rngs,
        )

    def row(
        self,
        in_features: int,
        out_features: int,
        *,
        group: SumGroup,
        topology: Topology,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> Fp8Linear:
        """A row-parallel projection (input features split over `group`; a partial sum)."""
        return Fp8Linear(
            in_features,
            out_features,
            split=Split.ROWS,
            group=group,
            topology=topology,
            quantization=self.quantization,
            dtype=dtype,
            rngs=rngs,
        )
