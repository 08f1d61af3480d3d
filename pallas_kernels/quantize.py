"""FP8 e4m3 quantization per token group: the format's specification, shared by the kernels that
produce it (`add_rms_norm_quantize`) and those that read it (`fp8_matmul`).

A row is cut into groups of `group` consecutive features. A group's scale is its largest
magnitude / 448 (the largest finite e4m3 value) in float32; its values are the features divided
by the scale, rounded to the nearest float8_e4m3fn. `values * scale` gives the features back.

The scale is computed as the maximum times float32(1 / 448): XLA turns a division by a constant
into that product (it differs from the division by one rounding in about half the cases), so
writing it so makes numpy (checkpoints), XLA and the kernels agree bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0
"""The largest finite float8_e4m3fn value."""

FP8_DTYPE = jnp.float8_e4m3fn

INVERSE_FP8_MAX = float(np.float32(1 / FP8_MAX))
"""float32(1 / 448): a group's scale is its maximum times this."""


def quantize_token_groups_reference(
    x: jax.Array,  # [..., features]
    group: int = 128,
) -> tuple[jax.Array, jax.Array]:
    """Quantizes rows per group of `group` features: the specification of the format.

    The group maximum is taken of `x` as given, widened to float32 (float64 stays float64);
    a group of zeros gets scale 0 and values 0.

    Args:
      x: Rows, `features` a multiple of `group`.
      group: Features per scale.

    Returns:
      `(values, scales)`: float8_e4m3fn shaped like `x`, and float32 [..., features / group].

    Raises:
      ValueError: `features` is not a multiple of `group`.
    """
    features = x.shape[-1]
    if features % group:
        raise ValueError(
            f"rows quantized per {group} features need a multiple of {group} features; got "
            f"{x.shape=}. Choose a width that divides into groups"
        )
    acc = jnp.promote_types(x.dtype, jnp.float32)
    groups = x.reshape(*x.shape[:-1], features // group, group).astype(acc)
    scales = (jnp.max(jnp.abs(groups), axis=-1) * INVERSE_FP8_MAX).astype(jnp.float32)
    values = _scaled_values(groups, scales[..., None].astype(acc))
    return values.reshape(x.shape), scales


def _scaled_values(x: jax.Array, scales: jax.Array) -> jax.Array:
    """`x / scales` rounded to float8_e4m3fn (0 where the scale is 0), `scales` broadcast."""
    divisor = jnp.where(scales > 0, scales, jnp.ones((), scales.dtype))
    return jnp.clip(x / divisor, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def store_token_groups(rows: jax.Array, group: int, values_ref, scales_ref) -> None:
    """Inside a kernel: quantizes a float32 block of rows [block_rows, width] per `group`
    features (`quantize_token_groups_reference`'s arithmetic, in its order) and stores the
    values [block_rows, width] and scales [block_rows, width / group] in the refs."""
    block_rows, width = rows.shape
    groups = rows.reshape(block_rows, width // group, group)
    scales = jnp.max(jnp.abs(groups), axis=2) * INVERSE_FP8_MAX
    divisor = jnp.where(scales > 0, scales, 1.0)
    values = jnp.clip(groups / divisor[:, :, None], -FP8_MAX, FP8_MAX)
    values_ref[...] = values.astype(values_ref.dtype).reshape(block_rows, width)
    scales_ref[...] = scales


def dequantize_token_groups_reference(
    values: jax.Array,  # [..., features] float8_e4m3fn
    scales: jax.Array,  # [..., features / group] float32
    dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    """`values * scales` per group, in float32 (wider for float64) cast to `dtype`."""
    acc = jnp.promote_types(dtype, jnp.float32)
    group = values.shape[-1] // scales.shape[-1]
    groups = values.reshape(*scales.shape, group).astype(acc) * scales.astype(acc)[..., None]
    return groups.reshape(values.shape).astype(dtype)


def quantize_blocks_reference(
    w: jax.Array,  # [..., N, K]
    block: int = 128,
) -> tuple[jax.Array, jax.Array]:
    """Quantizes a weight per `block` x `block` square (the Hugging Face fine-grained FP8 weight
    format): each square's scale is its largest magnitude / 448 in float32, its values `w /
    scale` rounded to float8_e4m3fn.

    Args:
      w: [..., N, K] (a Hugging Face Linear weight is [out, in]); N and K multiples of `block`.
      block: The square's side.

    Returns:
      `(values, scales)`: float8_e4m3fn shaped like `w`, and float32 [..., N / block, K /
      block] (Hugging Face's `weight_scale_inv`: values * scale gives the weight back).

    Raises:
      ValueError: N or K is not a multiple of `block`.
    """
    *lead, n, k = w.shape
    if n % block or k % block:
        raise ValueError(
            f"a weight quantized per {block} x {block} block needs both sides multiples of "
            f"{block}; got {w.shape=}"
        )
    acc = jnp.promote_types(w.dtype, jnp.float32)
    squares = w.reshape(*lead, n // block, block, k // block, block).astype(acc)
    scales = (jnp.max(jnp.abs(squares), axis=(-3, -1)) * INVERSE_FP8_MAX).astype(jnp.float32)
    values = _scaled_values(squares, scales[..., :, None, :, None].astype(acc))
    return values.reshape(w.shape), scales


def dequantize_blocks_reference(
    values: jax.Array,  # [..., N, K] float8_e4m3fn
    scales: jax.Array,  # [..., N / block, K / block] float32
    dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    """`values * scales` per square block, in float32 (wider for float64) cast to `dtype`."""
    *lead, n, k = values.shape
    rows, columns = scales.shape[-2:]
    acc = jnp.promote_types(dtype, jnp.float32)
    squares = values.reshape(*lead, rows, n // rows, columns, k // columns).astype(acc)
    return (squares * scales.astype(acc)[..., :, None, :, None]).reshape(values.shape).astype(dtype)
