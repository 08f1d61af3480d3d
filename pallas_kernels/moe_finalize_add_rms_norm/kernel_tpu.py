"""BlockSpec and Mosaic TPU kernels: the top-k combine fused with the add and RMSNorm.

`_block_kernel` (no sum owed) runs on Mosaic TPU and in the Pallas interpreter, a block of rows
per grid step. `_one_shot_kernel` also completes a sum over remote DMAs: each device combines its
own choices in float32, sends that partial to every peer and sums all partials in rank order, so
every device gets bit-identical sums; whole arrays live in VMEM, every DMA has its own
semaphores (nothing is reused within a call), and the device index comes from an SMEM operand
(`axes.index_operand`).
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
from .reference import moe_finalize_add_rms_norm_reference


def _combine(outputs_ref, weights_ref) -> jax.Array:
    """[rows, hidden] float32: `sum_j weights[:, j] * outputs[:, j]`, in choice order."""
    weights = weights_ref[...].astype(jnp.float32)
    total = None
    for j in range(outputs_ref.shape[1]):
        term = weights[:, j : j + 1] * outputs_ref[:, j, :].astype(jnp.float32)
        total = term if total is None else total + term
    return total


def _add_norm(summed, residual_ref, weight_ref, normed_ref, residual_out_ref, *, eps, unit_offset):
    if residual_ref is not None:
        summed = summed + residual_ref[...].astype(jnp.float32)
    residual_out_ref[...] = summed.astype(residual_out_ref.dtype)
    hidden = summed.shape[1]
    inv_rms = inverse_rms(jnp.sum(summed * summed, axis=1, keepdims=True), hidden=hidden, eps=eps)
    normed = summed * inv_rms * weight_factor(weight_ref[...], unit_offset=unit_offset)
    normed_ref[...] = normed.astype(normed_ref.dtype)


def _block_kernel(*refs, eps: float, unit_offset: bool, has_residual: bool):
    """One block of rows: combine, add, normalize (no sum owed)."""
    if has_residual:
        outputs_ref, weights_ref, residual_ref, weight_ref, normed_ref, residual_out_ref = refs
    else:
        outputs_ref, weights_ref, weight_ref, normed_ref, residual_out_ref = refs
        residual_ref = None
    summed = _combine(outputs_ref, weights_ref)
    _add_norm(
        summed,
        residual_ref,
        weight_ref,
        normed_ref,
        residual_out_ref,
        eps=eps,
        unit_offset=unit_offset,
    )


def _one_shot_kernel(
    index_ref,
    *refs,
    axis_name: AxisName,
    num_devices: int,
    eps: float,
    unit_offset: bool,
    has_residual: bool,
):
    """Combine locally, exchange the float32 partials with every peer, sum in rank order."""
    if has_residual:
        outputs_ref, weights_ref, residual_ref, weight_ref, normed_ref, residual_out_ref = refs[:6]
    else:
        outputs_ref, weights_ref, weight_ref, normed_ref, residual_out_ref = refs[:5]
        residual_ref = None
    gathered_ref, send_sems, recv_sems = refs[-3:]
    me = index_ref[0]
    offsets = range(1, num_devices)
    barrier = pltpu.get_barrier_semaphore()
    for k in offsets:  # every peer's VMEM scratch exists before anything is sent to it
        pl.semaphore_signal(barrier, device_id=device_id(axis_name, lax.rem(me + k, num_devices)))
    pl.semaphore_wait(barrier, num_devices - 1)
    gathered_ref[me] = _combine(outputs_ref, weights_ref)

    def copy(peer, offset, slot):
        return pltpu.make_async_remote_copy(
            src_ref=gathered_ref.at[slot],
            dst_ref=gathered_ref.at[slot],
            send_sem=send_sems.at[offset - 1],
            recv_sem=recv_sems.at[slot],
            device_id=device_id(axis_name, peer),
        )

    sends = [copy(lax.rem(me + k, num_devices), k, me) for k in offsets]
    for send in sends:
        send.start()
    for k in offsets:
        sender = lax.rem(me + num_devices - k, num_devices)
        copy(sender, k, sender).wait_recv()
    for send in sends:
        send.wait_send()
    total = gathered_ref[0]
    for d in range(1, num_devices):
        total = total + gathered_ref[d]
    _add_norm(
        total,
        residual_ref,
        weight_ref,
        normed_ref,
        residual_out_ref,
        eps=eps,
        unit_offset=unit_offset,
    )


def blocked_moe_finalize_add_rms_norm(
    outputs: jax.Array,  # [rows, top_k, hidden]
    weights: jax.Array,  # [rows, top_k]
    residual: jax.Array | None,  # [rows, hidden]
    norm_weight: jax.Array,  # [hidden]
    *,
    eps: float,
    unit_offset: bool,
    block_rows: int,
    interpret: bool,
    tpu: bool,
) -> tuple[jax.Array, jax.Array]:
    """Runs `_block_kernel` over row blocks (no sum owed); returns `(normed, new_residual)`."""
    rows, top_k, hidden = outputs.shape
    has_residual = residual is not None
    row_block = pl.BlockSpec((block_rows, hidden), lambda i: (i, 0))
    in_specs = [
        pl.BlockSpec((block_rows, top_k, hidden), lambda i: (i, 0, 0)),
        pl.BlockSpec((block_rows, top_k), lambda i: (i, 0)),
        *([row_block] if has_residual else []),
        pl.BlockSpec((1, hidden), lambda i: (0, 0)),
    ]
    varying = axes.reference_varying(
        moe_finalize_add_rms_norm_reference, outputs, weights, residual, norm_weight
    )
    call = pl.pallas_call(
        functools.partial(
            _block_kernel, eps=eps, unit_offset=unit_offset, has_residual=has_residual
        ),
        out_shape=tuple(axes.output_type((rows, hidden), outputs.dtype, v) for v in varying),
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=in_specs,
        out_specs=(row_block, row_block),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)) if tpu else None,
        interpret=interpret,
    )
    operands = (outputs, weights, residual) if has_residual else (outputs, weights)
    normed, new_residual = call(*operands, norm_weight.reshape(1, hidden))
    return normed, new_residual


def tpu_moe_finalize_all_reduce_add_rms_norm(
    outputs: jax.Array,  # [rows, top_k, hidden]
    weights: jax.Array,  # [rows, top_k]
    residual: jax.Array | None,  # [rows, hidden]
    norm_weight: jax.Array,  # [hidden]
    *,
    axis_name: AxisName,
    num_devices: int,
    eps: float,
    unit_offset: bool,
    interpret: object = False,
) -> tuple[jax.Array, jax.Array]:
    """Runs `_one_shot_kernel` inside `shard_map`; returns `(normed, new_residual)`.

    Args:
      interpret: False to compile for TPU, or `pltpu.InterpretParams(...)` to simulate the
        devices (remote DMAs included) on CPU.
    """
    rows, _, hidden = outputs.shape
    has_residual = residual is not None
    operands = (outputs, weights, residual) if has_residual else (outputs, weights)
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    varying = axes.reference_varying(
        moe_finalize_add_rms_norm_reference,
        outputs,
        weights,
        residual,
        norm_weight,
        axis_name=axis_name,
    )
    call = pl.pallas_call(
        functools.partial(
            _one_shot_kernel,
            axis_name=axis_name,
            num_devices=num_devices,
            eps=eps,
            unit_offset=unit_offset,
            has_residual=has_residual,
        ),
        out_shape=tuple(axes.output_type((rows, hidden), outputs.dtype, v) for v in varying),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] + [vmem] * (len(operands) + 1),
        out_specs=(vmem, vmem),
        scratch_shapes=[
            pltpu.VMEM((num_devices, rows, hidden), jnp.float32),
            pltpu.SemaphoreType.DMA((num_devices - 1,)),
            pltpu.SemaphoreType.DMA((num_devices,)),
        ],
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret,
    )
    index = axes.index_operand(axis_name, interpret=interpret is not False)
    normed, new_residual = call(index, *operands, norm_weight.reshape(1, hidden))
    return normed, new_residual
