"""The grouped matmul of the MoE experts: implementations, the choice between them, and the
public wrapper."""

import enum
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from .kernel_hopper import HOPPER_AVAILABLE, hopper_ragged_dot
from .kernel_triton import expert_matmul
from .tuned_block_sizes import HopperTiling, TritonTiling, triton_tiles_fit


class GroupedMatmulImpl(enum.Enum):
    """How the per-expert matmuls of the routed rows are computed.

    `grouped_matmul` runs RAGGED_DOT, PALLAS_GPU, PALLAS_TRITON, PALLAS_INTERPRET and
    GPU_BY_SIZE on rows sorted by expert. DENSE and PADDED_BATCHED are strategies of the MoE
    layer around it (`models.layers.routed_experts`), which sorts no rows (DENSE) or pads them to
    a capacity (PADDED_BATCHED) and calls `grouped_matmul` only for its fallback.

    Attributes:
      DENSE: Every row through every local expert (`einsum`), then masked to its own expert:
        the reference the others are tested against. E times the FLOPs; small shapes only.
      RAGGED_DOT: `jax.lax.ragged_dot` over the rows sorted by expert. The default on CPU and
        TPU. On GPU, XLA materializes it densely (measured 35.7 ms for 32768 routed rows of a
        128-expert layer on an H200, against 0.77 ms for PALLAS_GPU).
      PALLAS_GPU: JAX's Hopper Pallas kernel (`hopper_ragged_dot`: Mosaic GPU, bf16/f16,
        NVIDIA Hopper and newer only; never run on CPU). It visits every expert, empty ones
        too, so it reads all the weights whatever the routing: made for prefill.
      PALLAS_TRITON: `expert_matmul` through the Pallas Triton lowering (NVIDIA GPUs): one
        program per (expert with rows, column block), reading only the chosen experts'
        weights: made for decode.
      PALLAS_INTERPRET: PALLAS_TRITON's kernel body run by the Pallas interpreter, on any
        platform (tests; slow).
      PADDED_BATCHED: The routed rows copied expert-major into [local experts, C, hidden],
        C the smallest of the layer's capacity buckets that holds the busiest expert's rows,
        and the three projections as XLA batched matmuls (cuBLAS on GPU), which run near the
        matmul peak where the grouped kernels do not; the first bucket pads about a quarter
        more rows than the even share. Where an expert gets more rows than the largest
        bucket, the layer runs RAGGED_DOT (PALLAS_GPU under GPU_BY_SIZE) instead, so no row is
        dropped.
      GPU_BY_SIZE: By the (static) routed row count and expert count: PALLAS_TRITON up to
        `TRITON_MAX_ROUTED_ROWS` rows, else PADDED_BATCHED falling back to PALLAS_GPU, or to
        PALLAS_TRITON with its prefill tiling for more than `HOPPER_MAX_GROUPS` experts;
        RAGGED_DOT for shapes the chosen kernel's tiles do not divide
        (`grouped_matmul_by_size`). On an H200 (Qwen3-30B-A3B layer, benchmarks/RESULTS.md runs
        9 and 15) PALLAS_TRITON read the chosen experts' weights at 75-86% of the copy bandwidth
        at 64-512 routed rows where PALLAS_GPU reached 23-64%; both took ~0.5 ms at 2048 rows;
        at 32768 rows the layer took 1.20 ms with PALLAS_GPU and 0.87 ms with PADDED_BATCHED
        (wall clock, run 16, finalized inside the branch).
    """

    DENSE = enum.auto()
    RAGGED_DOT = enum.auto()
    PALLAS_GPU = enum.auto()
    PALLAS_TRITON = enum.auto()
    PALLAS_INTERPRET = enum.auto()
    PADDED_BATCHED = enum.auto()
    GPU_BY_SIZE = enum.auto()


TRITON_MAX_ROUTED_ROWS = 2048
"""The most routed rows `GPU_BY_SIZE` gives the Triton kernel at any expert count (the measured
crossover at 128 experts)."""

HOPPER_MAX_GROUPS = 128
"""The most groups (experts) `GPU_BY_SIZE` gives JAX's Hopper kernel; above, the Triton kernel
with its prefill tiling. The Hopper kernel finds each tile's group by a loop over all groups,
unrolled. On an H200 (`bench_grouped_matmul`, benchmarks/RESULTS.md run 37) it took
Qwen3-30B-A3B's projections (128 experts) in 0.535 / 0.395 ms against the Triton kernel's
0.699 / 0.403; at 256 experts 0.608 / 0.625 ms against 0.558 / 0.324; at 512 (Qwen3-Next)
3.78 / 5.82 ms against 0.727 / 0.445."""

Tiling = TritonTiling | HopperTiling
TilingTable = Callable[[int, int, jnp.dtype], Tiling]
"""A tiling by shape: `(k, n, dtype)` of a [*, k] x [*, k, n] matmul -> its tiling."""


def default_grouped_matmul_impl(
    platform: str, dtype: jnp.dtype = jnp.bfloat16
) -> GroupedMatmulImpl:
    """The grouped matmul implementation for a JAX platform name ("cpu", "tpu", "gpu", "cuda")
    and the activations' dtype.

    A 16-bit model on GPU gets `GPU_BY_SIZE` (the Triton kernel at decode sizes, JAX's Hopper
    kernel above) when JAX ships the Hopper kernel, else `PALLAS_TRITON`; everything else
    (float32 models too: the Pallas kernels multiply in 16 bits) `RAGGED_DOT`. Decide this once,
    when the model is built (for example from `jax.default_backend()`).
    """
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if platform in ("gpu", "cuda") and sixteen_bit:
        if not HOPPER_AVAILABLE:
            return GroupedMatmulImpl.PALLAS_TRITON
        return GroupedMatmulImpl.GPU_BY_SIZE
    return GroupedMatmulImpl.RAGGED_DOT


def grouped_matmul_by_size(
    m: int, k: int, n: int, dtype: jnp.dtype, groups: int
) -> GroupedMatmulImpl:
    """`GPU_BY_SIZE`'s pick for [m, k] rows x [groups, k, n] weights: the Triton kernel up to
    `TRITON_MAX_ROUTED_ROWS` rows or for more than `HOPPER_MAX_GROUPS` groups, JAX's Hopper
    kernel otherwise; `RAGGED_DOT` where the picked kernel's tiles do not divide the shape (tiny
    test models) or JAX lacks the Hopper kernel."""
    del dtype
    if m <= TRITON_MAX_ROUTED_ROWS or groups > HOPPER_MAX_GROUPS:
        if triton_tiles_fit(k, n):
            return GroupedMatmulImpl.PALLAS_TRITON
    elif HOPPER_AVAILABLE and n % 64 == 0 and k % 16 == 0:
        return GroupedMatmulImpl.PALLAS_GPU
    return GroupedMatmulImpl.RAGGED_DOT


def grouped_matmul(
    rows: jax.Array,  # [M, K], sorted by group
    weights: jax.Array,  # [G, K, N]
    group_sizes: jax.Array,  # [G] int32
    *,
    impl: GroupedMatmulImpl,
    tiling: Tiling | TilingTable | None = None,
) -> jax.Array:
    """`[M, K] x [G, K, N] -> [M, N]`: each row times its group's weights, as `impl` runs it.

    Args:
      rows: Rows sorted by group: group g's rows follow group g - 1's.
      weights: One [K, N] matrix per group (cast to `rows.dtype`).
      group_sizes: Rows per group.
      impl: RAGGED_DOT, PALLAS_GPU, PALLAS_TRITON, PALLAS_INTERPRET or GPU_BY_SIZE.
      tiling: The Pallas kernel's tiling: a `TritonTiling` or `HopperTiling` for the kernel
        `impl` runs, or a `TilingTable` giving one by shape; None for the tuned tables. Ignored
        by RAGGED_DOT.

    Returns:
      [M, N] in `rows.dtype`; rows past `sum(group_sizes)` unspecified (zero for RAGGED_DOT).
      Differentiable with every `impl`.

    Raises:
      ValueError: DENSE or PADDED_BATCHED (layer strategies, not grouped matmuls).
      TypeError: A tiling for the other kernel.
      NotImplementedError: A kernel that cannot take the shape or dtype.
    """
    k, n = rows.shape[1], weights.shape[2]
    if impl is GroupedMatmulImpl.GPU_BY_SIZE:
        impl = grouped_matmul_by_size(rows.shape[0], k, n, rows.dtype, weights.shape[0])
    weights = weights.astype(rows.dtype)
    match impl:
        case GroupedMatmulImpl.RAGGED_DOT:
            return lax.ragged_dot(rows, weights, group_sizes, precision=lax.Precision.HIGHEST)
        case GroupedMatmulImpl.PALLAS_GPU:
            chosen = _tiling(tiling, HopperTiling, k, n, rows.dtype)
            return hopper_ragged_dot(rows, weights, group_sizes, tiling=chosen)
        case GroupedMatmulImpl.PALLAS_TRITON | GroupedMatmulImpl.PALLAS_INTERPRET:
            chosen = _tiling(tiling, TritonTiling, k, n, rows.dtype)
            interpret = impl is GroupedMatmulImpl.PALLAS_INTERPRET
            return expert_matmul(rows, weights, group_sizes, tiling=chosen, interpret=interpret)
    raise ValueError(
        f"no grouped matmul for {impl=}: DENSE and PADDED_BATCHED are strategies of the MoE "
        "layer (models.layers.routed_experts.expert_outputs); pass one of the grouped matmuls"
    )


def _tiling(tiling, kind: type, k: int, n: int, dtype) -> Tiling | None:
    """`tiling` (or the table's pick for the shape), checked to be `kind`; None for None."""
    if tiling is not None and not isinstance(tiling, (TritonTiling, HopperTiling)):
        tiling = tiling(k, n, dtype)
    if tiling is not None and not isinstance(tiling, kind):
        raise TypeError(f"this kernel takes a {kind.__name__}; got {tiling=}")
    return tiling
