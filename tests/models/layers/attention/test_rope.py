"""RoPE: inverse frequencies (llama3 scaling included) and NeoX rotation vs a NumPy reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import Llama3RopeScaling
from models.layers.attention.rope import apply_rope, rope_inv_freq

LLAMA3 = Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=100
)


def inv_freq_reference(head_dim, theta, scaling):
    """transformers' default and llama3 inverse frequencies, in float64."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv
    factor, lo, hi = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old = scaling.original_max_position_embeddings
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return np.where(medium, smoothed, scaled)


def rope_reference(x, positions, inv_freq):
    """x [T, H, D] rotated NeoX-style (dimension i pairs with i + D/2), in float64."""
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


@pytest.mark.parametrize("head_dim,theta", [(8, 1e4), (16, 1e6), (128, 5e5)])
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_inv_freq_matches_reference(head_dim, theta, scaling):
    """Inverse frequencies are float32 and equal transformers' formula to float32 precision."""
    got = rope_inv_freq(head_dim, theta, scaling)
    assert got.dtype == np.float32 and got.shape == (head_dim // 2,)
    np.testing.assert_allclose(got, inv_freq_reference(head_dim, theta, scaling), rtol=1e-6)


def test_llama3_bands():
    """With head_dim 8: frequency 0 kept, 1 smoothed (0.1 -> 0.0297535), 2 and 3 divided by 8."""
    got = rope_inv_freq(8, 1e4, LLAMA3)
    np.testing.assert_allclose(got, [1.0, 0.0297535, 0.00125, 0.000125], rtol=2e-6)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_apply_rope_matches_reference(scaling):
    """apply_rope equals the float64 rotate_half reference for arbitrary positions."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 3, 16)).astype(np.float32)
    positions = np.array([0, 1, 2, 3, 0, 1, 7, 50, 99, 127, 500, 3], np.int32)
    inv_freq = rope_inv_freq(16, 1e4, scaling)
    got = apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq)
    want = rope_reference(x.astype(np.float64), positions, inv_freq.astype(np.float64))
    chex.assert_trees_all_close(np.asarray(got, np.float64), want, atol=2e-5)


def test_apply_rope_bf16_keeps_dtype_and_norm():
    """In bf16 the output stays bf16, close to the reference, and pairs keep their length."""
    x = jax.random.normal(jax.random.key(1), (6, 2, 8), jnp.float32)
    positions = jnp.arange(6, dtype=jnp.int32) * 9
    inv_freq = rope_inv_freq(8, 1e4, None)
    got = apply_rope(x.astype(jnp.bfloat16), positions, inv_freq)
    assert got.dtype == jnp.bfloat16
    want = rope_reference(np.asarray(x, np.float64), np.asarray(positions), inv_freq)
    chex.assert_trees_all_close(np.asarray(got, np.float64), want, atol=6e-2)
    pair_norm = lambda v: np.hypot(np.asarray(v[..., :4], np.float64), np.asarray(v[..., 4:]))  # noqa: E731
    np.testing.assert_allclose(
        pair_norm(apply_rope(x, positions, inv_freq)), pair_norm(x), rtol=1e-5
    )


def test_apply_rope_rejects_bad_shapes():
    """A head_dim that does not match inv_freq is rejected with the shapes named."""
    with pytest.raises(ValueError, match="inv_freq"):
        apply_rope(jnp.zeros((4, 2, 8)), jnp.zeros((4,), jnp.int32), rope_inv_freq(16, 1e4))
