"""Fused residual add + RMSNorm + FP8 quantization per token group: a quantized read in one pass.

`values, scales, new_residual = quantize(norm(x + residual) * weight), x + residual`: the sum
in float32, the new residual that sum rounded to the residual's dtype, the normalized rows
rounded to `x.dtype` (as the unfused read rounds them) and then quantized per `group` features
(`pallas_kernels.quantize`'s format).

Layout: the reference (the spec), the kernel body (BlockSpec: Triton on GPU, Mosaic TPU, the
interpreter), and the public wrapper. Inference only: FP8 values carry no gradient, so there is
no VJP.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from . import axes
from .add_rms_norm import BlockShape, add_rms_norm_reference, block_shape, whole_blocks
from .impl import SUPPORTED_DTYPES, Impl, check_impl
from .quantize import FP8_DTYPE, quantize_token_groups_reference, store_token_groups
from .rms_norm_common import MAX_HIDDEN_GPU, check_inputs, weight_factor

# ---------------------------------------------------------------------------------------------
# Reference


def add_rms_norm_quantize_reference(
    x: jax.Array,  # [rows, hidden]
    residual: jax.Array,  # [rows, hidden], x's dtype
    weight: jax.Array,  # [hidden]
    *,
    eps: float = 1e-6,
    unit_offset: bool = False,
    group: int = 128,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The specification of `add_rms_norm_quantize`: `add_rms_norm_reference`, then
    `quantize_token_groups_reference` of its normalized output.

    Returns:
      `(values, scales, new_residual)`: float8_e4m3fn [rows, hidden], float32 [rows, hidden /
      group], and the float32 sum rounded to `x.dtype`.
    """
    normed, summed = add_rms_norm_reference(x, residual, weight, eps=eps, unit_offset=unit_offset)
    values, scales = quantize_token_groups_reference(normed, group)
    return values, scales, summed


# ---------------------------------------------------------------------------------------------
# Kernel body


def _add_rms_norm_quantize_kernel(
    x_ref,
    residual_ref,
    weight_ref,
    values_ref,
    scales_ref,
    residual_out_ref,
    *,
    hidden: int,
    eps: float,
    unit_offset: bool,
    group: int,
):
    """One [block_rows, block_hidden] block; lanes past `hidden` (Triton padding) are masked.

    The arithmetic is the reference's, in its order, so a run in the interpreter equals it bit
    for bit."""
    summed = x_ref[...].astype(jnp.float32) + residual_ref[...].astype(jnp.float32)
    residual_out_ref[...] = summed.astype(residual_out_ref.dtype)
    rows, width = summed.shape
    if width != hidden:
        lanes = lax.broadcasted_iota(jnp.int32, summed.shape, 1)
        summed = jnp.where(lanes < hidden, summed, 0.0)
    mean_square = jnp.sum(summed * summed, axis=1, keepdims=True) / hidden
    scale = weight_factor(weight_ref[...], unit_offset=unit_offset)
    normed = (summed * lax.rsqrt(mean_square + eps) * scale).astype(x_ref.dtype)
    store_token_groups(normed.astype(jnp.float32), group, values_ref, scales_ref)


# ---------------------------------------------------------------------------------------------
# Public wrapper


def add_rms_norm_quantize_supported(
    *,
    platform: str,
    rows: int,
    hidden: int,
    dtype: jnp.dtype,
    group: int = 128,
    impl: Impl | None = None,
) -> bool:
    """Whether a fused Pallas kernel takes this call; pure Python, no side effects.

    Args:
      platform: Where it would run, as `jax.default_backend()` names it.
      rows: Rows of the input.
      hidden: The normalized (last) dimension.
      dtype: The dtype of `x` and `residual`.
      group: Features per scale.
      impl: A backend to ask about; None asks about the platform's own kernel (Triton on GPU,
        Mosaic TPU on TPU; none on CPU).

    Returns:
      True when `add_rms_norm_quantize(..., impl=impl)` would run a Pallas kernel (for
      `Impl.XLA`: always, given a shape the format takes).
    """
    check_impl(impl)
    if impl is None:
        impl = _platform_kernel(platform)
        if impl is Impl.XLA:
            return False
    if np.dtype(dtype) not in SUPPORTED_DTYPES or rows < 1 or hidden < 1 or hidden % group:
        return False
    match impl:
        case Impl.XLA | Impl.PALLAS_INTERPRET:
            return True
        case Impl.PALLAS_TRITON:
            # Triton tensors have power-of-two sides: the groups of a padded row must be too.
            return (
                platform in ("gpu", "cuda")
                and hidden <= MAX_HIDDEN_GPU
                and group == pl.next_power_of_2(group)
            )
        case Impl.PALLAS_TPU:
            return platform == "tpu" and group % 128 == 0
        case _:
            return False


def _platform_kernel(platform: str) -> Impl:
    match platform:
        case "gpu" | "cuda":
            return Impl.PALLAS_TRITON
        case "tpu":
            return Impl.PALLAS_TPU
        case _:
            return Impl.XLA


@functools.partial(jax.jit, static_argnames=("eps", "unit_offset", "group", "impl", "blocks"))
def add_rms_norm_quantize(
    x: jax.Array,  # [rows, hidden]
    residual: jax.Array,  # like x
    weight: jax.Array,  # [hidden]
    *,
    eps: float = 1e-6,
    unit_offset: bool = False,
    group: int = 128,
    impl: Impl | None = None,
    blocks: BlockShape | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Adds `x` to the residual, RMS-normalizes the sum and quantizes it, in one pass.

    Args:
      x: The stage output, float32, bfloat16 or float16, [rows, hidden].
      residual: The residual stream (x's shape and dtype).
      weight: The norm's scale, any floating dtype.
      eps: Added to the mean of squares.
      unit_offset: Scale by `1 + weight` instead of `weight` (the weight holds its offset from
        one, as Gemma's norms store it).
      group: Features per scale; must divide `hidden`.
      impl: The backend. None picks the platform's kernel (Triton on GPU, Mosaic TPU on TPU)
        where `add_rms_norm_quantize_supported` says it takes the shape, else the XLA reference.
      blocks: The grid blocking (`add_rms_norm.block_shape` by default: the tuned add + RMSNorm
        blocks).

    Returns:
      `(values, scales, new_residual)` as `add_rms_norm_quantize_reference` (the spec) gives
      them. Inside `shard_map` each varies over the mesh axes the reference's would. Not
      differentiable (inference only).

    Raises:
      TypeError: Bad dtypes or a non-`Impl` impl.
      ValueError: Bad shapes, eps, or a group that does not divide the rows.
      NotImplementedError: An explicit `impl` that cannot run this call on this platform.
    """
    check_inputs(x, residual, weight, eps=eps)
    check_impl(impl)
    if x.ndim != 2 or x.shape[1] % group:
        raise ValueError(
            f"x must be [rows, hidden] with hidden a multiple of group={group}; got {x.shape=}"
        )
    rows, hidden = x.shape
    platform = jax.default_backend()
    if impl is None:
        supported = add_rms_norm_quantize_supported(
            platform=platform, rows=rows, hidden=hidden, dtype=x.dtype, group=group
        )
        impl = _platform_kernel(platform) if supported else Impl.XLA
    elif not add_rms_norm_quantize_supported(
        platform=platform, rows=max(rows, 1), hidden=hidden, dtype=x.dtype, group=group, impl=impl
    ):
        raise NotImplementedError(
            f"{impl} cannot run add_rms_norm_quantize on {platform=} with {x.shape=}, "
            f"{x.dtype=}, {group=}; check add_rms_norm_quantize_supported() first, or pass "
            "impl=None to fall back to XLA."
        )
    reference = functools.partial(
        add_rms_norm_quantize_reference, eps=eps, unit_offset=unit_offset, group=group
    )
    if impl is Impl.XLA or rows == 0:
        return reference(x, residual, weight)
    kernel = functools.partial(
        _pallas_call, eps=eps, unit_offset=unit_offset, group=group, impl=impl, blocks=blocks
    )
    if impl is Impl.PALLAS_INTERPRET:
        kernel = axes.interpreted(kernel, reference)
    return kernel(x, residual, weight)


def _pallas_call(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    unit_offset: bool,
    group: int,
    impl: Impl,
    blocks: BlockShape | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    rows, hidden = x.shape
    blocks = blocks or block_shape(impl, rows, hidden, x.dtype)
    if blocks.block_hidden % group:
        raise ValueError(f"{blocks=} must hold whole groups of {group} features")
    groups_per_block = blocks.block_hidden // group
    row_block = pl.BlockSpec((blocks.block_rows, blocks.block_hidden), lambda i: (i, 0))
    scale_block = pl.BlockSpec((blocks.block_rows, groups_per_block), lambda i: (i, 0))
    weight_block = pl.BlockSpec((1, blocks.block_hidden), lambda i: (0, 0))
    reference = functools.partial(
        add_rms_norm_quantize_reference, eps=eps, unit_offset=unit_offset, group=group
    )
    varying = axes.reference_varying(reference, x, residual, weight)
    weight, x, residual = whole_blocks(impl, blocks, weight, x, residual)
    shapes = (x.shape, (x.shape[0], x.shape[1] // group), x.shape)
    dtypes = (FP8_DTYPE, jnp.float32, x.dtype)
    out_shape = tuple(map(axes.output_type, shapes, dtypes, varying))
    match impl:
        case Impl.PALLAS_TRITON:
            compiler_params = pltriton.CompilerParams(num_warps=blocks.num_warps)
        case Impl.PALLAS_TPU:
            compiler_params = pltpu.CompilerParams(dimension_semantics=("parallel",))
        case _:
            compiler_params = None
    call = pl.pallas_call(
        functools.partial(
            _add_rms_norm_quantize_kernel,
            hidden=hidden,
            eps=eps,
            unit_offset=unit_offset,
            group=group,
        ),
        out_shape=out_shape,
        grid=(math.ceil(rows / blocks.block_rows),),
        in_specs=[row_block, row_block, weight_block],
        out_specs=(row_block, scale_block, row_block),
        compiler_params=compiler_params,
        interpret=impl is Impl.PALLAS_INTERPRET,
    )
    values, scales, summed = call(x, residual, weight)
    return values[:rows, :hidden], scales[:rows, : hidden // group], summed[:rows, :hidden]
