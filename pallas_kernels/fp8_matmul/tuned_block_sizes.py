"""Tilings of the FP8 matmul kernels, and the tables that pick them by shape.

Both tables follow tilings measured on one H200 (`benchmarks/bench_fp8.py --parts matmul`,
`benchmarks/RESULTS.md`). The Triton decode kernel (runs 18-21): converted to float16 its
operands read the FP8 weights at 2.70 TB/s at 8 rows; multiplied as FP8 on the tensor cores, at
2.73 TB/s at 8 rows and 1.84 TB/s at 64 at best over a grid of 48 tilings (32 / 64 / 128 columns,
split 1-8, 4 or 8 warps, 3 or 5 stages), 1.39x and 1.10x bf16's `jnp.dot`. The warp-specialized
Mosaic kernel (runs 22, 25): 2.54 TB/s at 64 rows with the weight as the wgmma's wide side
(1.52x bf16), 975 TFLOP/s at 4096 rows (1.18x bf16; the single-warpgroup kernel before it
reached 184).
"""

import dataclasses

from jax.experimental import pallas as pl

SCALE_BLOCK = 128
"""Features per scale along the contraction, and rows per weight scale (the Hugging Face
fine-grained FP8 block): every kernel steps its contraction one scale block at a time."""

NUM_SMS = 132
"""An H200's SMs: the decode kernel splits its contraction until each has a program."""


@dataclasses.dataclass(frozen=True)
class TritonFp8Tiling:
    """Tiling of the Triton decode kernel (`fp8_matmul_triton`).

    Attributes:
      block_m: Rows per program (at least 16 for the tensor cores); None: the rows rounded up
        to a power of two, at most 64.
      block_n: Output columns per program; divides `SCALE_BLOCK`.
      split_k: Programs the contraction is split over (their float32 partials summed after).
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining depth of the contraction loop.
      fp8_dot: Multiply the FP8 operands on the FP8 tensor cores (each scale block's float32
        partial scaled before it is added), else convert them to float16 first (as fast at 8
        rows, 1.17x slower at 64, 1.34x at 512 on an H200: `benchmarks/RESULTS.md` run 19).
    """

    block_m: int | None = None
    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fp8_dot: bool = True

    def __post_init__(self):
        if SCALE_BLOCK % self.block_n or self.block_n < 16:
            raise ValueError(f"block_n must divide {SCALE_BLOCK} and be >= 16; got {self}")
        if self.block_m is not None and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"block_m must be a power of two >= 16; got {self}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1; got {self}")

    def rows_per_program(self, m: int) -> int:
        """`block_m`, or for None the rows rounded up to a power of two in [16, 64]."""
        if self.block_m is not None:
            return self.block_m
        return min(64, max(16, pl.next_power_of_2(m)))


WGMMA_ROWS = 64
"""Rows of one warpgroup's wgmma: each compute warpgroup of the Mosaic kernel owns this many rows
of its A operand's tile."""

COMPUTE_WARPGROUPS = 2
"""Compute warpgroups of the Mosaic kernel (beside its memory warpgroup): its A tiles are
`WGMMA_ROWS * COMPUTE_WARPGROUPS` = 128 rows."""

SWAP_MAX_ROWS = 128
"""Up to this many rows the Mosaic kernel's table puts the weight on the wgmma's 64-row side
(`MosaicFp8Tiling.swap`)."""


@dataclasses.dataclass(frozen=True)
class MosaicFp8Tiling:
    """Tiling of the Mosaic GPU kernel (`fp8_matmul_mosaic`). Each of its two compute warpgroups
    multiplies 64 rows of A by a B tile: by default the two take neighbouring 64 rows of a 128-row
    A tile and share the B tile; `split_columns` gives them one 64-row A tile and a half of the B
    tile each. This sets the B operand's tile, the split and the schedule.

    Attributes:
      tile_n: Rows of the B operand per tile (a multiple of 32, at most 256: TMA writes each
        step's scales, one float32 per row, at 128-byte aligned places): weight rows (output
        features) for prefill, the input rows under `swap`.
      max_concurrent_steps: Contraction steps whose copies are in flight.
      grid_block_n: B tiles visited together (`plgpu.planar_snake`), for L2 reuse.
      split_k: Programs the contraction is split over (their float32 partials summed after).
      swap: Multiply the weight as A and the rows as B (decode: few rows, wide weights).
      cluster: Run the programs in clusters of two that take neighbouring A tiles of one B tile
        and multicast each B block to both (A's extent then a multiple of two A tiles).
      split_columns: A tiles of 64 rows, each compute warpgroup multiplying it by half of the B
        tile (`tile_n / 2` rows, so `tile_n` a multiple of 64): for A extents that are multiples
        of 64 but not of 128, such as experts padded to a capacity.
      programs: Programs launched at most (each walks the tiles with the grid's stride); None:
        one per SM (per pair of SMs in clusters).
      chain: Chain the pipelines of a program's consecutive tiles, so that the memory warpgroup
        loads the next tile's first blocks while the compute warpgroups finish this one (where
        every program has two tiles or more and the steps in flight divide a tile's steps). The
        batched table takes it (`mosaic_fp8_batched_tiling`); the dense one has not been
        measured with it.
    """

    tile_n: int = 128
    max_concurrent_steps: int = 4
    grid_block_n: int = 4
    split_k: int = 1
    swap: bool = False
    cluster: bool = False
    split_columns: bool = False
    programs: int | None = None
    chain: bool = False

    def __post_init__(self):
        if self.tile_n % 32 or not 32 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 32 in [32, 256]; got {self}")
        if self.split_columns and self.tile_n % 64:
            raise ValueError(f"split_columns halves tile_n: a multiple of 64; got {self}")
        if self.split_k < 1 or self.max_concurrent_steps < 1 or self.grid_block_n < 1:
            raise ValueError(f"split_k, max_concurrent_steps and grid_block_n must be >= 1; {self}")
        if self.programs is not None and self.programs < (2 if self.cluster else 1):
            raise ValueError(f"programs must be >= 1 (>= 2 in clusters); got {self}")

    @property
    def tile_a(self) -> int:
        """Rows of the A operand per tile (one program's; a cluster takes two tiles)."""
        return WGMMA_ROWS * (1 if self.split_columns else COMPUTE_WARPGROUPS)


def triton_fp8_tiling(m: int, k: int, n: int) -> TritonFp8Tiling:
    """The decode kernel's tiling for [m, k] x [n, k]: up to 16 rows, 64 columns per program and
    5 pipeline stages; above, 128 columns and 3 stages; the contraction split over the fewest
    programs (a power of two dividing its scale blocks, at most 8) that give every SM of an
    H200 one. Measured on one H200, [4096 -> 14336] (`bench_fp8 --parts matmul --wide`,
    `benchmarks/RESULTS.md` run 21): 21.5 us at 8 rows and 32.0 us at 64, against 22.3 and
    35.1 us for run 19's default (64 columns, 4 stages, splits to two programs per SM)."""
    rows = TritonFp8Tiling().rows_per_program(m)
    if rows <= 16:
        tiling = TritonFp8Tiling(block_n=64, num_stages=5)
    else:
        tiling = TritonFp8Tiling(block_n=128, num_stages=3)
    programs = (n // tiling.block_n) * pl.cdiv(m, rows)
    split = 1
    while programs * split < NUM_SMS and split < 8 and (k // SCALE_BLOCK) % (2 * split) == 0:
        split *= 2
    return dataclasses.replace(tiling, split_k=split)


def mosaic_fp8_tiling(m: int, k: int, n: int) -> MosaicFp8Tiling:
    """The Mosaic kernel's tiling for [m, k] x [n, k]. Up to `SWAP_MAX_ROWS` rows: the weight as
    A, the rows (rounded up to a power of two, at least 32) as one B tile, 4 steps in flight, the
    contraction split over the most programs (a power of two dividing its scale blocks, at most 8)
    that still run in one wave on an H200's SMs. Above: 224 weight rows per tile where they divide
    N (2 steps in flight), else 192 (4 steps), else 128 (4 steps); 2 or 4 weight tiles per grid
    step. Measured on one H200 (`bench_fp8 --parts matmul`, `benchmarks/RESULTS.md`): [4096 ->
    14336], run 22: 23.2 us at 64 rows (2.54 TB/s; splitting in two, 27.3 us), 506 us at 4096
    (951 TFLOP/s; 546 us with 128-row tiles); run 25 at 4096 rows: [4096 -> 28672] 987 us with
    2 steps in flight against 1000 with 3 (975 and 962 TFLOP/s), [4096 -> 6144] 223 us with 192
    rows against 247 with 128."""
    if m <= SWAP_MAX_ROWS:
        tiles = n // (WGMMA_ROWS * COMPUTE_WARPGROUPS)
        split = 1
        while tiles * split * 2 <= NUM_SMS and split < 8 and (k // SCALE_BLOCK) % (2 * split) == 0:
            split *= 2
        rows = max(32, pl.next_power_of_2(m))
        return MosaicFp8Tiling(tile_n=rows, grid_block_n=1, split_k=split, swap=True)
    if n % 224 == 0:
        return MosaicFp8Tiling(tile_n=224, max_concurrent_steps=2, grid_block_n=2)
    if n % 192 == 0:
        return MosaicFp8Tiling(tile_n=192, grid_block_n=2)
    tiles = n // 128
    return MosaicFp8Tiling(grid_block_n=next(b for b in (4, 2, 1) if tiles % b == 0))


def mosaic_fp8_batched_tiling(m: int, k: int, n: int) -> MosaicFp8Tiling:
    """The Mosaic kernel's tiling for groups of [m, k] x [n, k] (experts padded to a capacity of
    `m` rows): where 256 divides N, 64-row A tiles with a 256-row B tile split between the
    warpgroups and each program's tiles chained into one pipeline, 4 steps in flight where they
    divide the K / 128 scale blocks, else 3 where those do (the chain needs the steps in flight
    to divide a tile's steps); one B tile per grid step (a group's weight is small enough to
    stay in the L2 while its row tiles pass). Otherwise, unchained: 64-row tiles with the B
    tile split (192 or 128 rows) where `m` is not a multiple of 128, the dense table's prefill
    tiles where it is. Measured on one H100 at Qwen3-30B-A3B's experts (`bench_fp8 --parts
    experts`, `benchmarks/RESULTS.md` run 41): at 320 rows gate|up (16 steps, 4 in flight)
    313 us chained against 335 unchained, down (6 steps, 3 in flight) 190 against 222; at 384
    rows 361 against 368 and 224 against 265."""
    steps = k // SCALE_BLOCK
    if n % 256 == 0:
        in_flight = 3 if steps % 4 and steps % 3 == 0 else 4
        return MosaicFp8Tiling(
            tile_n=256,
            max_concurrent_steps=in_flight,
            grid_block_n=1,
            split_columns=True,
            chain=True,
        )
    tile = next(t for t in (192, 128) if n % t == 0)
    split = m % (WGMMA_ROWS * COMPUTE_WARPGROUPS) != 0
    return MosaicFp8Tiling(tile_n=tile, grid_block_n=1, split_columns=split)
