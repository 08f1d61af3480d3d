"""FP8 linear layers: Hugging Face fine-grained FP8 weights multiplied by FP8 rows, float32 sums.

A weight is stored as Hugging Face stores it: [out, in] float8_e4m3fn values (`weight`) with one
float32 scale per 128 x 128 block (`weight_scale_inv`: values * scale gives the weight back).
The input rows are quantized per 128-feature token group (`bj.designs.Fp8TokenGroups`): a stage
whose read quantizes hands its projections a `bj.designs.Quantized`; any other input (attention
output into o_proj, the gated activation into down_proj) is quantized here. The product runs
through `pallas_kernels.fp8_matmul` (the XLA reference on CPU; on GPU the Triton kernel for up to
16 rows, the warp-specialized Mosaic GPU kernel above).

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
from flax import nnx
from jax import lax

from boundary_jax import SumGroup, Topology
from boundary_jax.designs import Fp8TokenGroups, Quantized
from boundary_jax.initializers import Normal, param
from pallas_kernels.fp8_matmul import (
    SCALE_BLOCK,
    Fp8GroupedImpl,
    Fp8MatmulImpl,
    default_fp8_grouped_impl,
    default_fp8_matmul_impl,
    fp8_matmul,
)
from pallas_kernels.impl import Impl
from pallas_kernels.quantize import FP8_DTYPE, dequantize_blocks_reference
from pallas_kernels.quantize_rows import Activation, quantize_rows

from .linear import group_size, weight_init


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
    Hugging Face fine-grained FP8 checkpoints). Attention and dense FFN stages read
    their input quantized (`bj.designs.AddNormRead(quantize=...)`); a sparse FFN reads it
    unquantized (its router takes it) and quantizes the rows it sends its experts.

    Attributes:
      weights: What the layers hold (`Fp8Weights`).
      matmul: How the projections' FP8 products run (`pallas_kernels.fp8_matmul`).
      grouped: How the experts' grouped FP8 products run.
      rows: How rows are quantized for the projections (`pallas_kernels.quantize_rows`): a
        backend, or None for its pick (the kernel on GPU from `KERNEL_MIN_ROWS` rows, XLA
        elsewhere).
    """

    weights: Fp8Weights = Fp8Weights.FP8
    matmul: Fp8MatmulImpl = Fp8MatmulImpl.XLA
    grouped: Fp8GroupedImpl = Fp8GroupedImpl.XLA
    rows: Impl | None = Impl.XLA

    @classmethod
    def for_platform(cls, platform: str, weights: Fp8Weights = Fp8Weights.FP8) -> Fp8Quantization:
        """FP8 weights with the products a JAX platform name runs fastest: the Pallas kernels
        by size on GPU, XLA elsewhere; rows quantized as `quantize_rows` picks by platform and
        size."""
        return cls(
            weights, default_fp8_matmul_impl(platform), default_fp8_grouped_impl(platform), None
        )

    @property
    def activations(self) -> Fp8TokenGroups:
        """The input format of every FP8 projection: 128-feature token groups."""
        return Fp8TokenGroups(SCALE_BLOCK)

    def quantize(self, x: jax.Array, activation: Activation | None = None) -> Quantized:
        """Rows in the projections' input format, after `activation`: `x` [T, features], or
        [T, 2, features] for `activation(gate) * up` (`pallas_kernels.quantize_rows`, one pass
        through `rows`)."""
        group = self.activations.group
        return Quantized(*quantize_rows(x, activation=activation, group=group, impl=self.rows))


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


VALUE_SPREAD = 64.0
"""The standard deviation of random FP8 values (`Fp8BlockValues`): far inside e4m3's range (448),
so no draw clips, and well above its subnormals."""


def block_scales(std: float, shape: tuple[int, ...]) -> jax.Array:
    """The scales of a random FP8 weight, [..., out / 128, in / 128] float32: `std /
    VALUE_SPREAD` times 1/2, 1 or 2 by the block's place (a power of two, so values times scales
    are exact), so a scale read for the wrong block changes the product."""
    place = sum(
        (axis + 1) * lax.broadcasted_iota(jnp.int32, shape, axis) for axis in range(len(shape))
    )
    return jnp.float32(std / VALUE_SPREAD) * jnp.exp2((place % 3 - 1).astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class Fp8BlockValues:
    """The values of a random weight [..., out, in] quantized per 128 x 128 block (an
    `initializers.Initializer`): N(0, VALUE_SPREAD^2) draws rounded to float8_e4m3fn, their
    block's scale `block_scales(std, ...)`; with `dequantized`, the values times those scales in
    the parameter's dtype (`Fp8Weights.DEQUANTIZED`, the same weight for the same key).

    The scales are a function of the block's place, not drawn: a model's parameters are drawn
    each from its own key (`models.weights.initialization`), so a scale parameter cannot see the
    draw of its weight.

    Attributes:
      std: The scale of the weight's values (`block_scales`).
      dequantized: Return `values * scales` rather than the values.
    """

    std: float
    dequantized: bool = False

    def __call__(self, key: jax.Array | None, shape: tuple[int, ...], dtype) -> jax.Array:
        if key is None:
            raise TypeError(f"{self} draws random values; pass a key (or rngs to `param`)")
        check_blocks(shape[-2], 1, "out features")
        check_blocks(shape[-1], 1, "in features")
        drawn = jax.random.normal(key, shape, jnp.float32) * VALUE_SPREAD
        values = drawn.astype(FP8_DTYPE)
        if not self.dequantized:
            return values.astype(dtype)
        scales = block_scales(self.std, _scale_shape(shape))
        return dequantize_blocks_reference(values, scales, dtype)


@dataclasses.dataclass(frozen=True)
class Fp8BlockScales:
    """The float32 block scales of an `Fp8BlockValues` weight (`block_scales`); the parameter's
    shape is [..., out / 128, in / 128]. Drawn from nothing: the key is ignored.

    Attributes:
      std: As the weight's `Fp8BlockValues.std`.
    """

    std: float

    def __call__(self, key: jax.Array | None, shape: tuple[int, ...], dtype) -> jax.Array:
        del key
        return block_scales(self.std, shape).astype(dtype)


def fp8_weight(
    shape: tuple[int, ...],
    sharding: tuple,
    *,
    std: float,
    quantization: Fp8Quantization,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
) -> tuple[nnx.Param, nnx.Param | None]:
    """A random FP8 weight [..., out, in] split as `sharding` says, as parameters that keep
    their initializers: `(values, scales)` (float8_e4m3fn, float32 [..., out / 128, in / 128]
    split alike), or under DEQUANTIZED `(values * scales in dtype, None)`."""
    if quantization.weights is Fp8Weights.DEQUANTIZED:
        values = Fp8BlockValues(std, dequantized=True)
        return param(values, shape, dtype, rngs=rngs, sharding=sharding), None
    values = param(Fp8BlockValues(std), shape, FP8_DTYPE, rngs=rngs, sharding=sharding)
    scales = param(Fp8BlockScales(std), _scale_shape(shape), jnp.float32, sharding=sharding)
    return values, scales


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], shape[-2] // SCALE_BLOCK, shape[-1] // SCALE_BLOCK)


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

    Random weights are `Fp8BlockValues` with their `Fp8BlockScales` at std `init_std` (None:
    1/sqrt(in_features)), the bias N(0, std^2).
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
        init_std: float | None = None,
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
        std = weight_init(init_std, in_features).std
        self.weight, self.weight_scale_inv = fp8_weight(
            (*stacked, out_features, in_features),
            spec,
            std=std,
            quantization=quantization,
            dtype=dtype,
            rngs=rngs,
        )
        # Drawn like the weight where Hugging Face draws zeros: a dropped or mis-sharded bias
        # shows.
        self.bias = (
            param(
                Normal(std),
                (*stacked, out_features),
                dtype,
                rngs=rngs,
                sharding=(*lead, entry if split is Split.COLUMNS else None),
            )
            if bias
            else None
        )
        self.group = group
        self.split = split
        self.quantization = quantization
        self.out_dtype = jnp.dtype(dtype)

    def __call__(self, x: jax.Array | Quantized, *, counts_bias: None = None) -> jax.Array:
        """[T, local in] rows (or their `Quantized` form) -> [T, local out] (with parts, [T,
        parts, local out]) in the model's dtype; a partial sum when the rows are split.

        `counts_bias` is `RowParallelLinear`'s, so a layer calls either alike: None, since an
        FP8 row projection carries no bias (a column projection's bias is split, not
        replicated).
        """
        if counts_bias is not None:
            raise ValueError(f"an FP8 projection holds no replicated bias; got {counts_bias=}")
        scales = None if self.weight_scale_inv is None else self.weight_scale_inv[...]
        bias = None if self.bias is None else self.bias[...]
        return self._project(x, self.weight[...], scales, bias)

    def of_activation(self, x: jax.Array, activation: Activation) -> jax.Array:
        """The projection of `activation(x)` ([T, local in]), or of `activation(gate) * up`
        for [T, 2, local in]: the activation and the quantization in one pass."""
        return self(self.quantization.quantize(x, activation))

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
        rows = x if isinstance(x, Quantized) else self.quantization.quantize(x)
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
        init_std: float | None = None,
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
            init_std=init_std,
            rngs=rngs,
        )

    def row(
        self,
        in_features: int,
        out_features: int,
        *,
        group: SumGroup,
        topology: Topology,
        bias: bool = False,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ) -> Fp8Linear:
        """A row-parallel projection (input features split over `group`; a partial sum).

        Raises:
          NotImplementedError: `bias` (FP8 row projections carry none).
        """
        if bias:
            raise NotImplementedError(
                "an FP8 row-parallel projection with a bias is not built; load the model "
                "without FP8 quantization"
            )
        return Fp8Linear(
            in_features,
            out_features,
            split=Split.ROWS,
            group=group,
            topology=topology,
            quantization=self.quantization,
            dtype=dtype,
            init_std=init_std,
            rngs=rngs,
        )
