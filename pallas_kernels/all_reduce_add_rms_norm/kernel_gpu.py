"""Mosaic GPU kernel: one-shot all-reduce over peer memory, fused with the add and RMSNorm.

Every device reads every peer's partial directly (`plgpu.remote_ref`, NVLink loads), so the sum
costs one hop of latency. Peer-to-peer only: no multicast objects or `multimem` instructions.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import axes
from ..axes import AxisName, device_id
from ..rms_norm_common import inverse_rms, weight_factor
from .reference import all_reduce_add_rms_norm_reference

_PROGRAMS = "programs"


def _one_shot_gpu_kernel(
    *refs,
    axis_name: AxisName,
    num_devices: int,
    eps: float,
    unit_offset: bool,
    has_residual: bool,
    num_programs: int,
    vector_size: int,
):
    """Program p of every device handles rows p, p + num_programs, ... of all devices' partials.

    Semaphores are per program, and program p only reads rows that program p of each peer also
    handles, so pairing programs across devices is enough: `ready` says a peer's program has
    started (its partial is written), `done` says it has finished reading ours, and no device's
    program leaves (freeing its partial) before every peer is done with it. Partials are summed in
    rank order, so all devices produce bit-identical outputs.
    """
    if has_residual:
        x_ref, residual_ref, weight_ref, out_ref, residual_out_ref, ready, done = refs
    else:
        x_ref, weight_ref, out_ref, residual_out_ref, ready, done = refs
    rows, hidden = x_ref.shape
    peers = [device_id(axis_name, jnp.int32(k)) for k in range(num_devices)]
    for peer in peers:
        pl.semaphore_signal(ready, device_id=peer)
    pl.semaphore_wait(ready, num_devices)

    layout = plgpu.Layout.WG_STRIDED((hidden,), vec_size=vector_size)
    scale = weight_factor(plgpu.load(weight_ref, layout=layout), unit_offset=unit_offset)
    partials = [plgpu.remote_ref(x_ref, peer) for peer in peers]

    @pl.loop(lax.axis_index(_PROGRAMS), rows, step=num_programs)
    def _row(row):
        loaded = [plgpu.load(p.at[row], layout=layout).astype(jnp.float32) for p in partials]
        summed = loaded[0]
        for partial in loaded[1:]:
            summed = summed + partial
        if has_residual:
            summed = summed + plgpu.load(residual_ref.at[row], layout=layout).astype(jnp.float32)
        residual_out_ref[row] = summed.astype(residual_out_ref.dtype)
        inv_rms = inverse_rms(jnp.sum(summed * summed), hidden=hidden, eps=eps)
        out_ref[row] = (summed * inv_rms * scale).astype(out_ref.dtype)

    for peer in peers:
        pl.semaphore_signal(done, device_id=peer)
    pl.semaphore_wait(done, num_devices)


def gpu_all_reduce_add_rms_norm(
    x: jax.Array,  # [rows, hidden]
    residual: jax.Array | None,  # [rows, hidden]
    weight: jax.Array,  # [hidden]
    *,
    axis_name: AxisName,
    num_devices: int,
    eps: float,
    unit_offset: bool,
    num_programs: int,
    vector_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Runs the one-shot Mosaic GPU kernel inside `shard_map`; returns `(normed, new_residual)`."""
    has_residual = residual is not None
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    call = plgpu.kernel(
        functools.partial(
            _one_shot_gpu_kernel,
            axis_name=axis_name,
            num_devices=num_devices,
            eps=eps,
            unit_offset=unit_offset,
            has_residual=has_residual,
            num_programs=num_programs,
            vector_size=vector_size,
        ),
        out_type=(out, out),
        grid=(num_programs,),
        grid_names=(_PROGRAMS,),
        scratch_types=[plgpu.SemaphoreType.REGULAR, plgpu.SemaphoreType.REGULAR],
        # Safe: no thread reads memory it also writes.
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane, unsafe_no_auto_barriers=True
        ),
    )
    operands = (x, residual, weight) if has_residual else (x, weight)
    # Mosaic GPU types its outputs invariant; they vary as the reference's do.
    varying = axes.reference_varying(
        all_reduce_add_rms_norm_reference, x, residual, weight, axis_name=axis_name
    )
    normed, new_residual = map(axes.mark_varying, call(*operands), varying)
    return normed, new_residual
