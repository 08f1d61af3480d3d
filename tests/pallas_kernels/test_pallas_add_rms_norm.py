"""add_rms_norm: every kernel body equals the jnp reference; bad calls fail with clear errors."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    Impl,
    add_rms_norm,
    add_rms_norm_reference,
    add_rms_norm_supported,
    compat,
    round_residual,
)
from pallas_kernels.add_rms_norm import GpuLaunch, mosaic_gpu_add_rms_norm, triton_add_rms_norm
from tests.markers import GPU_INTERPRET

# Max error relative to the largest reference value: float32 to 1e-6, 16-bit to one rounding.
TOL = {jnp.float32: 1e-6, jnp.bfloat16: 2.0**-7, jnp.float16: 2.0**-10}


def make_inputs(shape, dtype, seed=0):
    """Random x, residual and weight (never zeros or ones), in `dtype`."""
    kx, kr, kw = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
    residual = (3 * jax.random.normal(kr, shape, jnp.float32)).astype(dtype)
    weight = (1 + jax.random.normal(kw, shape[-1:], jnp.float32)).astype(dtype)
    return x, residual, weight


reference = jax.jit(add_rms_norm_reference, static_argnames=("eps", "unit_offset"))


def assert_close(got, want, dtype):
    """Max |got - want| within TOL[dtype] of the largest |want|; same shapes and dtypes."""
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.all(np.isfinite(g)), "non-finite output: an unwritten or wrongly read row"
        np.testing.assert_array_less(np.max(np.abs(g - w)), TOL[dtype] * np.max(np.abs(w)) + 1e-30)


# (shape, dtype, unit_offset, with_residual): odd rows (ragged last block), odd hidden, batch dims.
CASES = [
    ((37, 256), jnp.float32, False, True),
    ((37, 256), jnp.bfloat16, True, True),
    ((1, 128), jnp.bfloat16, False, True),
    ((9, 1000), jnp.float32, False, True),
    ((9, 1000), jnp.bfloat16, True, False),
    ((2, 5, 384), jnp.float16, False, True),
    ((3, 2048), jnp.bfloat16, False, False),
    ((4, 16384), jnp.bfloat16, True, True),
]


def case_id(case):
    shape, dtype, unit_offset, with_residual = case
    return (
        "x".join(map(str, shape))
        + f"-{dtype.__name__}-offset{int(unit_offset)}-res{int(with_residual)}"
    )


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_interpret_kernel_matches_reference(case):
    """The BlockSpec kernel (TPU/Triton body) in the interpreter equals the reference."""
    shape, dtype, unit_offset, with_residual = case
    x, residual, weight = make_inputs(shape, dtype)
    residual = residual if with_residual else None
    got = add_rms_norm(x, residual, weight, unit_offset=unit_offset, impl=Impl.PALLAS_INTERPRET)
    assert_close(got, reference(x, residual, weight, unit_offset=unit_offset), dtype)


@pytest.mark.parametrize("unit_offset", [False, True], ids=["plain", "unit-offset"])
def test_interpret_kernel_applies_eps_as_the_reference(unit_offset):
    """A large eps and an all-zero row: the kernel adds eps where the reference does (a kernel
    that dropped it, or added it after the square root, would be off by far more than 1e-6;
    the zero row is eps's alone and must stay finite and zero)."""
    x, residual, weight = make_inputs((6, 256), jnp.float32, seed=4)
    x, residual = x.at[2].set(0.0), residual.at[2].set(0.0)
    got = add_rms_norm(
        x, residual, weight, eps=0.5, unit_offset=unit_offset, impl=Impl.PALLAS_INTERPRET
    )
    want = reference(x, residual, weight, eps=0.5, unit_offset=unit_offset)
    assert_close(got, want, jnp.float32)
    without = reference(x, residual, weight, eps=1e-6, unit_offset=unit_offset)[0]
    assert np.max(np.abs(np.asarray(want[0]) - np.asarray(without))) > 1e-2
    np.testing.assert_array_equal(np.asarray(got[0][2]), 0.0)


@GPU_INTERPRET
@pytest.mark.parametrize(
    "case", [c for c in CASES if c[0][-1] % 128 == 0 and c[0][-1] <= 2048], ids=case_id
)
def test_gpu_interpret_kernel_matches_reference(case):
    """The Mosaic GPU kernel in the Mosaic GPU interpreter equals the reference."""
    shape, dtype, unit_offset, with_residual = case
    x, residual, weight = make_inputs(shape, dtype)
    residual = residual if with_residual else None
    got = add_rms_norm(x, residual, weight, unit_offset=unit_offset, impl=Impl.PALLAS_GPU_INTERPRET)
    assert_close(got, reference(x, residual, weight, unit_offset=unit_offset), dtype)


@GPU_INTERPRET
@pytest.mark.parametrize("rows_per_step", [2, 3])
def test_gpu_kernel_multi_row_steps_cover_every_row(rows_per_step):
    """Steps of several rows (the last one short, re-doing the final row) write every row once."""
    x, residual, weight = make_inputs((11, 256), jnp.float32, seed=1)
    launch = GpuLaunch(num_programs=2, rows_per_step=rows_per_step, vector_size=2)
    got = mosaic_gpu_add_rms_norm(
        x,
        residual,
        weight,
        eps=1e-6,
        unit_offset=False,
        launch=launch,
        interpret=compat.gpu_interpret_params(),
    )
    assert_close(got, reference(x, residual, weight), jnp.float32)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_interpreted_triton_kernel_matches_reference(case):
    """The Triton kernel in the interpreter equals the reference: rows read in power-of-two lane
    chunks (1000 lanes: six chunks), whole rows per program, the last program sliding back over
    rows the one before it wrote (37 rows, 32 per program)."""
    shape, dtype, unit_offset, with_residual = case
    x, residual, weight = make_inputs(shape, dtype)
    x, residual = x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1])
    residual = residual if with_residual else None
    got = triton_add_rms_norm(
        x, residual, weight, eps=1e-6, unit_offset=unit_offset, interpret=True
    )
    want = reference(x, residual, weight, unit_offset=unit_offset)
    assert_close(got, want[: len(got)], dtype)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("impl", [Impl.PALLAS_TRITON, Impl.PALLAS_GPU], ids=["triton", "mosaic"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_compiled_gpu_kernels_match_reference(case, impl):
    """The GPU kernels as the GPU compiles them equal the reference, which runs after them on
    the same inputs: a ragged block (37 rows, 1000 of 1024 lanes) stored past the outputs would
    have overwritten those."""
    shape, dtype, unit_offset, with_residual = case
    if not add_rms_norm_supported(
        platform="gpu", rows=int(np.prod(shape[:-1])), hidden=shape[-1], dtype=dtype, impl=impl
    ):
        pytest.skip(f"{impl} does not take {shape}")
    x, residual, weight = make_inputs(shape, dtype)
    residual = residual if with_residual else None
    got = add_rms_norm(x, residual, weight, unit_offset=unit_offset, impl=impl)
    assert_close(got, reference(x, residual, weight, unit_offset=unit_offset), dtype)


def test_default_on_cpu_is_the_reference():
    """impl=None on CPU runs XLA's fusion of the reference, bit for bit."""
    x, residual, weight = make_inputs((5, 384), jnp.bfloat16)
    chex.assert_trees_all_equal(add_rms_norm(x, residual, weight), reference(x, residual, weight))


def test_residual_none_returns_x_as_residual():
    """Without a residual, x is normalized alone and comes back unchanged as the residual."""
    x, _, weight = make_inputs((6, 256), jnp.bfloat16)
    normed, new_residual = add_rms_norm(x, None, weight, impl=Impl.PALLAS_INTERPRET)
    chex.assert_trees_all_equal(new_residual, x)
    assert_close((normed,), reference(x, None, weight)[:1], jnp.bfloat16)


def test_new_residual_is_float32_sum_rounded_once():
    """new_residual is round(x + residual in float32), not a bfloat16 addition."""
    x, residual, weight = make_inputs((4, 256), jnp.bfloat16)
    want = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(jnp.bfloat16)
    _, new_residual = add_rms_norm(x, residual, weight, impl=Impl.PALLAS_INTERPRET)
    chex.assert_trees_all_equal(new_residual, want)


def test_unit_offset_scales_by_one_plus_weight():
    """unit_offset=True equals unit_offset=False with weight + 1."""
    x, residual, weight = make_inputs((4, 256), jnp.float32)
    unit_offset = add_rms_norm(x, residual, weight, unit_offset=True, impl=Impl.PALLAS_INTERPRET)
    plain = add_rms_norm(x, residual, weight + 1, impl=Impl.PALLAS_INTERPRET)
    assert_close(unit_offset, plain, jnp.float32)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, r, w: add_rms_norm(x[0], r[0], w), ValueError, r"\[rows, hidden\]"),
        (lambda x, r, w: add_rms_norm(x, r[:2], w), ValueError, "residual must have x's shape"),
        (
            lambda x, r, w: add_rms_norm(x, r.astype(jnp.float32), w),
            TypeError,
            "residual must have x's dtype",
        ),
        (lambda x, r, w: add_rms_norm(x, r, w[:8]), ValueError, r"weight must be \[hidden\]"),
        (
            lambda x, r, w: add_rms_norm(x.astype(jnp.int32), None, w),
            TypeError,
            "x must have dtype",
        ),
        (lambda x, r, w: add_rms_norm(x, r, w, eps=-1.0), ValueError, "eps must be >= 0"),
        (lambda x, r, w: add_rms_norm(x, r, w, impl="pallas"), TypeError, "Impl member"),
        (
            lambda x, r, w: add_rms_norm(x, r, w, impl=Impl.PALLAS_GPU),
            NotImplementedError,
            "add_rms_norm_supported",
        ),
    ],
    ids=["rank", "residual-shape", "residual-dtype", "weight", "int", "eps", "impl-type", "gpu"],
)
def test_invalid_calls_raise_clear_errors(call, error, match):
    """Bad shapes, dtypes, eps or backends fail at trace time with a message naming the rule
    (on the CPU, where the GPU kernel cannot run)."""
    if error is NotImplementedError and jax.default_backend() == "gpu":
        pytest.skip("on a GPU platform the GPU kernel takes the call")
    with jax.default_device(jax.devices("cpu")[0]):
        x, residual, weight = make_inputs((4, 128), jnp.bfloat16)
        with pytest.raises(error, match=match):
            call(x, residual, weight)


@pytest.mark.parametrize(
    "kwargs, want",
    [
        (dict(platform="cpu", rows=8, hidden=4096, dtype=jnp.bfloat16), False),
        (dict(platform="gpu", rows=8, hidden=4096, dtype=jnp.bfloat16), True),
        (dict(platform="gpu", rows=8, hidden=1000, dtype=jnp.bfloat16), False),
        (dict(platform="gpu", rows=4096, hidden=1000, dtype=jnp.bfloat16), True),  # Triton
        (dict(platform="gpu", rows=4096, hidden=1004, dtype=jnp.bfloat16), False),
        (dict(platform="gpu", rows=8, hidden=32768, dtype=jnp.bfloat16), False),
        (
            dict(platform="gpu", rows=8, hidden=1000, dtype=jnp.bfloat16, impl=Impl.PALLAS_TRITON),
            True,
        ),
        (dict(platform="tpu", rows=8, hidden=1000, dtype=jnp.float32), True),
        (dict(platform="gpu", rows=8, hidden=4096, dtype=jnp.int8), False),
        (dict(platform="cpu", rows=8, hidden=1000, dtype=jnp.float16, impl=Impl.XLA), True),
        (dict(platform="cpu", rows=8, hidden=1000, dtype=jnp.float16, impl=Impl.PALLAS_TPU), False),
    ],
)
def test_supported_predicate(kwargs, want):
    """add_rms_norm_supported answers per platform, shape and dtype without touching arrays."""
    assert add_rms_norm_supported(**kwargs) is want


@functools.cache
def _cuda_module(shape, dtype, with_residual):
    x = jax.ShapeDtypeStruct(shape, dtype)
    weight = jax.ShapeDtypeStruct(shape[-1:], jnp.float32)

    def call(x, residual, weight):
        launch = GpuLaunch(num_programs=min(shape[0], 264), rows_per_step=1, vector_size=8)
        return mosaic_gpu_add_rms_norm(
            x, residual, weight, eps=1e-6, unit_offset=True, launch=launch
        )

    exported = jax.export.export(jax.jit(call), platforms=["cuda"])
    return exported(x, x if with_residual else None, weight).mlir_module()


@pytest.mark.parametrize("with_residual", [True, False])
def test_mosaic_gpu_kernel_lowers_for_cuda(with_residual):
    """The Mosaic GPU kernel lowers to a Mosaic GPU custom call without a GPU present."""
    assert "mosaic_gpu" in _cuda_module((4096, 8192), jnp.bfloat16, with_residual)


@pytest.mark.parametrize(
    "dtype, bitcasts, barriers", [(jnp.bfloat16, 4, 0), (jnp.float16, 0, 2), (jnp.float32, 0, 0)]
)
def test_stream_is_rounded_where_xla_cannot_drop_it_between_two_adds(dtype, bitcasts, barriers):
    """Two add + norms in one jitted program: the second adds to the first's residual rounded to
    the stream's dtype. XLA's GPU compiler drops a float32 -> 16-bit -> float32 round trip (the
    stream then stays float32 between layers: `benchmarks/RESULTS.md` run 22), so bf16 is
    rounded in integer arithmetic (two bitcasts a layer) and float16 behind an optimization
    barrier. A float32 stream rounds nothing."""
    keys = jax.random.split(jax.random.key(3), 3)
    residual, first, second = (jax.random.normal(k, (64, 256), jnp.float32) for k in keys)
    residual, first, second = (a.astype(dtype) for a in (residual, first, second))
    weight = jnp.ones((256,), dtype)

    def two_layers(residual, first, second):
        _, residual = add_rms_norm_reference(first, residual, weight)
        return add_rms_norm_reference(second, residual, weight)[1]

    f32 = functools.partial(np.asarray, dtype=np.float32)
    rounded = (f32(residual) + f32(first)).astype(dtype)
    want = (f32(rounded) + f32(second)).astype(dtype)
    program = jax.jit(two_layers)
    np.testing.assert_array_equal(f32(program(residual, first, second)), f32(want))
    text = program.lower(residual, first, second).as_text()
    assert text.count("bitcast_convert") == bitcasts
    assert text.count("optimization_barrier") == barriers


def test_integer_bf16_rounding_equals_xla_convert_bit_for_bit():
    """round_residual's integer rounding to bf16 equals XLA's convert on every class of float32:
    ties (to even), values that round up into the next exponent or to infinity, subnormals,
    signed zeros and infinities; NaN stays NaN (also one whose payload is
    only in the bits rounded away)."""
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(4096) * 10.0 ** rng.integers(-45, 39, 4096)
    bits = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    ties = (bits & 0xFFFF0000) | 0x8000
    special = [0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1e-45, 1.1754942e-38]
    low_nan = np.uint32([0x7F800001, 0xFF800001]).view(np.float32)
    special = np.float32([*special, np.nan, -np.nan, *low_nan])
    parts = [spread.astype(np.float32), bits.view(np.float32), ties.view(np.float32), special]
    values = np.concatenate(parts)
    got = jax.jit(round_residual, static_argnums=1)(values, jnp.bfloat16)
    want = jnp.asarray(values).astype(jnp.bfloat16)
    finite = ~np.isnan(values)
    u16 = functools.partial(np.asarray, dtype=np.uint16)
    np.testing.assert_array_equal(
        u16(jax.lax.bitcast_convert_type(got, jnp.uint16))[finite],
        u16(jax.lax.bitcast_convert_type(want, jnp.uint16))[finite],
    )
    assert np.isnan(np.asarray(got, np.float32)[~finite]).all()
