"""FP8 kernels: the fused add + RMSNorm + quantize and the block-scaled matmuls equal their
references; the format and the sums are what the checkpoints and the H200 kernels assume."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import (
    Impl,
    add_rms_norm_quantize,
    add_rms_norm_quantize_reference,
    add_rms_norm_quantize_supported,
    quantize_rows,
    quantize_rows_reference,
    quantize_rows_supported,
)
from pallas_kernels.fp8_matmul import (
    TRITON_MAX_ROWS,
    Fp8GroupedImpl,
    Fp8MatmulImpl,
    MosaicFp8Tiling,
    TritonFp8Tiling,
    fp8_grouped_matmul,
    fp8_grouped_matmul_reference,
    fp8_matmul,
    fp8_matmul_by_size,
    fp8_matmul_reference,
    mosaic_fp8_tiling,
    triton_fp8_tiling,
)
from pallas_kernels.quantize import (
    FP8_MAX,
    dequantize_blocks_reference,
    dequantize_token_groups_reference,
    quantize_blocks_reference,
    quantize_token_groups_reference,
)
from tests.markers import GPU_INTERPRET, ON_GPU
from tests.meshes import make_mesh


def fp8_steps(values: np.ndarray) -> np.ndarray:
    """The spacing of float8_e4m3fn at each value (3 mantissa bits; subnormals below 2^-6)."""
    magnitude = np.maximum(np.abs(values.astype(np.float32)), 2.0**-6)
    return 2.0 ** (np.floor(np.log2(magnitude)) - 3)


# --------------------------------------------------------------------------------------------
# The format


def test_token_group_format():
    """Each group's scale is its max |x| / 448 (as max x float32(1/448), what XLA computes);
    values * scale give x back to half a step; a group of zeros stays zero."""
    x = jax.random.normal(jax.random.key(0), (3, 384)) * jnp.array([1e-3, 1.0, 40.0])[:, None]
    x = x.at[1, 128:256].set(0.0)
    values, scales = quantize_token_groups_reference(x)
    want = np.abs(np.asarray(x)).reshape(3, 3, 128).max(-1) * np.float32(1 / 448)
    np.testing.assert_array_equal(np.asarray(scales), want.astype(np.float32))
    assert np.abs(np.asarray(values, np.float32)).max() == FP8_MAX
    back = np.asarray(dequantize_token_groups_reference(values, scales))
    half_step = fp8_steps(np.asarray(values)) / 2 * np.repeat(np.asarray(scales), 128, axis=1)
    assert np.all(np.abs(back - np.asarray(x)) <= half_step * (1 + 1e-6))
    assert np.all(back[1, 128:256] == 0)


def test_block_format():
    """A weight's scale covers a 128 x 128 square: dequantized, each weight is within half an
    FP8 step of itself."""
    w = jax.random.normal(jax.random.key(1), (256, 384)) * jnp.arange(1, 257)[:, None]
    values, scales = quantize_blocks_reference(w)
    assert values.dtype == jnp.float8_e4m3fn and scales.shape == (2, 3)
    square = np.abs(np.asarray(w)[128:, 256:]).max() * np.float32(1 / 448)
    assert np.asarray(scales)[1, 2] == np.float32(square)
    back = np.asarray(dequantize_blocks_reference(values, scales))
    per_weight = np.repeat(np.repeat(np.asarray(scales), 128, axis=0), 128, axis=1)
    half_step = fp8_steps(np.asarray(values)) / 2 * per_weight
    assert np.all(np.abs(back - np.asarray(w)) <= half_step * (1 + 1e-6))


# --------------------------------------------------------------------------------------------
# Fused add + RMSNorm + quantize


def make_inputs(shape, dtype, seed=0):
    kx, kr, kw = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, shape).astype(dtype)
    residual = (3 * jax.random.normal(kr, shape)).astype(dtype)
    weight = 1 + jax.random.normal(kw, shape[-1:])
    return x, residual, weight


def separately(x, residual, weight):
    """Add, norm and quantize as three steps (the boundary's unfused read)."""
    from boundary_jax.designs import add_rms_norm, quantize_token_groups

    normed, summed = add_rms_norm(x, residual, weight, eps=1e-6)
    quantized = quantize_token_groups(normed)
    return quantized.values, quantized.scales, summed


@functools.cache
def fused_bf16():
    """The kernel's outputs for bf16 inputs with a ragged last block of rows, and the inputs."""
    x, residual, weight = make_inputs((19, 384), jnp.bfloat16)
    outputs = add_rms_norm_quantize(x, residual, weight, impl=Impl.PALLAS_INTERPRET)
    return outputs, (x, residual, weight)


def test_fused_read_equals_add_norm_quantize():
    """The kernel's scales equal the separate steps' bit for bit, its values within one FP8
    step (here: equal), and its new residual is the float32 sum rounded."""
    (values, scales, summed), inputs = fused_bf16()
    want_values, want_scales, want_summed = separately(*inputs)
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
    np.testing.assert_array_equal(np.asarray(summed), np.asarray(want_summed))
    got, want = np.asarray(values, np.float32), np.asarray(want_values, np.float32)
    assert np.all(np.abs(got - want) <= fp8_steps(want))
    chex.assert_trees_all_equal((values, scales, summed), add_rms_norm_quantize_reference(*inputs))


def test_the_sum_is_accumulated_in_float32():
    """Rounding the sum to bf16 before the norm, as a kernel without float32 accumulation
    would, changes the scales: the bit-for-bit check above would fail."""
    (_, scales, _), (x, residual, weight) = fused_bf16()
    rounded_first = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(jnp.bfloat16)
    _, wrong_scales, _ = separately(rounded_first, jnp.zeros_like(x), weight)
    assert np.sum(np.asarray(scales) != np.asarray(wrong_scales)) > 5


def test_fused_read_float32_within_one_rounding():
    """In float32 the norm's reduction order may move a scale by one rounding, no more."""
    x, residual, weight = make_inputs((9, 256), jnp.float32, seed=2)
    values, scales, summed = add_rms_norm_quantize(x, residual, weight, impl=Impl.PALLAS_INTERPRET)
    want_values, want_scales, want_summed = separately(x, residual, weight)
    np.testing.assert_allclose(np.asarray(scales), np.asarray(want_scales), rtol=2.0**-22)
    np.testing.assert_array_equal(np.asarray(summed), np.asarray(want_summed))
    got, want = np.asarray(values, np.float32), np.asarray(want_values, np.float32)
    assert np.all(np.abs(got - want) <= fp8_steps(want))


def test_fused_read_support_and_errors():
    """No kernel on CPU by default; a group must divide the rows; an explicit backend that
    cannot run raises."""
    assert not add_rms_norm_quantize_supported(
        platform="cpu", rows=8, hidden=256, dtype=jnp.bfloat16
    )
    assert add_rms_norm_quantize_supported(platform="gpu", rows=8, hidden=4096, dtype=jnp.bfloat16)
    assert not add_rms_norm_quantize_supported(
        platform="gpu", rows=8, hidden=4000, dtype=jnp.bfloat16
    )
    x, residual, weight = make_inputs((4, 200), jnp.float32)
    with pytest.raises(ValueError, match="multiple of group=128"):
        add_rms_norm_quantize(x, residual, weight)
    x, residual, weight = make_inputs((4, 256), jnp.float32)
    with pytest.raises(NotImplementedError, match="add_rms_norm_quantize_supported"):
        add_rms_norm_quantize(x, residual, weight, impl=Impl.PALLAS_TPU)


# --------------------------------------------------------------------------------------------
# Rows activated and quantized in one pass


def gated_rows(rows, features, dtype, seed=3):
    """[rows, 2, features]: gate and up rows of different scales, with a zero group (scale 0)."""
    gate_key, up_key = jax.random.split(jax.random.key(seed))
    gate = 2 * jax.random.normal(gate_key, (rows, features))
    up = jax.random.normal(up_key, (rows, features)) * jnp.linspace(0.5, 8.0, features)[None]
    up = up.at[0, :128].set(0.0)
    return jnp.stack([gate, up], axis=1).astype(dtype)


# XLA's GPU compiler drops the bf16 round trip of the interpreted body (excess precision), so the
# bit-for-bit checks run on CPU; the compiled Triton kernel has its own GPU test below.
CPU_ONLY = pytest.mark.skipif(jax.default_backend() == "gpu", reason="interpreted on XLA CPU")


@CPU_ONLY
@pytest.mark.parametrize(
    "shape, dtype, activation",
    [
        ((19, 2, 384), jnp.bfloat16, jax.nn.silu),  # one row and one group per program
        ((16, 2, 1024), jnp.bfloat16, jax.nn.silu),  # 16 rows and 4 groups per program
        ((8, 2, 640), jnp.float32, jax.nn.silu),
        ((12, 512), jnp.float16, jax.nn.relu),
        ((6, 256), jnp.float32, None),
    ],
    ids=["gated ragged", "gated blocks", "gated float32", "activated", "plain"],
)
def test_quantize_rows_kernel_equals_its_reference(shape, dtype, activation):
    """The kernel (interpreted) gives the reference's values and scales bit for bit, and the
    reference is the activation (`activation(gate) * up` for stacked rows) quantized per token
    group: each gate block is multiplied by its own up block."""
    rows, features = shape[0], shape[-1]
    x = gated_rows(rows, features, dtype) if len(shape) == 3 else gated_rows(*shape, dtype)[:, 1]
    got = quantize_rows(x, activation=activation, impl=Impl.PALLAS_INTERPRET)
    reference = jax.jit(functools.partial(quantize_rows_reference, activation=activation))
    chex.assert_trees_all_equal(got, reference(x))
    act = (lambda v: v) if activation is None else activation

    @jax.jit
    def separately(x):
        wide = x.astype(jnp.float32)
        y = act(wide[:, 0]) * wide[:, 1] if x.ndim == 3 else act(wide)
        return quantize_token_groups_reference(y.astype(dtype))

    chex.assert_trees_all_equal(got, separately(x))
    assert float(jnp.min(got[1])) == 0.0 and float(jnp.max(got[1])) > 0.0


@CPU_ONLY
def test_quantize_rows_rounds_the_activation_to_the_input_dtype():
    """The activation is rounded to bf16 before it is quantized, as the unfused layer rounds
    it: quantizing the float32 product instead changes scales, so the test above would fail."""
    x = gated_rows(19, 384, jnp.bfloat16)
    _, scales = quantize_rows(x, activation=jax.nn.silu, impl=Impl.PALLAS_INTERPRET)
    wide = x.astype(jnp.float32)
    _, unrounded = quantize_token_groups_reference(jax.nn.silu(wide[:, 0]) * wide[:, 1])
    assert np.sum(np.asarray(scales) != np.asarray(unrounded)) > 5


def test_quantize_rows_support_and_errors():
    """Triton on GPU by default, XLA elsewhere (any float dtype there); other shapes raise."""
    assert quantize_rows_supported(platform="gpu", features=14336, dtype=jnp.bfloat16)
    assert not quantize_rows_supported(platform="cpu", features=4096, dtype=jnp.bfloat16)
    assert not quantize_rows_supported(platform="gpu", features=4000, dtype=jnp.bfloat16)
    assert not quantize_rows_supported(
        platform="gpu", features=384, dtype=jnp.bfloat16, group=96, impl=Impl.PALLAS_TRITON
    )
    assert quantize_rows_supported(platform="cpu", features=256, dtype=jnp.float64, impl=Impl.XLA)
    with pytest.raises(ValueError, match=r"\[rows, 2, features\]"):
        quantize_rows(jnp.zeros((4, 3, 256)))
    with pytest.raises(ValueError, match="multiple of group=128"):
        quantize_rows(jnp.zeros((4, 200)))
    with pytest.raises(NotImplementedError, match="quantize_rows_supported"):
        quantize_rows(jnp.zeros((4, 256)), impl=Impl.PALLAS_TPU)


# --------------------------------------------------------------------------------------------
# Block-scaled matmuls


@functools.cache
def operands(m=20, k=256, n=128, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k)) * jnp.linspace(0.5, 4.0, m)[:, None]
    w = jax.random.normal(kw, (n, k)) * jnp.linspace(0.1, 3.0, n)[:, None]
    return (*quantize_token_groups_reference(x), *quantize_blocks_reference(w))


def test_reference_is_the_dequantized_product():
    """The reference is the product of the dequantized operands, to float32 rounding."""
    x_values, x_scales, w_values, w_scales = operands()
    got = np.asarray(fp8_matmul_reference(*operands(), out_dtype=jnp.float32))
    x = np.asarray(dequantize_token_groups_reference(x_values, x_scales), np.float64)
    w = np.asarray(dequantize_blocks_reference(w_values, w_scales), np.float64)
    np.testing.assert_allclose(got, x @ w.T, atol=1e-6 * np.abs(x @ w.T).max())


def test_dequantized_bf16_matmul_is_the_reference_to_bf16_rounding():
    """XLA's bf16 path (operands dequantized to bf16, float32 sums) differs from the reference
    only by one bf16 rounding of each operand."""
    with jax.default_matmul_precision("highest"):  # float32 dots, not TF32, on a GPU
        want = np.asarray(fp8_matmul_reference(*operands(), out_dtype=jnp.float32))
    got = fp8_matmul(*operands(), out_dtype=jnp.float32, impl=Fp8MatmulImpl.DEQUANTIZED_BF16)
    error = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
    assert 0 < error < 2.0**-7


def test_gpu_by_size_takes_triton_for_few_rows_and_mosaic_above():
    """GPU_BY_SIZE: the Triton kernel up to `TRITON_MAX_ROWS` rows, the Mosaic kernel above."""
    assert fp8_matmul_by_size(TRITON_MAX_ROWS) is Fp8MatmulImpl.PALLAS_TRITON
    assert fp8_matmul_by_size(TRITON_MAX_ROWS + 1) is Fp8MatmulImpl.PALLAS_GPU
    assert fp8_matmul_by_size(4096) is Fp8MatmulImpl.PALLAS_GPU


@pytest.mark.parametrize(
    "tiling",
    [
        TritonFp8Tiling(block_n=64),
        TritonFp8Tiling(block_m=16, block_n=128, split_k=2),
        TritonFp8Tiling(block_m=16, block_n=64, split_k=2, fp8_dot=True),
    ],
    ids=["one split", "split k", "fp8 dot"],
)
def test_triton_decode_kernel_matches_reference(tiling):
    """The decode kernel (interpreted), with and without a split contraction and over several
    row blocks, equals the reference to float32 rounding."""
    with jax.default_matmul_precision("highest"):  # float32 dots, not TF32, on a GPU
        want = np.asarray(fp8_matmul_reference(*operands(), out_dtype=jnp.float32))
        got = fp8_matmul(
            *operands(), out_dtype=jnp.float32, impl=Fp8MatmulImpl.PALLAS_INTERPRET, tiling=tiling
        )
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6 * np.abs(want).max())


@ON_GPU
@pytest.mark.parametrize(
    "impl, tiling",
    [
        (Fp8MatmulImpl.PALLAS_TRITON, TritonFp8Tiling(block_n=64)),
        (Fp8MatmulImpl.PALLAS_TRITON, TritonFp8Tiling(block_m=16, block_n=128, split_k=2)),
        (Fp8MatmulImpl.PALLAS_TRITON, TritonFp8Tiling(block_m=16, split_k=2, fp8_dot=True)),
        (Fp8MatmulImpl.PALLAS_GPU, MosaicFp8Tiling(tile_n=64, grid_block_n=2)),
        (Fp8MatmulImpl.PALLAS_GPU, MosaicFp8Tiling(tile_n=32, split_k=2, swap=True)),
        (Fp8MatmulImpl.PALLAS_GPU, MosaicFp8Tiling(tile_n=64, cluster=True)),
        (Fp8MatmulImpl.PALLAS_GPU, None),
        (
            Fp8MatmulImpl.PALLAS_GPU,
            MosaicFp8Tiling(tile_n=64, max_concurrent_steps=2, programs=2, chain=True),
        ),
        (
            Fp8MatmulImpl.PALLAS_GPU,
            MosaicFp8Tiling(
                tile_n=32, split_k=2, swap=True, max_concurrent_steps=2, programs=2, chain=True
            ),
        ),
        (
            Fp8MatmulImpl.PALLAS_GPU,
            MosaicFp8Tiling(
                tile_n=64, cluster=True, max_concurrent_steps=2, programs=2, chain=True
            ),
        ),
    ],
    ids=[
        "triton",
        "triton split k",
        "triton fp8 dot",
        "mosaic",
        "mosaic swap",
        "mosaic cluster",
        "mosaic table",
        "mosaic chained",
        "mosaic swap chained",
        "mosaic cluster chained",
    ],
)
def test_compiled_gpu_kernels_match_reference(impl, tiling):
    """The kernels as the GPU compiles them (the interpreter accepts indexing that the Triton and
    Mosaic lowerings refuse), bf16 out; with two programs walking the tiles, their pipelines
    chained from tile to tile."""
    want = fp8_matmul_reference(*operands(k=512, n=256), out_dtype=jnp.bfloat16)
    got = fp8_matmul(*operands(k=512, n=256), out_dtype=jnp.bfloat16, impl=impl, tiling=tiling)
    chex.assert_trees_all_close(got, want, rtol=2.0**-7, atol=2.0**-7 * float(jnp.abs(want).max()))


@ON_GPU
@pytest.mark.parametrize("shape", [(8, 2, 14336), (33, 2, 1408), (4096, 4096)])
def test_compiled_quantize_rows_kernel_matches_reference(shape):
    """The Triton kernel as the GPU compiles it: SiLU's float32 may differ from XLA's by a
    rounding, which bf16 rounding of the product can pass on, so scales agree to a bf16 step
    and values to an FP8 step; the plain rows are exact."""
    rows, features = shape[0], shape[-1]
    x = gated_rows(rows, features, jnp.bfloat16)
    activation = jax.nn.silu
    if len(shape) == 2:
        x, activation = x[:, 1], None
    values, scales = quantize_rows(x, activation=activation, impl=Impl.PALLAS_TRITON)
    want_values, want_scales = quantize_rows_reference(x, activation=activation)
    if activation is None:
        chex.assert_trees_all_equal((values, scales), (want_values, want_scales))
    np.testing.assert_allclose(np.asarray(scales), np.asarray(want_scales), rtol=2.0**-7)
    got, want = np.asarray(values, np.float32), np.asarray(want_values, np.float32)
    assert np.all(np.abs(got - want) <= 2 * fp8_steps(want))


@ON_GPU
@pytest.mark.parametrize("shape", [(19, 384), (1024, 4096)])
def test_compiled_add_rms_norm_quantize_kernel_matches_reference(shape):
    """The fused read's Triton kernel as the GPU compiles it: the new residual exact, the
    scales within the norm's float32 reduction order, the values within an FP8 step. The
    reference runs after the kernel on the same inputs: a ragged block (19 rows, 384 of 512
    lanes) stored past the outputs would have overwritten them."""
    inputs = make_inputs(shape, jnp.bfloat16, seed=3)
    values, scales, summed = add_rms_norm_quantize(*inputs, impl=Impl.PALLAS_TRITON)
    want_values, want_scales, want_summed = add_rms_norm_quantize_reference(*inputs)
    np.testing.assert_array_equal(np.asarray(summed), np.asarray(want_summed))
    np.testing.assert_allclose(np.asarray(scales), np.asarray(want_scales), rtol=2.0**-7)
    got, want = np.asarray(values, np.float32), np.asarray(want_values, np.float32)
    assert np.all(np.abs(got - want) <= fp8_steps(want))


@ON_GPU
def test_compiled_grouped_kernel_matches_reference():
    """The experts' Triton kernel as the GPU compiles it, an empty group included."""
    x_values, x_scales = quantize_token_groups_reference(
        jax.random.normal(jax.random.key(1), (13, 256))
    )
    w_values, w_scales = quantize_blocks_reference(
        jax.random.normal(jax.random.key(2), (3, 128, 256))
    )
    args = (x_values, x_scales, w_values, w_scales, jnp.array([4, 0, 6], jnp.int32))
    with jax.default_matmul_precision("highest"):
        want = np.asarray(fp8_grouped_matmul_reference(*args, out_dtype=jnp.float32))
    got = fp8_grouped_matmul(*args, out_dtype=jnp.float32, impl=Fp8GroupedImpl.PALLAS_TRITON)
    np.testing.assert_allclose(np.asarray(got)[:10], want[:10], atol=1e-5 * np.abs(want).max())


@GPU_INTERPRET
@pytest.mark.parametrize(
    "shape, tiling",
    [
        ((130, 256, 256), MosaicFp8Tiling(tile_n=128, grid_block_n=2)),
        ((40, 384, 256), MosaicFp8Tiling(tile_n=64, swap=True)),
        ((8, 256, 256), MosaicFp8Tiling(tile_n=32, split_k=2, grid_block_n=1, swap=True)),
        pytest.param(
            (300, 256, 256), MosaicFp8Tiling(tile_n=64, cluster=True), marks=pytest.mark.slow
        ),
    ],
    ids=["rows as A", "weight as A", "weight as A, split k", "clusters of two"],
)
def test_mosaic_kernel_matches_reference(shape, tiling):
    """The wgmma kernel (in the Mosaic GPU interpreter) equals the reference to float32 rounding:
    rows padded to whole tiles, the weight as either operand, the contraction split, row tiles
    paired in clusters that share the weight's blocks. Row and weight scales differ per block,
    so a scale read for the wrong block or row shows."""
    m, k, n = shape
    args = operands(m=m, k=k, n=n, seed=7)
    want = np.asarray(fp8_matmul_reference(*args, out_dtype=jnp.float32))
    got = fp8_matmul(
        *args, out_dtype=jnp.float32, impl=Fp8MatmulImpl.PALLAS_GPU_INTERPRET, tiling=tiling
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6 * np.abs(want).max())


def test_grouped_kernel_matches_reference():
    """The experts' kernel reads only the groups with rows (an empty one included) and equals
    the reference on the rows the groups hold."""
    m, k, n = 13, 128, 128
    kx, kw = jax.random.split(jax.random.key(4))
    x_values, x_scales = quantize_token_groups_reference(jax.random.normal(kx, (m, k)))
    w = jax.random.normal(kw, (3, n, k)) * jnp.array([1.0, 5.0, 0.2])[:, None, None]
    w_values, w_scales = quantize_blocks_reference(w)
    sizes = jnp.array([4, 0, 6], jnp.int32)
    args = (x_values, x_scales, w_values, w_scales, sizes)
    with jax.default_matmul_precision("highest"):  # float32 dots, not TF32, on a GPU
        want = np.asarray(fp8_grouped_matmul_reference(*args, out_dtype=jnp.float32))
        got = fp8_grouped_matmul(*args, out_dtype=jnp.float32, impl=Fp8GroupedImpl.PALLAS_INTERPRET)
    np.testing.assert_allclose(np.asarray(got)[:10], want[:10], atol=1e-6 * np.abs(want).max())
    assert np.all(want[10:] == 0)


def test_kernel_types_its_output_inside_shard_map():
    """Under check_vma the interpreted decode kernel takes each rank's own weight shard (every
    shard different) and its output varies as the reference's."""
    x_values, x_scales, w_values, w_scales = operands(m=8, k=256, n=256, seed=5)
    mesh = make_mesh(1, 2)

    def body(x_values, x_scales, w_values, w_scales):
        return fp8_matmul(
            x_values, x_scales, w_values, w_scales,
            out_dtype=jnp.float32, impl=Fp8MatmulImpl.PALLAS_INTERPRET,
        )  # fmt: skip

    specs = (P(), P(), P("attn_tp", None), P("attn_tp", None))
    placed = [
        jax.device_put(a, NamedSharding(mesh, s))
        for a, s in zip((x_values, x_scales, w_values, w_scales), specs, strict=True)
    ]
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(None, "attn_tp")))
    with jax.default_matmul_precision("highest"):  # float32 dots, not TF32, on a GPU
        want = fp8_matmul_reference(x_values, x_scales, w_values, w_scales, out_dtype=jnp.float32)
    chex.assert_trees_all_close(run(*placed), want, atol=1e-6 * float(jnp.abs(want).max()))


def test_shapes_and_tilings_are_checked():
    """Shapes off the 128 blocks, unquantized operands and a tiling for the other kernel fail
    with what came in."""
    x_values, x_scales, w_values, w_scales = operands()
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_matmul(x_values, x_scales, w_values[:, :200], w_scales, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_matmul(
            x_values.astype(jnp.float32), x_scales, w_values, w_scales, out_dtype=jnp.float32
        )
    with pytest.raises(TypeError, match="TritonFp8Tiling"):
        fp8_matmul(
            *operands(),
            out_dtype=jnp.float32,
            impl=Fp8MatmulImpl.PALLAS_INTERPRET,
            tiling=MosaicFp8Tiling(),
        )
    with pytest.raises(ValueError, match="block_n must divide"):
        TritonFp8Tiling(block_n=192)


def test_decode_tiling_table_fills_the_gpu():
    """The default decode tiling splits the contraction until every SM of an H200 has a
    program: none for a wide gate/up projection, more for the narrow down and kv ones, at most 8;
    128 columns per program above 16 rows."""
    assert triton_fp8_tiling(8, 4096, 28672).split_k == 1
    assert triton_fp8_tiling(8, 14336, 4096).split_k == 4
    assert triton_fp8_tiling(64, 4096, 14336) == TritonFp8Tiling(
        block_n=128, split_k=2, num_stages=3
    )
    assert triton_fp8_tiling(64, 4096, 2048).split_k == 8


def test_mosaic_tiling_table_swaps_for_decode_and_splits_within_one_wave():
    """Up to 128 rows the weight is the wgmma's A (rows padded to at least 32); the contraction
    splits while the programs still fit one wave of an H200's 132 SMs; prefill takes 224-row
    weight tiles where they divide the output features."""
    wide = mosaic_fp8_tiling(8, 4096, 14336)  # 112 tiles of 128 weight rows
    assert (wide.swap, wide.tile_n, wide.split_k) == (True, 32, 1)
    assert mosaic_fp8_tiling(64, 4096, 4096).split_k == 4  # 32 tiles: 128 programs
    assert mosaic_fp8_tiling(64, 4096, 6144).split_k == 2  # 48 tiles: 96 programs
    assert mosaic_fp8_tiling(100, 1024, 256).split_k == 8  # capped at 8 (of 8 blocks)
    assert mosaic_fp8_tiling(100, 1024, 256).tile_n == 128
    assert mosaic_fp8_tiling(4096, 4096, 6144) == MosaicFp8Tiling(tile_n=192, grid_block_n=2)
    assert mosaic_fp8_tiling(4096, 4096, 28672) == MosaicFp8Tiling(
        tile_n=224, max_concurrent_steps=2, grid_block_n=2
    )
    assert not mosaic_fp8_tiling(129, 4096, 4096).swap
    assert mosaic_fp8_tiling(129, 4096, 4096).tile_n == 128
