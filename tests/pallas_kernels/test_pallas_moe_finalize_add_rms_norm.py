"""moe_finalize_add_rms_norm: the kernels, interpreted on CPU, equal the unfused finalize + psum +
add + RMSNorm.

Every rank gets different per-choice outputs, routing weights (never all equal) and residuals, so
a combine that skips a choice or a weight, takes a choice twice, skips or doubles the sum, or
mixes rows from the wrong rank moves the output far past the tolerance (the mutants below check
that the tolerance would notice).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    Impl,
    compat,
    moe_finalize_add_rms_norm,
    moe_finalize_add_rms_norm_reference,
    moe_finalize_add_rms_norm_supported,
)
from pallas_kernels.moe_finalize_add_rms_norm.kernel_gpu import gpu_moe_finalize_add_rms_norm
from tests.meshes import need_devices

P = jax.sharding.PartitionSpec
AXIS = "tp"
# Max error relative to the largest reference value: the kernels keep the combine and the sum
# in float32, the reference rounds them to the outputs' dtype.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2.0**-6}


def inputs(devices, rows, top_k, hidden, dtype, seed=0):
    """Stacked over `devices`: outputs, weights, residual, norm weight (rank r's scaled by r+1)."""
    ko, kw, kr, kn = jax.random.split(jax.random.key(seed), 4)
    outputs = jax.random.normal(ko, (devices, rows, top_k, hidden), jnp.float32)
    weights = jax.random.uniform(kw, (devices, rows, top_k), jnp.float32, 0.1, 1.0)
    residual = 2 * jax.random.normal(kr, (devices, rows, hidden), jnp.float32)
    scale = 1 + jnp.arange(devices, dtype=jnp.float32)[:, None]
    norm_weight = (1 + jax.random.normal(kn, (devices, hidden), jnp.float32)) * scale
    return outputs.astype(dtype), weights, residual.astype(dtype), norm_weight.astype(dtype)


def unfused_float64(outputs, weights, residual, norm_weight, *, summed, eps=1e-6):
    """The spec in float64 NumPy; `summed` sums the combine over the leading (rank) axis."""
    o, w, r, g = (np.asarray(a, np.float64) for a in (outputs, weights, residual, norm_weight))
    combined = np.einsum("drkh,drk->drh", o, w)
    if summed:
        combined = np.broadcast_to(combined.sum(0, keepdims=True), combined.shape)
    total = combined + r
    inv = 1 / np.sqrt(np.mean(total * total, -1, keepdims=True) + eps)
    return total * inv * g[:, None, :], total


def assert_close(got, want, dtype):
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.all(np.isfinite(g)), "non-finite output: an unwritten or wrongly read row"
        np.testing.assert_array_less(np.max(np.abs(g - w)), TOL[dtype] * np.max(np.abs(w)))


@functools.cache
def sharded(devices, impl, with_residual=True):
    need_devices(devices)
    mesh = jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices])

    def body(outputs, weights, residual, norm_weight):
        normed, new_residual = moe_finalize_add_rms_norm(
            outputs[0],
            weights[0],
            residual[0] if with_residual else None,
            norm_weight[0],
            axis_name=AXIS,
            impl=impl,
        )
        return normed[None], new_residual[None]

    spec = P(AXIS)
    fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return mesh, jax.jit(fn)


@pytest.mark.parametrize("impl", [Impl.XLA, Impl.PALLAS_INTERPRET])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_rank_matches_float64(impl, dtype):
    """No sum owed: combine + add + norm over a multi-block grid with a ragged last block."""
    outputs, weights, residual, norm_weight = inputs(1, 13, 3, 256, dtype, seed=1)
    got = moe_finalize_add_rms_norm(outputs[0], weights[0], residual[0], norm_weight[0], impl=impl)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, (residual[0], residual[0]))
    want = unfused_float64(outputs, weights, residual, norm_weight, summed=False)
    assert_close(got, (want[0][0], want[1][0]), dtype)


@pytest.mark.skipif(compat.gpu_interpret_params() is None, reason="no Mosaic GPU interpreter")
def test_gpu_kernel_interpreted_on_one_rank():
    """The Mosaic GPU body (its combine, add and norm; no peers) in the Mosaic GPU interpreter."""
    outputs, weights, residual, norm_weight = inputs(1, 5, 3, 256, jnp.float32, seed=2)
    got = moe_finalize_add_rms_norm(
        outputs[0], weights[0], residual[0], norm_weight[0], impl=Impl.PALLAS_GPU_INTERPRET
    )
    want = unfused_float64(outputs, weights, residual, norm_weight, summed=False)
    assert_close(got, (want[0][0], want[1][0]), jnp.float32)


@pytest.mark.parametrize(
    "devices,dtype,with_residual",
    [(2, jnp.bfloat16, True), (4, jnp.float32, True), (2, jnp.float32, False)],
)
def test_sum_over_ranks_matches_float64(devices, dtype, with_residual):
    """The one-shot TPU kernel (remote DMAs simulated) and the reference, against float64."""
    args = inputs(devices, 8, 4, 128, dtype, seed=devices)
    mesh, _ = sharded(devices, Impl.XLA)
    placed = jax.device_put(args, jax.sharding.NamedSharding(mesh, P(AXIS)))
    residual = args[2] if with_residual else jnp.zeros_like(args[2])
    want = unfused_float64(args[0], args[1], residual, args[3], summed=True)
    for impl in (Impl.XLA, Impl.PALLAS_INTERPRET):
        got = sharded(devices, impl, with_residual)[1](*placed)
        assert_close(got, want, dtype)


def test_mutants_are_caught():
    """The tolerance notices a skipped or doubled sum, a dropped choice and unweighted choices."""
    outputs, weights, residual, norm_weight = inputs(2, 8, 4, 128, jnp.float32, seed=5)
    want = unfused_float64(outputs, weights, residual, norm_weight, summed=True)
    mutants = {
        "sum skipped": unfused_float64(outputs, weights, residual, norm_weight, summed=False),
        "sum doubled": unfused_float64(outputs, 2 * weights, residual, norm_weight, summed=True),
        "choice dropped": unfused_float64(
            outputs[:, :, 1:], weights[:, :, 1:], residual, norm_weight, summed=True
        ),
        "unweighted": unfused_float64(
            outputs, jnp.ones_like(weights), residual, norm_weight, summed=True
        ),
    }
    for name, got in mutants.items():
        with pytest.raises(AssertionError):
            assert_close(got, want, jnp.float32)
        assert name


def test_reference_is_the_unfused_boundary_path():
    """The reference equals DeferredFinalize.complete + add_rms_norm_reference on one rank."""
    import boundary_jax as bj
    from pallas_kernels import add_rms_norm_reference

    outputs, weights, residual, norm_weight = inputs(1, 4, 3, 128, jnp.bfloat16, seed=7)
    combined = bj.DeferredFinalize(outputs[0], weights[0]).complete()
    want = add_rms_norm_reference(combined, residual[0], norm_weight[0])
    got = moe_finalize_add_rms_norm_reference(outputs[0], weights[0], residual[0], norm_weight[0])
    chex.assert_trees_all_close(got, want, atol=0, rtol=0)


def test_supported_and_errors():
    kwargs = dict(rows=64, top_k=9, hidden=2048, dtype=jnp.bfloat16, num_devices=2)
    assert not moe_finalize_add_rms_norm_supported(platform="cpu", **kwargs)
    # The platform default declines where the GPU kernel measured slower than the unfused path.
    assert not moe_finalize_add_rms_norm_supported(platform="cuda", **kwargs)
    assert moe_finalize_add_rms_norm_supported(platform="cuda", impl=Impl.PALLAS_GPU, **kwargs)
    unsummed = {**kwargs, "num_devices": 1, "rows": 4096}
    assert moe_finalize_add_rms_norm_supported(platform="cuda", **unsummed)
    assert not moe_finalize_add_rms_norm_supported(platform="cuda", **{**unsummed, "rows": 64})
    assert moe_finalize_add_rms_norm_supported(platform="cpu", impl=Impl.PALLAS_INTERPRET, **kwargs)
    assert not moe_finalize_add_rms_norm_supported(
        platform="cuda", **{**kwargs, "hidden": 100}, impl=Impl.PALLAS_GPU
    )
    outputs, weights, residual, norm_weight = inputs(1, 4, 3, 128, jnp.float32)
    with pytest.raises(ValueError, match=r"weights \[rows, top_k\]"):
        moe_finalize_add_rms_norm(outputs[0], weights[0, :, :2], residual[0], norm_weight[0])
    if jax.default_backend() != "gpu":  # on a GPU the kernel takes the call
        with pytest.raises(NotImplementedError, match="PALLAS_GPU"):
            moe_finalize_add_rms_norm(
                outputs[0], weights[0], residual[0], norm_weight[0], impl=Impl.PALLAS_GPU
            )


@pytest.mark.parametrize("devices", [1, 2])
def test_gpu_kernel_lowers_for_cuda(devices):
    """The Mosaic GPU kernel (peer reads with two devices) lowers without a GPU present."""
    mesh = jax.sharding.AbstractMesh((devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))

    def body(outputs, weights, residual, norm_weight):
        return gpu_moe_finalize_add_rms_norm(
            outputs,
            weights,
            residual,
            norm_weight,
            axis_name=AXIS if devices > 1 else None,
            num_devices=devices,
            eps=1e-6,
            unit_offset=False,
            num_programs=8,
            vector_size=8,
        )

    spec = P(AXIS)
    run = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=spec, check_vma=False
        )
    )
    outputs = jax.ShapeDtypeStruct((devices * 8, 8, 2048), jnp.bfloat16)
    weights = jax.ShapeDtypeStruct((devices * 8, 8), jnp.float32)
    residual = jax.ShapeDtypeStruct((devices * 8, 2048), jnp.bfloat16)
    norm_weight = jax.ShapeDtypeStruct((2048,), jnp.bfloat16)
    exported = jax.export.export(run, platforms=["cuda"])(outputs, weights, residual, norm_weight)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.skipif(
    len([d for d in jax.devices() if d.platform == "gpu"]) < 2, reason="needs two GPUs"
)
def test_fused_kernel_on_two_gpus_matches_reference():  # pragma: no cover - GPU only
    """On two GPUs of one process, the peer-read kernel equals the unfused path (bf16)."""
    args = inputs(2, 64, 8, 2048, jnp.bfloat16, seed=11)
    mesh = jax.make_mesh((2,), (AXIS,), devices=[d for d in jax.devices() if d.platform == "gpu"])
    placed = jax.device_put(args, jax.sharding.NamedSharding(mesh, P(AXIS)))

    def run(impl):
        def body(outputs, weights, residual, norm_weight):
            normed, new_residual = moe_finalize_add_rms_norm(
                outputs[0], weights[0], residual[0], norm_weight[0], axis_name=AXIS, impl=impl
            )
            return normed[None], new_residual[None]

        spec = P(AXIS)
        fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        return jax.jit(fn)(*placed)

    want = unfused_float64(*args, summed=True)
    assert_close(run(Impl.PALLAS_GPU), want, jnp.bfloat16)
    assert_close(run(Impl.XLA), want, jnp.bfloat16)
