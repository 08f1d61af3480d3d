"""The batched FP8 matmul of MoE experts padded to a capacity: the Mosaic wgmma kernel (64-row
tiles with the weight tile split between its warpgroups, or 128-row tiles) equals the reference
group by group, lowers for Hopper at the model's shapes, and its tiling table."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_matmul import (
    SCALE_BLOCK,
    Fp8MatmulImpl,
    MosaicFp8Tiling,
    fp8_batched_matmul,
    fp8_batched_matmul_reference,
    fp8_matmul_mosaic,
    fp8_matmul_reference,
    mosaic_fp8_batched_tiling,
    mosaic_fp8_tiling,
)
from pallas_kernels.quantize import quantize_blocks_reference, quantize_token_groups_reference
from tests.markers import GPU_INTERPRET, ON_GPU


@functools.cache
def batched_operands(groups, m, k, n, seed=0):
    """Groups of rows and weights whose magnitudes differ by group, row, weight row and feature
    block, so an operand, scale or output placed in the wrong group, row or column shows."""
    kx, kw = jax.random.split(jax.random.key(seed))
    blocks = (1 + jnp.arange(k) // SCALE_BLOCK)[None, None, :]
    x = jax.random.normal(kx, (groups, m, k)) * jnp.linspace(0.5, 4.0, m)[None, :, None] * blocks
    weight_rows = jnp.linspace(0.1, 3.0, n)[None, :, None]
    w = (
        jax.random.normal(kw, (groups, n, k))
        * weight_rows
        * jnp.arange(1, groups + 1)[:, None, None]
    )
    return (*quantize_token_groups_reference(x), *quantize_blocks_reference(w))


@GPU_INTERPRET
@pytest.mark.parametrize(
    "shape, tiling",
    [
        ((3, 64, 256, 256), MosaicFp8Tiling(tile_n=128, grid_block_n=1, split_columns=True)),
        pytest.param(
            (2, 192, 256, 128),
            MosaicFp8Tiling(tile_n=64, split_k=2, grid_block_n=2, split_columns=True),
            marks=pytest.mark.slow,
        ),
        ((2, 128, 384, 256), MosaicFp8Tiling(tile_n=128, grid_block_n=2)),
        ((2, 40, 256, 256), MosaicFp8Tiling(tile_n=64, grid_block_n=1, swap=True)),
        pytest.param(
            (2, 128, 256, 256),
            MosaicFp8Tiling(tile_n=128, grid_block_n=1, cluster=True, split_columns=True),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["columns split", "columns split, split k", "rows split", "weight as A", "clusters"],
)
def test_mosaic_kernel_multiplies_every_group_by_its_own_weight(shape, tiling):
    """The batched wgmma kernel (interpreted) equals each group's reference product to float32
    rounding: 64-row tiles with the weight tile split between the warpgroups, 128-row tiles,
    the contraction split, the weight as A (rows padded per group), clusters of two."""
    args = batched_operands(*shape)
    want = np.asarray(fp8_batched_matmul_reference(*args, out_dtype=jnp.float32))
    got = fp8_batched_matmul(
        *args, out_dtype=jnp.float32, impl=Fp8MatmulImpl.PALLAS_GPU_INTERPRET, tiling=tiling
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6 * np.abs(want).max())


def test_batched_reference_is_each_groups_product():
    """The batched reference is `fp8_matmul_reference` group by group (to float32 rounding); the
    dequantized bf16 form is it to bf16 rounding; the Triton kernels have no batched form."""
    args = batched_operands(3, 16, 256, 128)
    got = np.asarray(fp8_batched_matmul(*args, out_dtype=jnp.float32))
    for g in range(3):
        want = np.asarray(fp8_matmul_reference(*(a[g] for a in args), out_dtype=jnp.float32))
        # Float32 rounding of the largest product: a GPU's batched and single matmuls sum in
        # different orders (7e-5 on products near 90 on an H200).
        np.testing.assert_allclose(got[g], want, rtol=0, atol=2e-6 * np.abs(want).max())
    bf16 = fp8_batched_matmul(*args, out_dtype=jnp.float32, impl=Fp8MatmulImpl.DEQUANTIZED_BF16)
    assert 0 < np.abs(np.asarray(bf16) - got).max() / np.abs(got).max() < 2.0**-7
    with pytest.raises(ValueError, match="no Fp8MatmulImpl.PALLAS_TRITON form"):
        fp8_batched_matmul(*args, out_dtype=jnp.float32, impl=Fp8MatmulImpl.PALLAS_TRITON)
    with pytest.raises(ValueError, match="the same G"):
        fp8_batched_matmul(*args[:2], *(a[:2] for a in args[2:]), out_dtype=jnp.float32)


@pytest.mark.parametrize(
    "shape",
    [(128, 320, 2048, 1536), (128, 320, 768, 2048), (128, 384, 2048, 1536), (1, 4096, 4096, 6144)],
    ids=["experts' gate|up", "experts' down", "128-row capacity", "dense prefill"],
)
def test_mosaic_kernel_lowers_for_hopper_at_model_shapes(shape):
    """The table's tilings at Qwen3-30B-A3B's experts (capacity 320 and 384) and a dense
    prefill lower to a Mosaic GPU kernel for CUDA on any machine: layouts, shared memory and
    warp specialization are checked here, not first on the GPU."""
    groups, m, k, n = shape
    fp8 = jnp.float8_e4m3fn
    args = [
        jax.ShapeDtypeStruct((groups, m, k), fp8),
        jax.ShapeDtypeStruct((groups, m, k // SCALE_BLOCK), jnp.float32),
        jax.ShapeDtypeStruct((groups, n, k), fp8),
        jax.ShapeDtypeStruct((groups, n // SCALE_BLOCK, k // SCALE_BLOCK), jnp.float32),
    ]
    table = mosaic_fp8_batched_tiling if groups > 1 else mosaic_fp8_tiling
    tiling = table(m, k, n)
    if groups == 1:
        args = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in args]
    call = functools.partial(fp8_matmul_mosaic, out_dtype=jnp.bfloat16, tiling=tiling)
    lowered = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@ON_GPU
@pytest.mark.parametrize(
    "shape, tiling",
    [
        ((3, 320, 512, 256), None),
        ((2, 384, 768, 384), None),
        ((16, 320, 768, 1024), None),
        (
            (3, 320, 512, 256),
            MosaicFp8Tiling(
                tile_n=128, max_concurrent_steps=2, split_columns=True, programs=4, chain=True
            ),
        ),
        (
            (2, 384, 768, 384),
            MosaicFp8Tiling(
                tile_n=128, max_concurrent_steps=3, grid_block_n=1, programs=5, chain=True
            ),
        ),
    ],
    ids=[
        "columns split",
        "rows split",
        "table, chained",
        "columns split, chained",
        "rows split, chained",
    ],
)
def test_compiled_batched_kernel_matches_reference(shape, tiling):
    """The batched wgmma kernel as the GPU compiles it, at the table's tilings: 64-row tiles
    with the weight tile split (a capacity of 320 rows), 128-row tiles (384), and enough
    256-wide tiles (320 over 132 programs) for the table's chain of 6 steps, 3 in flight; bf16
    out; and with few programs, each walking several tiles with their pipelines chained (4 and
    6 steps deep, 2 and 3 in flight), so a block loaded into the wrong slot or tile shows."""
    args = batched_operands(*shape)
    want = fp8_batched_matmul_reference(*args, out_dtype=jnp.bfloat16)
    got = fp8_batched_matmul(
        *args, out_dtype=jnp.bfloat16, impl=Fp8MatmulImpl.PALLAS_GPU, tiling=tiling
    )
    chex.assert_trees_all_close(got, want, rtol=2.0**-7, atol=2.0**-7 * float(jnp.abs(want).max()))


def test_batched_tiling_table_chains_split_tiles_where_256_divides_the_columns():
    """Where 256 divides N: 64-row tiles, the 256-row weight tile split between the
    warpgroups, chained, with 4 steps in flight where they divide the scale blocks, else 3
    where that does (6 blocks deep: 3). Elsewhere unchained: capacities that are multiples of
    64 but not of 128 take 64-row tiles with the weight tile split, multiples of 128 take
    128-row tiles; a split needs tile_n in multiples of 64."""
    chained = MosaicFp8Tiling(tile_n=256, grid_block_n=1, split_columns=True, chain=True)
    assert mosaic_fp8_batched_tiling(320, 2048, 1536) == chained
    assert mosaic_fp8_batched_tiling(384, 2048, 1536) == chained
    assert mosaic_fp8_batched_tiling(320, 768, 2048) == dataclasses.replace(
        chained, max_concurrent_steps=3
    )
    assert mosaic_fp8_batched_tiling(320, 640, 2048).max_concurrent_steps == 4
    assert mosaic_fp8_batched_tiling(320, 768, 640) == MosaicFp8Tiling(
        tile_n=128, grid_block_n=1, split_columns=True
    )
    assert mosaic_fp8_batched_tiling(384, 2048, 576) == MosaicFp8Tiling(tile_n=192, grid_block_n=1)
    assert MosaicFp8Tiling(tile_n=128, split_columns=True).tile_a == 64
    assert MosaicFp8Tiling(tile_n=128).tile_a == 128
    with pytest.raises(ValueError, match="multiple of 64"):
        MosaicFp8Tiling(tile_n=96, split_columns=True)
    with pytest.raises(ValueError, match="programs"):
        MosaicFp8Tiling(cluster=True, programs=1)
