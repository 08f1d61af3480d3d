"""JAX's Hopper grouped matmul (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`), typed for
`check_vma` and differentiable: the kernel for prefill-sized MoE steps.

A Mosaic GPU kernel for bf16/f16 on NVIDIA Hopper GPUs and newer; it imports on any platform
but runs on those only. It visits every group, empty ones too, so it reads all the weights
whatever the routing.
"""

import functools

import jax

from .. import axes
from ..vjp import with_reference_vjp
from .reference import grouped_matmul_reference
from .tuned_block_sizes import HopperTiling, hopper_tiling

try:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
except ImportError:  # pragma: no cover - depends on the JAX build
    ragged_dot_mgpu = None

HOPPER_AVAILABLE = ragged_dot_mgpu is not None
"""Whether this JAX ships the Hopper grouped matmul."""


@functools.partial(jax.jit, static_argnames=("tiling",))
def hopper_ragged_dot(
    rows: jax.Array,  # [M, K], sorted by group
    weights: jax.Array,  # [G, K, N]
    group_sizes: jax.Array,  # [G] int32
    *,
    tiling: HopperTiling | None = None,
) -> jax.Array:
    """`[M, K] x [G, K, N] -> [M, N]` through JAX's Hopper kernel, float32 accumulation.

    Args:
      rows: Rows sorted by group, bf16 or f16.
      weights: One [K, N] matrix per group, `rows.dtype`.
      group_sizes: Rows per group; rows past their sum are unspecified.
      tiling: The tiling; None for `hopper_tiling`'s (the tuned table).

    Returns:
      [M, N] in `rows.dtype`, varying (inside `shard_map`) over the mesh axes
      `grouped_matmul_reference`'s output would. Differentiable: the gradients are the
      reference's.

    Raises:
      NotImplementedError: This JAX lacks the kernel, or (with `tiling=None`) a dtype or shape
        the tuned table has no tiling for.
    """
    if not HOPPER_AVAILABLE:
        raise NotImplementedError(
            "GroupedMatmulImpl.PALLAS_GPU needs jax.experimental.pallas.ops.gpu."
            "ragged_dot_mgpu, which this JAX lacks; use GroupedMatmulImpl.RAGGED_DOT"
        )
    tiling = tiling or hopper_tiling(rows.shape[1], weights.shape[2], rows.dtype)
    kernel = functools.partial(_hopper_call, tiling=tiling)
    return with_reference_vjp(kernel, grouped_matmul_reference)(rows, weights, group_sizes)


def _hopper_call(rows, weights, group_sizes, *, tiling: HopperTiling) -> jax.Array:
    (varying,) = axes.reference_varying(grouped_matmul_reference, rows, weights, group_sizes)
    out = ragged_dot_mgpu.ragged_dot(
        rows,
        weights,
        group_sizes=group_sizes,
        block_m=tiling.block_m,
        block_n=tiling.block_n,
        block_k=tiling.block_k,
        max_concurrent_steps=tiling.max_concurrent_steps,
        grid_block_n=tiling.grid_block_n,
    )
    # Mosaic GPU types its output invariant; it varies as the reference's does.
    return axes.mark_varying(out, varying)
