"""Mosaic GPU kernel: the top-k combine, a one-shot all-reduce over peer memory, add, RMSNorm.

Every device reads every peer's per-choice outputs and routing weights directly
(`plgpu.remote_ref`, NVLink loads) and combines them itself, so the sum costs one hop of latency
and no partial is written anywhere. Peer-to-peer only: no multicast objects or `multimem`
instructions. With one device (no sum owed) the same body reads its own inputs and signals
nobody, which is what the Mosaic GPU interpreter can run on CPU.
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
from .reference import moe_finalize_add_rms_norm_reference

_PROGRAMS = "programs"


def _gpu_kernel(
    *refs,
    axis_name: AxisName | None,
    num_devices: int,
    eps: float,
    unit_offset: bool,
    has_residual: bool,
    num_programs: int,
    vector_size: int,
):
    """Program p of every device handles rows p, p + num_programs, ... of every device's inputs.

    As in the all-reduce kernel, semaphores pair program p across devices: `ready` says every
    peer's program has started (its inputs are in place), `done` that it has finished reading
    ours. Choices are combined in (device, choice) order, so every device sums bit-identically.
    """
    if has_residual:
        outputs_ref, weights_ref, residual_ref, weight_ref, normed_ref, residual_out_ref = refs[:6]
        semaphores = refs[6:]
    else:
        outputs_ref, weights_ref, weight_ref, normed_ref, residual_out_ref = refs[:5]
        semaphores = refs[5:]
    rows, top_k, hidden = outputs_ref.shape
    if num_devices > 1:
        ready, done = semaphores
        peers = [device_id(axis_name, jnp.int32(d)) for d in range(num_devices)]
        for peer in peers:
            pl.semaphore_signal(ready, device_id=peer)
        pl.semaphore_wait(ready, num_devices)
        sources = [
            (plgpu.remote_ref(outputs_ref, peer), plgpu.remote_ref(weights_ref, peer))
            for peer in peers
        ]
    else:
        sources = [(outputs_ref, weights_ref)]

    layout = plgpu.Layout.WG_STRIDED((hidden,), vec_size=vector_size)
    scale = weight_factor(plgpu.load(weight_ref, layout=layout), unit_offset=unit_offset)

    @pl.loop(lax.axis_index(_PROGRAMS), rows, step=num_programs)
    def _row(row):
        loaded = [
            (plgpu.load(outputs.at[row, j], layout=layout), weights[row, j])
            for outputs, weights in sources
            for j in range(top_k)
        ]
        summed = None
        for output, routing_weight in loaded:
            term = output.astype(jnp.float32) * routing_weight.astype(jnp.float32)
            summed = term if summed is None else summed + term
        if has_residual:
            summed = summed + plgpu.load(residual_ref.at[row], layout=layout).astype(jnp.float32)
        residual_out_ref[row] = summed.astype(residual_out_ref.dtype)
        inv_rms = inverse_rms(jnp.sum(summed * summed), hidden=hidden, eps=eps)
        normed_ref[row] = (summed * inv_rms * scale).astype(normed_ref.dtype)

    if num_devices > 1:
        for peer in peers:
            pl.semaphore_signal(done, device_id=peer)
        pl.semaphore_wait(done, num_devices)


def gpu_moe_finalize_add_rms_norm(
    outputs: jax.Array,  # [rows, top_k, hidden]
    weights: jax.Array,  # [rows, top_k]
    residual: jax.Array | None,  # [rows, hidden]
    norm_weight: jax.Array,  # [hidden]
    *,
    axis_name: AxisName | None,
    num_devices: int,
    eps: float,
    unit_offset: bool,
    num_programs: int,
    vector_size: int,
    interpret: object = None,
) -> tuple[jax.Array, jax.Array]:
    """Runs the Mosaic GPU kernel (inside `shard_map` when `num_devices > 1`).

    Args:
      interpret: None to compile for the GPU, or Mosaic GPU interpret parameters (one device
        only: the interpreter does not simulate peer memory).

    Returns:
      `(normed, new_residual)`, [rows, hidden] each.
    """
    rows, _, hidden = outputs.shape
    has_residual = residual is not None
    out = jax.ShapeDtypeStruct((rows, hidden), outputs.dtype)
    semaphores = [plgpu.SemaphoreType.REGULAR] * 2 if num_devices > 1 else []
    call = plgpu.kernel(
        functools.partial(
            _gpu_kernel,
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
        scratch_types=semaphores,
        # Safe: no thread reads memory it also writes.
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane, unsafe_no_auto_barriers=True
        ),
        interpret=interpret,
    )
    operands = (outputs, weights, residual) if has_residual else (outputs, weights)
    # Mosaic GPU types its outputs invariant; they vary as the reference's do.
    varying = axes.reference_varying(
        moe_finalize_add_rms_norm_reference,
        outputs,
        weights,
        residual,
        norm_weight,
        axis_name=axis_name,
    )
    normed, new_residual = map(axes.mark_varying, call(*operands, norm_weight), varying)
    return normed, new_residual
