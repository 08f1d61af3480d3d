"""The specification: the unfused finalize, `psum`, then add + RMSNorm."""

import jax
import jax.numpy as jnp
from jax import lax

from ..add_rms_norm import add_rms_norm_reference
from ..axes import AxisName


def finalize_reference(expert_outputs: jax.Array, weights: jax.Array) -> jax.Array:
    """`sum_k weights[:, k] * expert_outputs[:, k]` in float32: [rows, hidden] float32."""
    return jnp.einsum(
        "rkh,rk->rh",
        expert_outputs.astype(jnp.float32),
        weights.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
    )


def moe_finalize_add_rms_norm_reference(
    expert_outputs: jax.Array,  # [rows, top_k, hidden]
    weights: jax.Array,  # [rows, top_k]
    residual: jax.Array | None,  # [rows, hidden]
    norm_weight: jax.Array,  # [hidden]
    *,
    axis_name: AxisName | None = None,
    eps: float = 1e-6,
    unit_offset: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The unfused path the boundary runs without the kernel.

    The weighted combine of the top-k outputs is summed in float32 and rounded to the outputs'
    dtype (as `DeferredFinalize.complete`), completed with `lax.psum` over `axis_name` (none when
    None), then added to `residual` and normalized by `add_rms_norm_reference`. The fused kernels
    agree up to rounding: they keep the combine and the sum in float32 up to the add.

    Args:
      expert_outputs: This rank's per-choice expert outputs (zero for experts it does not hold).
      weights: The routing weights of those choices.
      residual: The residual stream, or None (the new residual is then the completed output).
      norm_weight: The norm's scale.
      axis_name: Mesh axis (or axes) the finalized output still owes a sum over; None for none.
      eps: Added to the mean of squares.
      unit_offset: Scale by `1 + norm_weight` instead of `norm_weight`.

    Returns:
      `(normed, new_residual)`, [rows, hidden] each, in `expert_outputs.dtype`.
    """
    combined = finalize_reference(expert_outputs, weights).astype(expert_outputs.dtype)
    if axis_name is not None:
        combined = lax.psum(combined, axis_name)
    return add_rms_norm_reference(combined, residual, norm_weight, eps=eps, unit_offset=unit_offset)
