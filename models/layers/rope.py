"""Rotary position embeddings as Hugging Face computes them (NeoX `rotate_half`; linear and llama3
frequency scaling)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..config import LinearRopeScaling, Llama3RopeScaling, RopeScaling


@functools.cache
def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The [head_dim // 2] float32 inverse frequencies, with optional linear or llama3 scaling.

    Follows transformers' `_compute_default_rope_parameters`, `_compute_linear_scaling_rope_
    parameters` and `_compute_llama3_parameters` step by step in float32; the result is a
    read-only constant (cached per argument set).
    """
    if head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of dimensions; head_dim must be even, got {head_dim}")
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / np.power(np.float32(theta), exponents)
    if isinstance(scaling, LinearRopeScaling):
        inv_freq = inv_freq / np.float32(scaling.factor)
    elif isinstance(scaling, Llama3RopeScaling):
        inv_freq = _llama3_scale(inv_freq, scaling)
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


def rotate_half(x: jax.Array) -> jax.Array:
    """NeoX rotation: dimension i pairs with i + d/2; returns cat(-x[d/2:], x[:d/2])."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | jax.Array) -> jax.Array:
    """Rotates every head of every row by its position.

    Args:
      x: [T, heads, head_dim] queries or keys.
      positions: [T] int position of each row within its sequence.
      inv_freq: [head_dim // 2] float32 inverse frequencies (`rope_inv_freq`).

    Returns:
      [T, heads, head_dim] in `x.dtype`: `x * cos + rotate_half(x) * sin`, with the angles
      computed in float32 and cos/sin cast to `x.dtype` before the products, as in transformers.
    """
    if x.ndim != 3 or positions.shape != x.shape[:1] or 2 * len(inv_freq) != x.shape[-1]:
        raise ValueError(
            "apply_rope needs x [T, heads, head_dim], positions [T] and inv_freq [head_dim/2]; "
            f"got {x.shape=}, {positions.shape=}, inv_freq shape {np.shape(inv_freq)}"
        )
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, head_dim]
    cos = jnp.cos(angles).astype(x.dtype)
    sin = jnp.sin(angles).astype(x.dtype)
    return x * cos + rotate_half(x) * sin
