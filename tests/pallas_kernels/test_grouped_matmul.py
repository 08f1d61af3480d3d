"""The grouped matmuls: the gather-by-expert Triton kernel equals `lax.ragged_dot` on the rows
it covers, in the Pallas interpreter (CPU) and compiled for Triton (GPU only); the choice by
size, the tuned tilings and the platform defaults."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers.moe import experts as routed_experts
from models.layers.moe import routing as moe_routing
from pallas_kernels.grouped_matmul import (
    HOPPER_AVAILABLE,
    HOPPER_MAX_GROUPS,
    TRITON_MAX_ROUTED_ROWS,
    GroupedMatmulImpl,
    TritonTiling,
    default_grouped_matmul_impl,
    expert_matmul,
    grouped_matmul,
    hopper_tiling,
    ops,
    triton_tiling,
)
from pallas_kernels.grouped_matmul import grouped_matmul_reference as expert_matmul_reference
from pallas_kernels.grouped_matmul.tuned_block_sizes import PREFILL_ROWS_PER_GROUP

TILING = TritonTiling(block_rows=16, block_n=128, block_k=64)


def case(group_sizes, k=128, n=256, dtype=jnp.float32, seed=0):
    """Rows filling `group_sizes` plus 3 rows past them; weights differ per group."""
    m = sum(group_sizes) + 3
    kr, kw = jax.random.split(jax.random.key(seed))
    rows = jax.random.normal(kr, (m, k), jnp.float32).astype(dtype)
    weights = jax.random.normal(kw, (len(group_sizes), k, n), jnp.float32).astype(dtype)
    return rows, weights, jnp.asarray(group_sizes, jnp.int32)


@pytest.mark.parametrize("columns_inner", [False, True], ids=["experts-inner", "columns-inner"])
@pytest.mark.parametrize(
    "group_sizes",
    [(3, 0, 17, 0, 0, 1), (0, 0, 0, 5), (40,)],
    ids=["empty-and-two-row-blocks", "last-only", "one-group-three-blocks"],
)
def test_interpreted_kernel_matches_ragged_dot(group_sizes, columns_inner):
    """Every covered row equals ragged_dot's: empty groups skipped, a group spanning several
    row blocks, groups starting mid-block; in either launch order."""
    rows, weights, sizes = case(group_sizes)
    covered = sum(group_sizes)
    tiling = dataclasses.replace(TILING, columns_inner=columns_inner)
    got = expert_matmul(rows, weights, sizes, tiling=tiling, interpret=True)[:covered]
    want = expert_matmul_reference(rows, weights, sizes)[:covered]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_a_row_read_with_the_wrong_weights_would_show():
    """The check above notices a row given its neighbour group's weights."""
    rows, weights, sizes = case((3, 0, 17, 0, 0, 1))
    shifted = expert_matmul_reference(rows, weights, jnp.asarray([4, 0, 16, 0, 0, 1]))
    want = expert_matmul_reference(rows, weights, sizes)
    assert not np.allclose(np.asarray(shifted[:21]), np.asarray(want[:21]), atol=1e-2)


def test_bad_shapes_and_tilings_are_rejected():
    rows, weights, sizes = case((4, 4))
    with pytest.raises(ValueError, match="does not divide"):
        expert_matmul(rows, weights, sizes, tiling=TritonTiling(block_n=96))
    with pytest.raises(ValueError, match="group_sizes"):
        expert_matmul(rows, weights, sizes[:1])


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="Triton runs on GPU only")
def test_pallas_triton_layer_matches_ragged_dot_on_gpu():  # pragma: no cover - GPU only
    """On a GPU, the MoE expert outputs through PALLAS_TRITON equal RAGGED_DOT's (bf16)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((24, 256)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((256, 16)), jnp.bfloat16)
    gate_up = jnp.asarray(rng.standard_normal((16, 256, 2, 128)) / 16, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((16, 128, 256)) / 11, jnp.bfloat16)
    routing = moe_routing.route(x, router, top_k=4, renormalize=True)
    outs = [
        jax.jit(routed_experts.expert_outputs, static_argnames="impl")(
            x, routing, gate_up, down, impl=impl
        )
        for impl in (GroupedMatmulImpl.RAGGED_DOT, GroupedMatmulImpl.PALLAS_TRITON)
    ]
    want, got = (np.asarray(o, np.float32) for o in outs)
    assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="Triton runs on GPU only")
def test_prefill_tiling_matches_ragged_dot_on_gpu():  # pragma: no cover - GPU only
    """On a GPU, the Triton kernel's prefill tiling (128-row blocks, one expert's columns
    launched together) equals ragged_dot on uneven groups of 0 to 300 rows (bf16)."""
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 300, 48).astype(np.int32)
    sizes[[3, 17]] = 0
    rows, weights, group_sizes = case(tuple(sizes), k=512, n=256, dtype=jnp.bfloat16)
    tiling = triton_tiling(512, 256, jnp.bfloat16, rows_per_group=float(sizes.mean()))
    assert tiling.block_rows == 128 and tiling.columns_inner
    covered = int(sizes.sum())
    got = expert_matmul(rows, weights, group_sizes)[:covered]
    want = expert_matmul_reference(
        rows.astype(jnp.float32), weights.astype(jnp.float32), group_sizes
    )[:covered]
    got, want = np.asarray(got, np.float32), np.asarray(want)
    assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


def test_tuned_triton_tilings():
    """The Triton kernel's table: 16-row blocks at decode sizes; one expert's columns launched
    together, in 64-row blocks from PREFILL_ROWS_PER_GROUP rows per expert and 128-row blocks
    from 48; narrower tiles where the default does not divide the shape."""
    decode = triton_tiling(2048, 1024, jnp.bfloat16, rows_per_group=PREFILL_ROWS_PER_GROUP - 1)
    assert (decode.block_rows, decode.block_n, decode.columns_inner) == (16, 128, False)
    middle = triton_tiling(2048, 1024, jnp.bfloat16, rows_per_group=PREFILL_ROWS_PER_GROUP)
    assert (middle.block_rows, middle.block_n, middle.num_warps) == (64, 128, 8)
    prefill = triton_tiling(2048, 1024, jnp.bfloat16, rows_per_group=48.0)
    assert (prefill.block_rows, prefill.block_n, prefill.num_warps) == (128, 128, 8)
    assert middle.columns_inner and prefill.columns_inner
    narrow = triton_tiling(48, 96, jnp.bfloat16, rows_per_group=80.0)
    assert (narrow.block_rows, narrow.block_n, narrow.block_k) == (128, 32, 16)
    with pytest.raises(NotImplementedError, match="k % 16"):
        triton_tiling(24, 128, jnp.bfloat16)


def test_gpu_by_size_picks_the_kernel_by_routed_rows(monkeypatch):
    """GPU_BY_SIZE runs the Triton kernel up to TRITON_MAX_ROUTED_ROWS rows, the Hopper kernel
    above, and the Triton kernel again for more than HOPPER_MAX_GROUPS experts (both stood in
    for by ragged_dot, recording which ran)."""
    ran = []

    def triton(rows, weights, group_sizes, *, tiling, interpret):
        ran.append(("triton", rows.shape[0]))
        return expert_matmul_reference(rows, weights, group_sizes)

    def hopper(rows, weights, group_sizes, *, tiling):
        ran.append(("hopper", rows.shape[0]))
        return expert_matmul_reference(rows, weights, group_sizes)

    monkeypatch.setattr(ops, "expert_matmul", triton)
    monkeypatch.setattr(ops, "hopper_ragged_dot", hopper)
    monkeypatch.setattr(ops, "HOPPER_AVAILABLE", True)
    weights = jnp.zeros((4, 128, 128), jnp.bfloat16)
    sizes = jnp.asarray([1, 0, 2, 1], jnp.int32)
    limit = TRITON_MAX_ROUTED_ROWS
    for m in (8, limit, limit + 8):
        rows = jnp.zeros((m, 128), jnp.bfloat16)
        grouped_matmul(rows, weights, sizes, impl=GroupedMatmulImpl.GPU_BY_SIZE)
    assert ran == [("triton", 8), ("triton", limit), ("hopper", limit + 8)]
    ran.clear()
    many = jnp.zeros((HOPPER_MAX_GROUPS + 1, 128, 128), jnp.bfloat16)
    many_sizes = jnp.zeros((HOPPER_MAX_GROUPS + 1,), jnp.int32).at[0].set(limit + 8)
    grouped_matmul(rows, many, many_sizes, impl=GroupedMatmulImpl.GPU_BY_SIZE)
    grouped_matmul(rows, many[:-1], many_sizes[:-1], impl=GroupedMatmulImpl.GPU_BY_SIZE)
    assert ran == [("triton", limit + 8), ("hopper", limit + 8)]
    # Widths that are not a multiple of the default tile still take the Triton kernel with
    # narrower tiles (GPT-OSS's down projection, 2880 wide); widths no tile of 16 divides fall
    # back to ragged_dot.
    ran.clear()
    wide = jnp.zeros((4, 128, 2880), jnp.bfloat16)
    grouped_matmul(rows[:8], wide, sizes, impl=GroupedMatmulImpl.GPU_BY_SIZE)
    assert ran == [("triton", 8)]
    ran.clear()
    narrow = jnp.ones((4, 128, 8), jnp.bfloat16)
    for m in (8, limit + 8):
        rows = jnp.ones((m, 128), jnp.bfloat16)
        got = grouped_matmul(rows, narrow, sizes, impl=GroupedMatmulImpl.GPU_BY_SIZE)
        np.testing.assert_allclose(np.asarray(got[:4], np.float32), 128.0)
    assert ran == []


def test_tuned_hopper_tilings():
    """The Hopper kernel's table: 16-bit only, tiles that divide the shape, 128 x 192 on the
    gate | up projection and 64 x 256 with 4 column blocks per step on the down projection of
    Qwen3-30B-A3B, 64 x 256 with one column block per step on DeepSeek-V2-Lite's gate | up, and
    128 x 192 with 3 column blocks per step on GPT-OSS-20B's projections."""
    with pytest.raises(NotImplementedError, match="bf16/f16"):
        hopper_tiling(64, 128, jnp.float32)
    with pytest.raises(NotImplementedError, match="n % 64 == 0"):
        hopper_tiling(64, 48, jnp.bfloat16)
    assert hopper_tiling(2048, 768, jnp.bfloat16).block_n == 192
    down = hopper_tiling(768, 2048, jnp.bfloat16)
    assert (down.block_m, down.block_n, down.grid_block_n) == (64, 256, 4)
    deepseek = hopper_tiling(2048, 2816, jnp.bfloat16)
    assert (deepseek.block_m, deepseek.block_n, deepseek.grid_block_n) == (64, 256, 1)
    assert hopper_tiling(64, 320, jnp.bfloat16).block_n == 64
    for n in (5760, 2880):  # GPT-OSS-20B's gate | up and down
        gpt_oss = hopper_tiling(2880, n, jnp.bfloat16)
        assert (gpt_oss.block_m, gpt_oss.block_n, gpt_oss.grid_block_n) == (128, 192, 3)


def test_a_tiling_is_an_argument_and_must_fit_its_kernel():
    """A tiling (or a table of them by shape) reaches the kernel; one for the other kernel, or
    one that does not divide the shape, is rejected."""
    rows, weights, sizes = case((3, 0, 17))
    seen = []

    def table(k, n, dtype):
        seen.append((k, n))
        return TILING

    interpret = GroupedMatmulImpl.PALLAS_INTERPRET
    got = grouped_matmul(rows, weights, sizes, impl=interpret, tiling=table)
    np.testing.assert_allclose(
        np.asarray(got[:20]),
        np.asarray(expert_matmul_reference(rows, weights, sizes)[:20]),
        rtol=1e-5,
        atol=1e-4,
    )
    assert seen == [(128, 256)]
    with pytest.raises(TypeError, match="TritonTiling"):
        grouped_matmul(
            rows, weights, sizes, impl=interpret, tiling=hopper_tiling(128, 256, jnp.bfloat16)
        )
    with pytest.raises(ValueError, match="does not divide"):
        grouped_matmul(rows, weights, sizes, impl=interpret, tiling=TritonTiling(block_k=96))


def test_default_impl_per_platform():
    """CPU and TPU use lax.ragged_dot; GPU picks by size between the Triton kernel and the
    Hopper kernel when JAX has the latter."""
    assert default_grouped_matmul_impl("cpu") is GroupedMatmulImpl.RAGGED_DOT
    assert default_grouped_matmul_impl("tpu") is GroupedMatmulImpl.RAGGED_DOT
    want = GroupedMatmulImpl.GPU_BY_SIZE if HOPPER_AVAILABLE else GroupedMatmulImpl.PALLAS_TRITON
    assert default_grouped_matmul_impl("gpu") is want
    assert default_grouped_matmul_impl("gpu", jnp.float32) is GroupedMatmulImpl.RAGGED_DOT
