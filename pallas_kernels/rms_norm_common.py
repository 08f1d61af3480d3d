"""Row math and input checks shared by the add + RMSNorm kernels."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .impl import SUPPORTED_DTYPES

MAX_HIDDEN_GPU = 16384


def inverse_rms(sum_of_squares: jax.Array, *, hidden: int, eps: float) -> jax.Array:
    """1 / sqrt(mean of squares + eps), from a float32 sum of squares over `hidden` elements."""
    return lax.rsqrt(sum_of_squares * (1.0 / hidden) + eps)


def weight_factor(weight: jax.Array, *, unit_offset: bool) -> jax.Array:
    """The float32 factor the normalized row is multiplied by: `weight`, or `1 + weight`."""
    weight = weight.astype(jnp.float32)
    return weight + 1.0 if unit_offset else weight


def gpu_vector_size(hidden: int, dtype: np.dtype) -> int:
    """Elements per thread per vector access in Mosaic GPU's strided layout (16 bytes at most).

    The layout covers a row in chunks of 128 threads x vector size, so the vector shrinks until it
    divides the row. Returns 0 when no vector size fits (hidden not a multiple of 128).
    """
    vector = 16 // np.dtype(dtype).itemsize
    while vector and hidden % (128 * vector):
        vector //= 2
    return vector


def check_inputs(
    x: jax.Array, residual: jax.Array | None, weight: jax.Array, *, eps: float
) -> None:
    """Raises a clear error unless the inputs form a valid add + RMSNorm call.

    Raises:
      TypeError: A dtype outside float32/bfloat16/float16, a residual of another dtype, or a
        non-floating weight.
      ValueError: Fewer than two dimensions, a residual of another shape, a weight that is not
        [hidden], or a negative eps.
    """
    if x.ndim < 2:
        raise ValueError(
            f"x must be [rows, hidden] (or [..., rows, hidden]); got {x.shape=}. "
            "Add a leading axis for a single row."
        )
    if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise TypeError(f"x must have dtype {names}; got {x.dtype=}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape; got {residual.shape=} and {x.shape=}")
        if residual.dtype != x.dtype:
            raise TypeError(
                f"residual must have x's dtype (the new residual is rounded to it); got "
                f"{residual.dtype=} and {x.dtype=}. Cast one of them first."
            )
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [hidden] = ({x.shape[-1]},); got {weight.shape=}")
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"weight must have a floating dtype; got {weight.dtype=}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0; got {eps=}")
