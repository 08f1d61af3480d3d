"""The specification of the fused all-reduce + add + RMSNorm: `psum`, then add + RMSNorm."""

import jax
from jax import lax

from ..add_rms_norm import add_rms_norm_reference
from ..axes import AxisName


def all_reduce_add_rms_norm_reference(
    x: jax.Array,  # [..., hidden]: this device's partial sum
    residual: jax.Array | None,  # [..., hidden]
    weight: jax.Array,  # [hidden]
    *,
    axis_name: AxisName,
    eps: float = 1e-6,
    unit_offset: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Completes the sum of `x` over `axis_name` with `lax.psum`, then adds and normalizes.

    Call inside `jax.shard_map`. The fused kernels agree with this up to the rounding of the sum:
    they keep it in float32, where `psum` rounds it to `x.dtype` first.

    Args:
      x: This device's partial sum of the stage output.
      residual: The residual stream, or None (the new residual is then the completed sum).
      weight: The norm's scale.
      axis_name: The mesh axis (or axes) the sum runs over.
      eps: Added to the mean of squares.
      unit_offset: Scale by `1 + weight` instead of `weight`.

    Returns:
      `(normed, new_residual)` as `add_rms_norm_reference` returns them for the completed sum.
    """
    return add_rms_norm_reference(
        lax.psum(x, axis_name), residual, weight, eps=eps, unit_offset=unit_offset
    )
