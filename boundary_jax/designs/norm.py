"""RMSNorm with FP32 accumulation: the norm a plain add + norm read applies."""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import add_rms_norm_reference

from ..initializers import Constant, param


def accumulation_dtype(dtype) -> jnp.dtype:
    """FP32, or the input's dtype where that is wider (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(
    x: jax.Array, weight: jax.Array, *, eps: float, unit_offset: bool = False
) -> jax.Array:
    """RMSNorm of `x` over its last dimension, computed in FP32 and cast back to `x.dtype`
    (`pallas_kernels.add_rms_norm_reference` without a residual); `unit_offset` scales by
    `1 + weight`."""
    return add_rms_norm_reference(x, None, weight, eps=eps, unit_offset=unit_offset)[0]


def add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    unit_offset: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Fused add + RMSNorm: `(norm(x + residual), x + residual)`, as the one specification
    `pallas_kernels.add_rms_norm_reference` gives it (FP32 accumulation; the new residual
    rounded to `residual.dtype`, the norm taken from the unrounded sum)."""
    return add_rms_norm_reference(x, residual, weight, eps=eps, unit_offset=unit_offset)


_NNX_FILES = (os.path.dirname(nnx.__file__),)


class RMSNorm(nnx.Module):
    """A replicated RMSNorm layer; boundaries read its `weight`, `eps` and `unit_offset` to fuse
    it.

    Attributes:
      weight: [dim] scale, replicated on every rank: ones (zeros with `unit_offset`), as Hugging
        Face initializes a norm.
      eps: Added to the mean square before the reciprocal square root.
      unit_offset: Scale by `1 + weight` instead of `weight` (the weight holds its offset from
        one, as Gemma's norms store it).
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        unit_offset: bool = False,
        param_dtype: jnp.dtype = jnp.float32,
        gemma: bool | None = None,
    ):
        """Makes the norm's weight (`param_dtype`, [dim]).

        `gemma=` is the deprecated spelling of `unit_offset=` (a model family's name for a layer
        option); it still works for one release, with a DeprecationWarning.

        Raises:
          ValueError: Both `gemma=` and `unit_offset=` given, and they disagree.
        """
        if gemma is not None:
            warnings.warn(
                f"{type(self).__name__}(gemma=...) is deprecated; pass unit_offset={gemma!r} "
                "(scale by 1 + weight)",
                DeprecationWarning,
                stacklevel=2,
                skip_file_prefixes=_NNX_FILES,  # nnx's constructor calls __init__: name its caller
            )
            if unit_offset and not gemma:
                raise ValueError(
                    f"gemma= is the old spelling of unit_offset=; got {gemma=} and "
                    f"{unit_offset=}. Pass unit_offset alone"
                )
            unit_offset = gemma
        self.weight = param(Constant(0.0 if unit_offset else 1.0), (dim,), param_dtype)
        self.eps = eps
        self.unit_offset = unit_offset

    @property
    def gemma(self) -> bool:
        """Deprecated: `unit_offset`."""
        warnings.warn(
            "RMSNorm.gemma is deprecated; read RMSNorm.unit_offset",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        self.check_width(x)
        return rms_norm(x, self.weight[...], eps=self.eps, unit_offset=self.unit_offset)

    def check_width(self, x: jax.Array) -> None:
        """Raises a ValueError naming both widths unless `x`'s last dimension is the norm's."""
        if x.shape[-1] != self.weight.shape[-1]:
            raise ValueError(
                f"an RMSNorm of width {self.weight.shape[-1]} normalizes rows of width "
                f"{x.shape[-1]}; the residual stream and every stage's output must have the "
                "model's hidden size"
            )
