"""all_reduce_add_rms_norm: the TPU kernels, interpreted on simulated CPU meshes, equal psum + norm.

Every rank gets different partials, residuals and weights (scaled by rank + 1), so a partial
summed twice or skipped, a row taken from the wrong rank, or another rank's weight shows up.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import (
    AllReduceAlgorithm,
    Impl,
    all_reduce_add_rms_norm,
    all_reduce_add_rms_norm_supported,
    compat,
)
from pallas_kernels.all_reduce_add_rms_norm.kernel_gpu import gpu_all_reduce_add_rms_norm
from pallas_kernels.all_reduce_add_rms_norm.kernel_tpu import tpu_all_reduce_add_rms_norm

P = jax.sharding.PartitionSpec
ONE_SHOT, RING = AllReduceAlgorithm.ONE_SHOT, AllReduceAlgorithm.RING

# Max error relative to the largest reference value. The kernels round the sum differently from
# psum (one-shot: not at all; ring: per hop), which moves 16-bit outputs by about one rounding.
TOL = {jnp.float32: 1e-6, jnp.bfloat16: 2.0**-7}


def make_mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices("cpu")[: int(np.prod(shape))])


def per_rank_inputs(mesh, rows, hidden, dtype, seed=0):
    """x, residual, weight stacked over all devices; rank r's weight is scaled by r + 1."""
    n = mesh.size
    kx, kr, kw = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (n, rows, hidden), jnp.float32)
    residual = 2 * jax.random.normal(kr, (n, rows, hidden), jnp.float32)
    scale = 1 + jnp.arange(n, dtype=jnp.float32)[:, None]
    weight = (1 + jax.random.normal(kw, (n, hidden), jnp.float32)) * scale
    stacked = P(mesh.axis_names)
    return tuple(
        jax.device_put(a.astype(dtype), jax.sharding.NamedSharding(mesh, stacked))
        for a in (x, residual, weight)
    )


@functools.cache
def sharded(mesh, axis_name, with_residual, impl, algorithm=None, unit_offset=False):
    """A jitted shard_map over all mesh axes, calling the op on each device's own slices."""

    def body(x, residual, weight):
        normed, new_residual = all_reduce_add_rms_norm(
            x[0],
            residual[0] if with_residual else None,
            weight[0],
            axis_name=axis_name,
            unit_offset=unit_offset,
            impl=impl,
            algorithm=algorithm,
        )
        return normed[None], new_residual[None]

    spec = P(mesh.axis_names)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def assert_close(got, want, dtype):
    """Max |got - want| within TOL[dtype] of the largest |want|; finite everywhere."""
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.all(np.isfinite(g)), "non-finite output: an unwritten or wrongly read row"
        np.testing.assert_array_less(np.max(np.abs(g - w)), TOL[dtype] * np.max(np.abs(w)))


def check_against_reference(mesh, axis_name, rows, hidden, dtype, *, algorithm, **kwargs):
    inputs = per_rank_inputs(mesh, rows, hidden, dtype)
    got = sharded(mesh, axis_name, impl=Impl.PALLAS_INTERPRET, algorithm=algorithm, **kwargs)
    want = sharded(mesh, axis_name, impl=Impl.XLA, **kwargs)
    assert_close(got(*inputs), want(*inputs), dtype)


PSUM_SHAPES = {
    "2dev-f32": (2, 13, 256, jnp.float32, True, False),
    "4dev-bf16-unit-offset": (4, 7, 128, jnp.bfloat16, True, True),
    "8dev-f32-nores": (8, 19, 256, jnp.float32, False, False),
}
# Each algorithm runs by default on one shape: the ring on 2 devices in float32, the one-shot
# kernel on 4 in bfloat16 with the unit-offset (`1 + w`) norm. Eight devices (the ring over
# 2 x 4 below) and a missing residual (test_new_residual_without_residual_is_the_completed_sum)
# are covered by default elsewhere; the other four pairs run under -m slow.
PSUM_FAST = {("2dev-f32", RING), ("4dev-bf16-unit-offset", ONE_SHOT)}


@pytest.mark.parametrize(
    "num_devices, rows, hidden, dtype, with_residual, unit_offset, algorithm",
    [
        pytest.param(
            *shape,
            algorithm,
            id=f"{name}-{algorithm.name}",
            marks=() if (name, algorithm) in PSUM_FAST else pytest.mark.slow,
        )
        for name, shape in PSUM_SHAPES.items()
        for algorithm in (ONE_SHOT, RING)
    ],
)
def test_tpu_kernel_matches_psum_reference(
    num_devices, rows, hidden, dtype, with_residual, unit_offset, algorithm
):
    """Interpreted TPU kernels equal psum + add + norm on 2, 4 and 8 devices, per rank."""
    mesh = make_mesh((num_devices,), ("tp",))
    check_against_reference(
        mesh,
        "tp",
        rows,
        hidden,
        dtype,
        algorithm=algorithm,
        with_residual=with_residual,
        unit_offset=unit_offset,
    )


@pytest.mark.parametrize("axis_name", ["tp", ("dp", "tp")], ids=["inner-axis", "both-axes"])
def test_tpu_kernel_sums_over_named_axes_only(axis_name):
    """On a 2 x 4 mesh the sum runs over exactly the named axes; other ranks stay apart."""
    mesh = make_mesh((2, 4), ("dp", "tp"))
    check_against_reference(
        mesh, axis_name, 8, 128, jnp.float32, algorithm=RING, with_residual=True
    )


@pytest.mark.parametrize("algorithm", [ONE_SHOT, RING], ids=lambda a: a.name)
def test_tpu_kernel_has_no_races(algorithm):
    """The TPU interpreter's race detector finds no race in either algorithm (eager DMAs)."""
    mesh = make_mesh((4,), ("tp",))
    x, residual, weight = per_rank_inputs(mesh, 32, 128, jnp.float32)
    interpret = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")

    def body(x, residual, weight):
        outs = tpu_all_reduce_add_rms_norm(
            x[0],
            residual[0],
            weight[0],
            axis_name="tp",
            num_devices=4,
            ring=algorithm is RING,
            eps=1e-6,
            unit_offset=False,
            interpret=interpret,
        )
        return tuple(o[None] for o in outs)

    spec = P("tp")
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    got = jax.block_until_ready(run(x, residual, weight))
    assert not compat.tpu_interpret_races_found()
    want = sharded(mesh, "tp", with_residual=True, impl=Impl.XLA)(x, residual, weight)
    assert_close(got, want, jnp.float32)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the default of a CPU platform")
def test_default_on_cpu_is_psum_then_add_rms_norm():
    """impl=None on CPU is psum + add_rms_norm, bit for bit, with one all-reduce in the HLO."""
    mesh = make_mesh((4,), ("tp",))
    inputs = per_rank_inputs(mesh, 5, 256, jnp.bfloat16)
    default = sharded(mesh, "tp", with_residual=True, impl=None)
    chex.assert_trees_all_equal(
        default(*inputs), sharded(mesh, "tp", with_residual=True, impl=Impl.XLA)(*inputs)
    )
    assert default.lower(*inputs).as_text().count('"stablehlo.all_reduce"') == 1


def test_new_residual_without_residual_is_the_completed_sum():
    """With residual=None the new residual is the completed sum itself."""
    mesh = make_mesh((2,), ("tp",))
    x, residual, weight = per_rank_inputs(mesh, 6, 128, jnp.float32)
    _, new_residual = sharded(mesh, "tp", with_residual=False, impl=Impl.PALLAS_INTERPRET)(
        x, residual, weight
    )
    want = jnp.broadcast_to(jnp.sum(x, axis=0), x.shape)
    assert_close((new_residual,), (want,), jnp.float32)


def test_ring_on_gpu_is_rejected():
    """An explicit algorithm a backend lacks raises NotImplementedError at trace time."""
    mesh = make_mesh((2,), ("tp",))
    inputs = per_rank_inputs(mesh, 4, 128, jnp.float32)
    with pytest.raises(NotImplementedError, match="all_reduce_add_rms_norm_supported"):
        sharded(mesh, "tp", with_residual=True, impl=Impl.PALLAS_GPU, algorithm=RING)(*inputs)


@pytest.mark.parametrize(
    "kwargs, want",
    [
        (dict(platform="cpu"), False),
        (dict(platform="gpu", rows=2048), True),
        (dict(platform="gpu", rows=64), False),
        (dict(platform="gpu", rows=64, impl=Impl.PALLAS_GPU), True),
        (dict(platform="gpu", rows=4096), False),
        (dict(platform="gpu", rows=2048, hidden=1000), False),
        (dict(platform="gpu", rows=2048, algorithm=RING), False),
        (dict(platform="gpu", rows=2048, num_devices=1), False),
        (dict(platform="gpu", rows=2048, num_devices=16), False),
        (dict(platform="tpu"), True),
        (dict(platform="tpu", algorithm=RING), True),
        (dict(platform="tpu", rows=65536), False),
        (dict(platform="cpu", impl=Impl.PALLAS_INTERPRET), True),
        (dict(platform="cpu", impl=Impl.XLA), True),
    ],
)
def test_supported_predicate(kwargs, want):
    """all_reduce_add_rms_norm_supported answers from static facts alone."""
    facts = dict(rows=64, hidden=4096, dtype=jnp.bfloat16, num_devices=2) | kwargs
    assert all_reduce_add_rms_norm_supported(**facts) is want


def test_gpu_kernel_lowers_for_cuda():
    """The peer-to-peer Mosaic GPU kernel lowers inside shard_map without a GPU present."""
    mesh = jax.sharding.AbstractMesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(x, residual, weight):
        return gpu_all_reduce_add_rms_norm(
            x,
            residual,
            weight,
            axis_name="tp",
            num_devices=2,
            eps=1e-6,
            unit_offset=False,
            num_programs=8,
            vector_size=8,
        )

    run = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("tp"), P("tp"), P()), out_specs=P("tp"), check_vma=False
        )
    )
    rows = jax.ShapeDtypeStruct((2 * 8, 4096), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    module = jax.export.export(run, platforms=["cuda"])(rows, rows, weight).mlir_module()
    assert "mosaic_gpu" in module
