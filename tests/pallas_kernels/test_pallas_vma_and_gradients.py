"""Every Pallas op a model binds runs inside `shard_map(..., check_vma=True)` with its outputs
typed as its reference's, and differentiates as its reference does (float32, interpreted).

Each rank gets different inputs; some vary over both mesh axes, some over one, some over none,
so a kernel typed too loosely (invariant where it varies) or too strictly (varying over the axis
it sums) fails `shard_map`'s `out_specs` check, and a wrong gradient shows in some input.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels.add_rms_norm import GpuLaunch, mosaic_gpu_add_rms_norm
from pallas_kernels.all_reduce_add_rms_norm.kernel_gpu import gpu_all_reduce_add_rms_norm
from pallas_kernels.all_reduce_add_rms_norm.kernel_tpu import tpu_all_reduce_add_rms_norm
from pallas_kernels.grouped_matmul import (
    expert_matmul,
    grouped_matmul_reference,
    hopper_ragged_dot,
)
from pallas_kernels.moe_finalize_add_rms_norm.kernel_gpu import gpu_moe_finalize_add_rms_norm
from pallas_kernels.moe_finalize_add_rms_norm.kernel_tpu import (
    blocked_moe_finalize_add_rms_norm,
    tpu_moe_finalize_all_reduce_add_rms_norm,
)

P = jax.sharding.PartitionSpec
ROWS, HIDDEN, TOP_K, GROUPS, DEPTH = 8, 128, 2, 4, 64
RANKS, DP, ALL = P(("dp", "tp")), P("dp"), P()
"""Specs of inputs stacked per rank (vary over dp and tp), per DP rank (alike over tp), and of
replicated ones."""
SIZES = jnp.asarray([[3, 0, 4, 1], [0, 0, 8, 0], [2, 2, 2, 2], [1, 0, 0, 5]], jnp.int32)


@functools.cache
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices("cpu")[:4])


def normal(seed: int, shape, scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def add_rms_norm_case(impl):
    def op(x, residual, weight):
        return pk.add_rms_norm(x[0], residual[0], weight, eps=1e-5, impl=impl)

    args = (normal(0, (4, ROWS, HIDDEN)), normal(1, (4, ROWS, HIDDEN)), 1 + normal(2, (HIDDEN,)))
    return op, args, (RANKS, RANKS, ALL), (RANKS, RANKS)


def all_reduce_case(impl, algorithm=None):
    """Partials per rank, residual per DP rank: the outputs are alike over the summed tp."""

    def op(x, residual, weight):
        return pk.all_reduce_add_rms_norm(
            x[0], residual[0], weight, axis_name="tp", impl=impl, algorithm=algorithm
        )

    args = (normal(3, (4, ROWS, HIDDEN)), normal(4, (2, ROWS, HIDDEN)), 1 + normal(5, (HIDDEN,)))
    return op, args, (RANKS, DP, ALL), (DP, DP)


def moe_finalize_case(impl, summed: bool):
    """With a sum: outputs per rank, routing and residual per DP rank, alike over tp after it."""

    def op(outputs, weights, residual, norm_weight):
        return pk.moe_finalize_add_rms_norm(
            outputs[0],
            weights[0],
            residual[0],
            norm_weight,
            axis_name="tp" if summed else None,
            impl=impl,
        )

    rows, stacked = (DP, 2) if summed else (RANKS, 4)
    args = (
        normal(6, (4, ROWS, TOP_K, HIDDEN)),
        normal(7, (stacked, ROWS, TOP_K)),
        normal(8, (stacked, ROWS, HIDDEN)),
        1 + normal(9, (HIDDEN,)),
    )
    return op, args, (RANKS, rows, rows, ALL), (rows, rows)


def grouped_matmul_case(matmul):
    """Rows and group sizes per rank, weights replicated; rows past the groups zeroed (the
    kernel leaves them unspecified)."""

    def op(rows, weights, group_sizes):
        got = matmul(rows[0], weights, group_sizes[0])
        covered = jnp.arange(ROWS)[:, None] < jnp.sum(group_sizes[0])
        return (jnp.where(covered, got, 0.0),)

    args = (normal(10, (4, ROWS, DEPTH)), normal(11, (GROUPS, DEPTH, HIDDEN), 0.1), SIZES)
    return op, args, (RANKS, ALL, RANKS), (RANKS,)


INTERPRET, GPU_INTERPRET, XLA = pk.Impl.PALLAS_INTERPRET, pk.Impl.PALLAS_GPU_INTERPRET, pk.Impl.XLA
REFERENCES = {
    "add_rms_norm": add_rms_norm_case(XLA),
    "all_reduce": all_reduce_case(XLA),
    "moe_finalize-summed": moe_finalize_case(XLA, True),
    "moe_finalize": moe_finalize_case(XLA, False),
    "grouped_matmul": grouped_matmul_case(grouped_matmul_reference),
}
# One case per kernel launcher and interpreter (the ring all-reduce and the Mosaic GPU finalize
# share their launchers' typing with cases here; their values are tested elsewhere).
CASES = {  # name: (the kernel's case, its reference's name)
    "add_rms_norm": (add_rms_norm_case(INTERPRET), "add_rms_norm"),
    "add_rms_norm-mosaic-gpu": (add_rms_norm_case(GPU_INTERPRET), "add_rms_norm"),
    "all_reduce-one-shot": (
        all_reduce_case(INTERPRET, pk.AllReduceAlgorithm.ONE_SHOT),
        "all_reduce",
    ),
    "moe_finalize-summed": (moe_finalize_case(INTERPRET, True), "moe_finalize-summed"),
    "moe_finalize": (moe_finalize_case(INTERPRET, False), "moe_finalize"),
    "expert_matmul": (
        grouped_matmul_case(functools.partial(expert_matmul, interpret=True)),
        "grouped_matmul",
    ),
}


def placed(args, in_specs) -> tuple[jax.Array, ...]:
    """`args` on the mesh, split as `in_specs` says."""
    pairs = zip(args, in_specs, strict=True)
    return tuple(jax.device_put(a, jax.NamedSharding(mesh(), s)) for a, s in pairs)


def run(case):
    """(outputs, gradients of a fixed random functional of them w.r.t. every float input), in
    one program."""
    op, args, in_specs, out_specs = case
    sharded = jax.shard_map(op, mesh=mesh(), in_specs=in_specs, out_specs=out_specs)
    args = placed(args, in_specs)
    floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))

    def loss(*values):
        full = list(args)
        for i, value in zip(floats, values, strict=True):
            full[i] = value
        outs = sharded(*full)
        total = sum(jnp.sum(jnp.sin(o) * normal(20 + i, o.shape)) for i, o in enumerate(outs))
        return total, outs

    grad = jax.grad(loss, argnums=tuple(range(len(floats))), has_aux=True)
    grads, outs = jax.jit(grad)(*(args[i] for i in floats))
    return outs, grads


@functools.cache
def reference_run(name: str):
    return run(REFERENCES[name])


NO_GPU_INTERPRETER = pytest.mark.skipif(
    not pk.add_rms_norm_supported(
        platform="cpu", rows=ROWS, hidden=HIDDEN, dtype=jnp.float32, impl=GPU_INTERPRET
    ),
    reason="this JAX has no Mosaic GPU interpreter",
)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=NO_GPU_INTERPRETER) if "mosaic" in n else n for n in CASES]
)
def test_kernel_under_check_vma_equals_its_reference_and_its_gradients(name):
    """Outputs within 1e-5 of the reference's, in shard_map with check_vma=True (out_specs
    replicated over the summed axis), and gradients equal to the reference's."""
    kernel, reference = CASES[name]
    (got, got_grads), (want, want_grads) = run(kernel), reference_run(reference)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(got_grads, want_grads, atol=1e-5, rtol=1e-5)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in got_grads)  # every input matters


@pytest.mark.parametrize("name", ["add_rms_norm", "all_reduce-one-shot", "expert_matmul"])
def test_a_varying_output_declared_replicated_fails_to_trace(name):
    """The check still sees through the kernels: outputs that vary over an axis, returned as
    replicated over it, fail `out_specs`, as they would without the kernel."""
    op, args, in_specs, out_specs = CASES[name][0]
    wrong = jax.shard_map(op, mesh=mesh(), in_specs=in_specs, out_specs=(ALL,) * len(out_specs))
    with pytest.raises(ValueError, match="replicat"):
        jax.jit(wrong).trace(*placed(args, in_specs))


def compiled_launches():
    """Each compiled kernel launcher, as (function of stacked inputs, inputs, in_specs,
    out_specs) with the out_specs its outputs' types must meet."""
    x, residual, weight = add_rms_norm_case(XLA)[1]
    partials, per_dp, _ = all_reduce_case(XLA)[1]
    outputs, routing, moe_residual, _ = moe_finalize_case(XLA, True)[1]
    rows, weights, sizes = grouped_matmul_case(None)[1]
    norm = {"eps": 1e-5, "unit_offset": False}
    summed = {"axis_name": "tp", "num_devices": 2, **norm}
    launch = GpuLaunch(num_programs=ROWS, rows_per_step=1, vector_size=8)
    return {
        "add_rms_norm mosaic gpu": (
            lambda x, r, w: mosaic_gpu_add_rms_norm(x[0], r[0], w, launch=launch, **norm),
            (x, residual, weight),
            (RANKS, RANKS, ALL),
            (RANKS, RANKS),
        ),
        "all_reduce mosaic gpu": (
            lambda x, r, w: gpu_all_reduce_add_rms_norm(
                x[0], r[0], w, num_programs=ROWS, vector_size=8, **summed
            ),
            (partials, per_dp, weight),
            (RANKS, DP, ALL),
            (DP, DP),
        ),
        "all_reduce tpu": (
            lambda x, r, w: tpu_all_reduce_add_rms_norm(x[0], r[0], w, ring=False, **summed),
            (partials, per_dp, weight),
            (RANKS, DP, ALL),
            (DP, DP),
        ),
        "moe_finalize mosaic gpu": (
            lambda o, g, r, w: gpu_moe_finalize_add_rms_norm(
                o[0], g[0], r[0], w, num_programs=ROWS, vector_size=8, **summed
            ),
            (outputs, routing, moe_residual, weight),
            (RANKS, DP, DP, ALL),
            (DP, DP),
        ),
        "moe_finalize tpu": (
            lambda o, g, r, w: tpu_moe_finalize_all_reduce_add_rms_norm(
                o[0], g[0], r[0], w, **summed
            ),
            (outputs, routing, moe_residual, weight),
            (RANKS, DP, DP, ALL),
            (DP, DP),
        ),
        "moe_finalize tpu blocked": (
            lambda o, g, r, w: blocked_moe_finalize_add_rms_norm(
                o[0], g[0], r[0], w, block_rows=ROWS, interpret=False, tpu=True, **norm
            ),
            (outputs, routing, moe_residual, weight),
            (RANKS, DP, DP, ALL),
            (RANKS, RANKS),
        ),
        "expert_matmul triton": (
            lambda r, w, s: (expert_matmul(r[0], w, s[0]),),
            (rows, weights, sizes),
            (RANKS, ALL, RANKS),
            (RANKS,),
        ),
        "hopper ragged_dot": (
            lambda r, w, s: (hopper_ragged_dot(r[0], w, s[0]),),
            (rows.astype(jnp.bfloat16), weights.astype(jnp.bfloat16), sizes),
            (RANKS, ALL, RANKS),
            (RANKS,),
        ),
    }


@pytest.mark.parametrize("name", list(compiled_launches()))
def test_compiled_kernels_declare_their_types(name):
    """The GPU and TPU kernels (traced, not run: no GPU or TPU here) type their outputs as
    their references': through `out_shape` (Triton, Mosaic TPU) or after the call (Mosaic GPU,
    which types them invariant). Their own out_specs hold (a sum over tp leaves the outputs
    alike over tp); replicated ones fail (the outputs vary over dp)."""
    op, args, in_specs, out_specs = compiled_launches()[name]
    args = placed(args, in_specs)
    right = jax.shard_map(op, mesh=mesh(), in_specs=in_specs, out_specs=out_specs)
    jax.jit(right).trace(*args)
    replicated = jax.shard_map(
        op, mesh=mesh(), in_specs=in_specs, out_specs=(ALL,) * len(out_specs)
    )
    with pytest.raises(ValueError, match="replicat"):
        jax.jit(replicated).trace(*args)
