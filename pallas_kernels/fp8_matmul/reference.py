"""The specifications of the block-scaled FP8 matmuls (dense, batched, and grouped by expert):
both operands dequantized, float32 sums."""

import jax
import jax.numpy as jnp
from jax import lax

from ..quantize import dequantize_blocks_reference, dequantize_token_groups_reference


def fp8_matmul_reference(
    x_values: jax.Array,  # [M, K] float8_e4m3fn
    x_scales: jax.Array,  # [M, K / block] float32
    w_values: jax.Array,  # [N, K] float8_e4m3fn
    w_scales: jax.Array,  # [N / block, K / block] float32
    *,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """`x @ w.T` of rows quantized per token group and a weight quantized per square block.

    `x[m, k] = x_values[m, k] * x_scales[m, k // block]` and `w[n, k] = w_values[n, k] *
    w_scales[n // block, k // block]` (the Hugging Face fine-grained FP8 layout: a weight is
    [out, in], its `weight_scale_inv` [out / block, in / block]). Both are dequantized exactly
    (an e4m3 value times a float32 scale is exact in float32 up to the scale's rounding) and
    multiplied with float32 sums (float64 where `out_dtype` is), which is what a block-scaled
    FP8 kernel computes up to the order of its sums.

    Returns:
      [M, N] in `out_dtype`.
    """
    acc = jnp.promote_types(out_dtype, jnp.float32)
    x = dequantize_token_groups_reference(x_values, x_scales, acc)
    block_n = w_values.shape[0] // w_scales.shape[0]
    w = dequantize_token_groups_reference(w_values, jnp.repeat(w_scales, block_n, axis=0), acc)
    out = lax.dot_general(
        x,
        w,
        (((1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=acc,
    )
    return out.astype(out_dtype)


def fp8_grouped_matmul_reference(
    x_values: jax.Array,  # [M, K] float8_e4m3fn, sorted by group
    x_scales: jax.Array,  # [M, K / 128] float32
    w_values: jax.Array,  # [G, N, K] float8_e4m3fn
    w_scales: jax.Array,  # [G, N / 128, K / 128] float32
    group_sizes: jax.Array,  # [G] int
    *,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """The specification: both operands dequantized (float32, float64 for a float64
    `out_dtype`), then `jax.lax.ragged_dot` with sums in that precision; rows past the groups
    zero.

    Returns:
      [M, N] in `out_dtype`.
    """
    acc = jnp.promote_types(out_dtype, jnp.float32)
    x = dequantize_token_groups_reference(x_values, x_scales, acc)
    w = jnp.swapaxes(dequantize_blocks_reference(w_values, w_scales, acc), 1, 2)  # [G, K, N]
    out = lax.ragged_dot(
        x, w, group_sizes, precision=lax.Precision.HIGHEST, preferred_element_type=acc
    )
    return out.astype(out_dtype)


def fp8_batched_matmul_reference(
    x_values: jax.Array,  # [G, M, K] float8_e4m3fn
    x_scales: jax.Array,  # [G, M, K / 128] float32
    w_values: jax.Array,  # [G, N, K] float8_e4m3fn
    w_scales: jax.Array,  # [G, N / 128, K / 128] float32
    *,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """`fp8_matmul_reference` of each group's rows and weight: `out[g] = x[g] @ w[g].T`, both
    dequantized, sums in float32 (float64 for a float64 `out_dtype`).

    Returns:
      [G, M, N] in `out_dtype`.
    """
    acc = jnp.promote_types(out_dtype, jnp.float32)
    x = dequantize_token_groups_reference(x_values, x_scales, acc)
    w = dequantize_blocks_reference(w_values, w_scales, acc)
    out = jnp.einsum(
        "gmk,gnk->gmn", x, w, precision=lax.Precision.HIGHEST, preferred_element_type=acc
    )
    return out.astype(out_dtype)
