"""Rotary position embeddings as Hugging Face computes them (NeoX `rotate_half`; linear, llama3 and
YaRN frequency scaling)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ...config import (
    LinearRopeScaling,
    Llama3RopeScaling,
    QueryScaling,
    RopeScaling,
    YarnRopeScaling,
)


@functools.cache
def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The [head_dim // 2] float32 inverse frequencies, with optional linear, llama3 or YaRN
    scaling (dynamic NTK scaling leaves them unscaled within the context, where every input
    here stays: `DynamicNtkRopeScaling`).

    Follows transformers' `_compute_default_rope_parameters`, `_compute_linear_scaling_rope_
    parameters`, `_compute_llama3_parameters` and `_compute_yarn_parameters` step by step in
    float32; the result is a read-only constant (cached per argument set). YaRN's cos/sin
    factor is not part of it: pass `scaling.attention_factor` to `apply_rope`.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of dimensions; head_dim must be even, got {head_dim}")
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / np.power(np.float32(theta), exponents)
    if isinstance(scaling, LinearRopeScaling):
        inv_freq = inv_freq / np.float32(scaling.factor)
    elif isinstance(scaling, Llama3RopeScaling):
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif isinstance(scaling, YarnRopeScaling):
        inv_freq = _yarn_scale(exponents, head_dim, theta, scaling)
    inv_freq = inv_freq.astype(np.float32)
    inv_freq.setflags(write=False)
    return inv_freq


def _llama3_scale(inv_freq: np.ndarray, scaling: Llama3RopeScaling) -> np.ndarray:
    f32 = np.float32
    factor = f32(scaling.factor)
    low, high = f32(scaling.low_freq_factor), f32(scaling.high_freq_factor)
    original = f32(scaling.original_max_position_embeddings)
    low_freq_wavelen = original / low
    high_freq_wavelen = original / high
    wavelen = f32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn_scale(
    exponents: np.ndarray, head_dim: int, theta: float, scaling: YarnRopeScaling
) -> np.ndarray:
    """Blends the kept (extrapolated) and the divided (interpolated) frequencies over a linear
    ramp between the dimensions that turn `beta_fast` and `beta_slow` times in the original
    context (float32, in transformers' order of operations)."""
    f32 = np.float32
    powers = np.power(f32(theta), exponents)
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        turns = original / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = (np.arange(head_dim // 2, dtype=f32) - f32(low)) / f32(high - low)
    extrapolated = f32(1) - np.clip(ramp, f32(0), f32(1))
    interpolated = f32(1) / (f32(scaling.factor) * powers)
    return interpolated * (f32(1) - extrapolated) + f32(1) / powers * extrapolated


def rotate_half(x: jax.Array) -> jax.Array:
    """NeoX rotation: dimension i pairs with i + d/2; returns cat(-x[d/2:], x[:d/2])."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    inv_freq: np.ndarray | jax.Array,
    *,
    attention_factor: float = 1.0,
) -> jax.Array:
    """Rotates every head of every row by its position.

    Args:
      x: [T, heads, head_dim] queries or keys.
      positions: [T] int position of each row within its sequence.
      inv_freq: [head_dim // 2] float32 inverse frequencies (`rope_inv_freq`).
      attention_factor: The factor of cos and sin (YaRN's `attention_factor`; 1 otherwise).

    Returns:
      [T, heads, head_dim] in `x.dtype`: `x * cos + rotate_half(x) * sin`, with the angles
      computed in float32, cos/sin multiplied by `attention_factor` there and cast to
      `x.dtype` before the products, as in transformers.
    """
    if x.ndim != 3 or positions.shape != x.shape[:1] or 2 * len(inv_freq) != x.shape[-1]:
        raise ValueError(
            "apply_rope needs x [T, heads, head_dim], positions [T] and inv_freq [head_dim/2]; "
            f"got {x.shape=}, {positions.shape=}, inv_freq shape {np.shape(inv_freq)}"
        )
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, head_dim]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    return x * cos + rotate_half(x) * sin


def query_scale(positions: jax.Array, scaling: QueryScaling) -> jax.Array:
    """[T] float32 factors of the queries at `positions` [T] (`QueryScaling`), as transformers'
    `get_llama_4_attn_scale` computes them (1 at a padding row's negative position)."""
    steps = jnp.floor(jnp.maximum(positions, 0).astype(jnp.float32) / scaling.period)
    return 1 + jnp.float32(scaling.beta) * jnp.log(1 + steps)
