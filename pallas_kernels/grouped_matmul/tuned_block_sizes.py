"""Tilings of the grouped matmul kernels, and the tuned tables that pick them by shape."""

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TritonTiling:
    """Tiling of the Triton expert matmul (`expert_matmul`).

    Attributes:
      block_rows: Rows of one expert multiplied together (at least 16 for the tensor cores).
      block_n: Output columns per program.
      block_k: Contraction depth per pipelined step.
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining depth of the contraction loop.
      columns_inner: Launch one expert's column blocks next to each other (its rows then come
        from L2 after the first), else one column block of every expert after another.
    """

    block_rows: int = 16
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    columns_inner: bool = False

    def grid(self, experts: int, column_blocks: int) -> tuple[int, int]:
        """The launch grid over (expert slot, column block), the faster-launched axis first."""
        return (column_blocks, experts) if self.columns_inner else (experts, column_blocks)

    def divides(self, k: int, n: int) -> bool:
        """Whether the tiling divides [*, k] x [*, k, n] (`k % block_k`, `n % block_n` zero)."""
        return k % self.block_k == 0 and n % self.block_n == 0


@dataclasses.dataclass(frozen=True)
class HopperTiling:
    """Tiling of JAX's Hopper grouped matmul (`hopper_ragged_dot`), as its `ragged_dot` takes it.

    Attributes:
      block_m: Rows per tile.
      block_n: Output columns per tile.
      block_k: Contraction depth per pipelined step.
      max_concurrent_steps: Pipelined steps in flight.
      grid_block_n: Column tiles per grid step.
    """

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int
    grid_block_n: int


PREFILL_ROWS_PER_GROUP = 16
"""From this many routed rows per group on average, `triton_tiling` gives a prefill tiling."""


def triton_tiling(k: int, n: int, dtype, rows_per_group: float = 0.0) -> TritonTiling:
    """The Triton kernel's tiling for [*, k] x [*, k, n] with `rows_per_group` rows per group on
    average.

    Decode sizes (fewer than `PREFILL_ROWS_PER_GROUP`): the default (16 rows, 128 columns, 64
    deep) where it divides the shape, else the largest of 64/32/16 columns and 32/16 deep that
    do (small models: tests), at least 16 either way (the tensor cores' smallest tile). The
    default held 75-86% of the copy bandwidth on an H200 (benchmarks/RESULTS.md run 15).

    Prefill sizes: 128 columns, 8 warps, 3 stages, one expert's column blocks launched together
    (`columns_inner`), 128-row blocks from 48 rows per group on average, 64-row blocks below.
    On an H200 (`bench_grouped_matmul`, run 37, 512 experts of Qwen3-Next's shape) at 80 rows
    per expert it took the gate | up projection in 0.727 ms and the down projection in 0.445
    ms, against 0.988 / 0.568 ms with every expert's first column block launched first and
    1.174 / 0.547 ms with 64-row blocks; at 31 rows per expert 64-row blocks took 0.592 ms
    against 0.606 with 128; at 16 rows (a sweep) 0.543 ms against 0.566, and more with 16-row
    blocks.

    Raises:
      NotImplementedError: No tile of at least 16 divides the shape.
    """
    del dtype
    default = TritonTiling()
    if rows_per_group >= PREFILL_ROWS_PER_GROUP:
        block_rows = 128 if rows_per_group >= 48 else 64
        default = TritonTiling(block_rows, num_warps=8, num_stages=3, columns_inner=True)
    if not triton_tiles_fit(k, n):
        raise NotImplementedError(
            f"GroupedMatmulImpl.PALLAS_TRITON needs k % 16 == 0 and n % 16 == 0; got {k=}, "
            f"{n=}. Use GroupedMatmulImpl.RAGGED_DOT"
        )
    block_n = next(b for b in (default.block_n, 64, 32, 16) if n % b == 0)
    block_k = next(b for b in (default.block_k, 32, 16) if k % b == 0)
    return dataclasses.replace(default, block_n=block_n, block_k=block_k)


def triton_tiles_fit(k: int, n: int) -> bool:
    """Whether `triton_tiling` has a tiling for [*, k] x [*, k, n]: 16 (the tensor cores'
    smallest tile) divides both."""
    return k % 16 == 0 and n % 16 == 0


def hopper_tiling(k: int, n: int, dtype) -> HopperTiling:
    """The Hopper kernel's tiling for [*, k] x [*, k, n]: 4 pipelined steps, the first of 4, 3
    and 5 column blocks per grid step that divides n (else 1); 64 x 256 tiles where 4 of them
    divide n, else 128 x 192 where 192 divides n, else 64 x 256 where 256 does, else 128 rows by
    the larger of 128/64 dividing n; block_k the largest of 64/32/16 dividing k.

    Swept on an H200 (benchmarks/RESULTS.md runs 9, 12 and 20): on the Qwen3-30B-A3B layer
    (32768 routed rows) 128 x 192 x 64 took the layer from 2.88 ms (64 x 128 x 64, 2 steps) to
    1.21 ms, and 128 x 256 was 4x slower; on its down projection (n 2048, k 768) 64 x 256 tiles
    took 386 us against 426 us for 128 x 128 (fewer rows wasted where a tile straddles two
    experts). On DeepSeek-V2-Lite's gate|up projection (n 2816, k 2048, 24576 routed rows) 64 x
    256 tiles took 680 us against 794 us for 128 x 128, for even and skewed routing alike. On
    GPT-OSS-20B's projections (k 2880, n 5760 and 2880, 16384 routed rows; run 32) 3 column
    blocks per grid step took 0.980 / 0.503 ms against 1.078 / 0.577 ms for 1.

    Raises:
      NotImplementedError: A dtype other than bf16/f16, or a shape no tile divides.
    """
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise NotImplementedError(
            f"GroupedMatmulImpl.PALLAS_GPU runs bf16/f16 matmuls; got {dtype=}. Cast the "
            "activations and weights, or use GroupedMatmulImpl.RAGGED_DOT"
        )
    if n % 1024 == 0:
        block_m, block_n = 64, 256
    elif n % 192 == 0:
        block_m, block_n = 128, 192
    elif n % 256 == 0:
        block_m, block_n = 64, 256
    else:
        block_m, block_n = 128, next((b for b in (128, 64) if n % b == 0), None)
    block_k = next((b for b in (64, 32, 16) if k % b == 0), None)
    if block_n is None or block_k is None:
        raise NotImplementedError(
            f"GroupedMatmulImpl.PALLAS_GPU needs n % 64 == 0 and k % 16 == 0; got {k=}, {n=}. "
            "Use GroupedMatmulImpl.RAGGED_DOT for these shapes"
        )
    return HopperTiling(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        max_concurrent_steps=4,
        grid_block_n=next((g for g in (4, 3, 5) if n % (g * block_n) == 0), 1),
    )
