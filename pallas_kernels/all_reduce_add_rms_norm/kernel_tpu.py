"""Mosaic TPU kernels: complete a sum over remote DMAs, fused with the residual add and RMSNorm.

Both kernels keep whole [rows, hidden] arrays in VMEM and give every DMA its own send and
receive semaphore (no semaphore or buffer is reused within a call, so no capacity handshakes).
Each reads its device index from an SMEM operand (`axes.index_operand`).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import axes
from ..axes import AxisName, device_id
from ..rms_norm_common import inverse_rms, weight_factor
from .reference import all_reduce_add_rms_norm_reference


def _add_norm(
    total: jax.Array,  # [rows, hidden] float32
    residual: jax.Array | None,  # [rows, hidden]
    weight: jax.Array,  # [1, hidden]
    *,
    hidden: int,
    eps: float,
    unit_offset: bool,
    dtype: jnp.dtype,
) -> tuple[jax.Array, jax.Array]:
    summed = total if residual is None else total + residual.astype(jnp.float32)
    inv_rms = inverse_rms(jnp.sum(summed * summed, axis=1, keepdims=True), hidden=hidden, eps=eps)
    normed = summed * inv_rms * weight_factor(weight, unit_offset=unit_offset)
    return normed.astype(dtype), summed.astype(dtype)


def _barrier(axis_name: AxisName, peers: list[jax.Array]) -> None:
    """Returns once every device in `peers` has entered the kernel (its VMEM scratch exists)."""
    barrier = pltpu.get_barrier_semaphore()
    for peer in peers:
        pl.semaphore_signal(barrier, device_id=device_id(axis_name, peer))
    pl.semaphore_wait(barrier, len(peers))


def _one_shot_kernel(
    index_ref,
    *refs,
    axis_name: AxisName,
    num_devices: int,
    eps: float,
    unit_offset: bool,
    has_residual: bool,
):
    """Every device sends its partial to every other; each sums all partials in rank order.

    Summing in rank order (not arrival order) gives every device bit-identical outputs.
    """
    if has_residual:
        x_ref, residual_ref, weight_ref, out_ref, residual_out_ref, *scratch = refs
    else:
        x_ref, weight_ref, out_ref, residual_out_ref, *scratch = refs
        residual_ref = None
    gathered_ref, send_sems, recv_sems = scratch
    me = index_ref[0]
    offsets = range(1, num_devices)
    _barrier(axis_name, [lax.rem(me + k, num_devices) for k in offsets])

    def copy_to(peer, offset, slot):
        return pltpu.make_async_remote_copy(
            src_ref=x_ref,
            dst_ref=gathered_ref.at[slot],
            send_sem=send_sems.at[offset - 1],
            recv_sem=recv_sems.at[slot],
            device_id=device_id(axis_name, peer),
        )

    sends = [copy_to(lax.rem(me + k, num_devices), k, me) for k in offsets]
    for send in sends:
        send.start()
    gathered_ref[me] = x_ref[...]
    for k in offsets:
        sender = lax.rem(me + num_devices - k, num_devices)
        copy_to(sender, k, sender).wait_recv()
    for send in sends:
        send.wait_send()

    total = gathered_ref[0].astype(jnp.float32)
    for k in offsets:
        total = total + gathered_ref[k].astype(jnp.float32)
    normed, new_residual = _add_norm(
        total,
        None if residual_ref is None else residual_ref[...],
        weight_ref[...],
        hidden=x_ref.shape[1],
        eps=eps,
        unit_offset=unit_offset,
        dtype=out_ref.dtype,
    )
    out_ref[...] = normed
    residual_out_ref[...] = new_residual


def _ring_kernel(
    index_ref,
    *refs,
    axis_name: AxisName,
    num_devices: int,
    eps: float,
    unit_offset: bool,
    has_residual: bool,
):
    """Reduce-scatter ring, all-gather ring of the completed sums, then add + norm of every row.

    Rows split into `num_devices` chunks. Reduce-scatter step s sends the running partial of chunk
    (me - s) to the right neighbour and adds this device's rows to the partial of chunk
    (me - 1 - s) arriving from the left; after num_devices - 1 steps chunk (me + 1) is complete.
    The completed chunks then travel the ring the same way, in `x.dtype` (as `psum` returns them),
    so every device holds the same sums and applies its own residual and weight to all rows.
    """
    if has_residual:
        x_ref, residual_ref, weight_ref, out_ref, residual_out_ref, *scratch = refs
    else:
        x_ref, weight_ref, out_ref, residual_out_ref, *scratch = refs
        residual_ref = None
    received_ref, partial_ref, rs_send, rs_recv, ag_send, ag_recv = scratch
    n = num_devices
    chunk_rows = x_ref.shape[0] // n
    me = index_ref[0]
    right = device_id(axis_name, lax.rem(me + 1, n))
    _barrier(axis_name, [lax.rem(me + 1, n), lax.rem(me + n - 1, n)])

    def rows(chunk):
        return pl.ds(pl.multiple_of(chunk * chunk_rows, chunk_rows), chunk_rows)

    for step in range(n - 1):
        source = x_ref.at[rows(me)] if step == 0 else partial_ref.at[step - 1]
        copy = pltpu.make_async_remote_copy(
            src_ref=source,
            dst_ref=received_ref.at[step],
            send_sem=rs_send.at[step],
            recv_sem=rs_recv.at[step],
            device_id=right,
        )
        copy.start()
        copy.wait_recv()
        chunk = lax.rem(me + 2 * n - 1 - step, n)
        total = received_ref[step].astype(jnp.float32) + x_ref[rows(chunk), :].astype(jnp.float32)
        if step < n - 2:
            partial_ref[step] = total.astype(partial_ref.dtype)
        else:
            # out_ref stages the completed sums until the norm overwrites them, saving VMEM.
            out_ref[rows(chunk), :] = total.astype(out_ref.dtype)
        copy.wait_send()

    own = lax.rem(me + 1, n)
    for step in range(n - 1):
        chunk = rows(lax.rem(own + n - step, n))
        copy = pltpu.make_async_remote_copy(
            src_ref=out_ref.at[chunk],
            dst_ref=out_ref.at[chunk],
            send_sem=ag_send.at[step],
            recv_sem=ag_recv.at[step],
            device_id=right,
        )
        copy.start()
        copy.wait_recv()
        copy.wait_send()

    normed, new_residual = _add_norm(
        out_ref[...].astype(jnp.float32),
        None if residual_ref is None else residual_ref[...],
        weight_ref[...],
        hidden=x_ref.shape[1],
        eps=eps,
        unit_offset=unit_offset,
        dtype=out_ref.dtype,
    )
    out_ref[...] = normed
    residual_out_ref[...] = new_residual


def tpu_all_reduce_add_rms_norm(
    x: jax.Array,  # [rows, hidden]; rows % num_devices == 0 for the ring
    residual: jax.Array | None,  # [rows, hidden]
    weight: jax.Array,  # [hidden]
    *,
    axis_name: AxisName,
    num_devices: int,
    ring: bool,
    eps: float,
    unit_offset: bool,
    interpret: object = False,
) -> tuple[jax.Array, jax.Array]:
    """Runs the one-shot or ring TPU kernel inside `shard_map`; returns `(normed, new_residual)`.

    Args:
      interpret: False to compile for TPU, or `pltpu.InterpretParams(...)` to simulate the devices
        (remote DMAs included) on CPU.
    """
    rows, hidden = x.shape
    has_residual = residual is not None
    if ring:
        chunk = (rows // num_devices, hidden)
        body = _ring_kernel
        scratch_shapes = [
            pltpu.VMEM((num_devices - 1, *chunk), x.dtype),
            pltpu.VMEM((max(num_devices - 2, 1), *chunk), x.dtype),
            pltpu.SemaphoreType.DMA((num_devices - 1,)),
            pltpu.SemaphoreType.DMA((num_devices - 1,)),
            pltpu.SemaphoreType.DMA((num_devices - 1,)),
            pltpu.SemaphoreType.DMA((num_devices - 1,)),
        ]
    else:
        body = _one_shot_kernel
        scratch_shapes = [
            pltpu.VMEM((num_devices, rows, hidden), x.dtype),
            pltpu.SemaphoreType.DMA((num_devices - 1,)),
            pltpu.SemaphoreType.DMA((num_devices,)),
        ]
    operands = (x, residual) if has_residual else (x,)
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    varying = axes.reference_varying(
        all_reduce_add_rms_norm_reference, x, residual, weight, axis_name=axis_name
    )
    call = pl.pallas_call(
        functools.partial(
            body,
            axis_name=axis_name,
            num_devices=num_devices,
            eps=eps,
            unit_offset=unit_offset,
            has_residual=has_residual,
        ),
        out_shape=tuple(axes.output_type(x.shape, x.dtype, v) for v in varying),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] + [vmem] * (len(operands) + 1),
        out_specs=(vmem, vmem),
        scratch_shapes=scratch_shapes,
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret,
    )
    index = axes.index_operand(axis_name, interpret=interpret is not False)
    normed, new_residual = call(index, *operands, weight.reshape(1, hidden))
    return normed, new_residual
