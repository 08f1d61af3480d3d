"""RMSNorm with FP32 accumulation: the norm a plain add + norm read applies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import add_rms_norm_reference

from ..initializers import Constant, param


def accumulation_dtype(dtype) -> jnp.dtype:
    """FP32, or the input's dtype where that is wider (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, gemma: bool = False) -> jax.Array:
    """RMSNorm of `x` over its last dimension, computed in FP32 and cast back to `x.dtype`
    (`pallas_kernels.add_rms_norm_reference` without a residual)."""
    return add_rms_norm_reference(x, None, weight, eps=eps, gemma=gemma)[0]


def add_rms_norm(
    x: jax.Array, residual: jax.Array, weight: jax.Array, *, eps: float, gemma: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Fused add + RMSNorm: `(norm(x + residual), x + residual)`, as the one specification
    `pallas_kernels.add_rms_norm_reference` gives it (FP32 accumulation; the new residual
    rounded to `residual.dtype`, the norm taken from the unrounded sum)."""
    return add_rms_norm_reference(x, residual, weight, eps=eps, gemma=gemma)


class RMSNorm(nnx.Module):
    """A replicated RMSNorm layer; boundaries read its `weight`, `eps` and `gemma` to fuse it.

    Attributes:
      weight: [dim] scale, replicated on every rank: ones (zeros with `gemma`), as Hugging
        Face initializes a norm.
      eps: Added to the mean square before the reciprocal square root.
      gemma: Scale by `1 + weight` (Gemma-style) instead of `weight`.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        gemma: bool = False,
        param_dtype: jnp.dtype = jnp.float32,
    ):
        self.weight = param(Constant(0.0 if gemma else 1.0), (dim,), param_dtype)
        self.eps = eps
        self.gemma = gemma

    def __call__(self, x: jax.Array) -> jax.Array:
        self.check_width(x)
        return rms_norm(x, self.weight[...], eps=self.eps, gemma=self.gemma)

    def check_width(self, x: jax.Array) -> None:
        """Raises a ValueError naming both widths unless `x`'s last dimension is the norm's."""
        if x.shape[-1] != self.weight.shape[-1]:
            raise ValueError(
                f"an RMSNorm of width {self.weight.shape[-1]} normalizes rows of width "
                f"{x.shape[-1]}; the residual stream and every stage's output must have the "
                "model's hidden size"
            )
