"""Public wrapper: a deferred MoE finalize, completed (and summed) fused with add + RMSNorm."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from .. import axes, compat
from ..axes import AxisName
from ..impl import INTERPRETERS, SUPPORTED_DTYPES, Impl, check_impl, platform_kernel
from ..rms_norm_common import MAX_HIDDEN_GPU, check_inputs, gpu_vector_size
from ..vjp import with_reference_vjp
from .kernel_gpu import gpu_moe_finalize_add_rms_norm
from .kernel_tpu import blocked_moe_finalize_add_rms_norm, tpu_moe_finalize_all_reduce_add_rms_norm
from .reference import moe_finalize_add_rms_norm_reference

_GPU_MAX_ROWS = 2048  # one-shot: each device reads (devices - 1) x the per-choice outputs
# Measured on 2 x H200, JAX 0.11.2, top-8, hidden 2048, bf16 (benchmarks/RESULTS.md run 9): with
# a sum at TP 2 the kernel took 3-4x the unfused path (51-281 us against 13-96 us per boundary:
# XLA's one-shot psum is already fast, and a Mosaic GPU collective launch waits on a multi-GPU
# barrier); without a sum it lost at 8-64 rows (0.34-0.61x) and won from 2048 rows (1.11x).
_GPU_MIN_ROWS_DEFAULT = 2048
_GPU_MAX_DEVICES = 8
_GPU_MAX_CHOICES = 16  # a row's loads are all issued before they are combined (registers)
_GPU_PROGRAMS_PER_SM = 2  # with a sum, every program must be resident: programs wait on peers
_TPU_VMEM_BUDGET = 12 * 1024 * 1024  # the one-shot kernel keeps whole arrays in VMEM
_TPU_BLOCK_BYTES = 512 * 1024  # per-choice outputs per grid step of the blocked kernel
_INTERPRET_BLOCK_ROWS = 8  # small, so CPU tests cover multi-block grids and ragged last blocks


def _tpu_one_shot_vmem(rows: int, top_k: int, hidden: int, dtype, num_devices: int) -> int:
    itemsize = np.dtype(dtype).itemsize
    return (top_k + 4) * rows * hidden * itemsize + (num_devices + 3) * rows * hidden * 4


def _block_rows(impl: Impl, rows: int, top_k: int, hidden: int, dtype) -> int:
    if impl is Impl.PALLAS_INTERPRET:
        return min(rows, _INTERPRET_BLOCK_ROWS)
    sublanes = 32 // np.dtype(dtype).itemsize
    fit = _TPU_BLOCK_BYTES // (top_k * hidden * np.dtype(dtype).itemsize) // sublanes * sublanes
    block = max(sublanes, fit)
    return rows if rows <= block else block


def moe_finalize_add_rms_norm_supported(
    *,
    platform: str,
    rows: int,
    top_k: int,
    hidden: int,
    dtype: jnp.dtype,
    num_devices: int,
    impl: Impl | None = None,
) -> bool:
    """Whether a fused kernel takes this finalize; pure Python, touches no device or array.

    Args:
      platform: Where it would run, as `jax.default_backend()` names it.
      rows: Rows per device.
      top_k: Choices per row (a shared expert carried as one more choice counts).
      hidden: The normalized (last) dimension.
      dtype: The dtype of the expert outputs and the residual.
      num_devices: Devices the finalized output is summed over (1: no sum owed).
      impl: A backend to ask about; None asks about the platform's own kernel.

    Returns:
      True when `moe_finalize_add_rms_norm(..., impl=impl)` runs a fused kernel (for `Impl.XLA`:
      always). False on CPU for the platform default, and for shapes, device counts or
      processes the kernels don't take. With `impl=None` on GPU also False where the kernel
      measured slower than the unfused path: with a sum owed, and below 2048 rows without one;
      `impl=Impl.PALLAS_GPU` asks about the kernel alone.
    """
    check_impl(impl)
    if np.dtype(dtype) not in SUPPORTED_DTYPES or min(rows, top_k, hidden, num_devices) < 1:
        return False
    if impl is None:
        impl = platform_kernel(platform)
        slower = impl is Impl.PALLAS_GPU and (num_devices > 1 or rows < _GPU_MIN_ROWS_DEFAULT)
        if impl is Impl.XLA or slower:
            return False
    match impl:
        case Impl.XLA:
            return True
        case Impl.PALLAS_GPU | Impl.PALLAS_GPU_INTERPRET:
            on_gpu = (
                platform in ("gpu", "cuda")
                if impl is Impl.PALLAS_GPU
                else (compat.gpu_interpret_params() is not None and num_devices == 1)
            )
            return (
                on_gpu
                and num_devices <= _GPU_MAX_DEVICES
                and (num_devices == 1 or rows <= _GPU_MAX_ROWS)
                and top_k <= _GPU_MAX_CHOICES
                and hidden <= MAX_HIDDEN_GPU
                and gpu_vector_size(hidden, dtype) > 0
                # Peer pointers are exchanged within one process; across processes they failed.
                and (num_devices == 1 or jax.process_count() == 1)
            )
        case Impl.PALLAS_TPU | Impl.PALLAS_INTERPRET:
            if platform != "tpu" and impl is Impl.PALLAS_TPU:
                return False
            vmem = _tpu_one_shot_vmem(rows, top_k, hidden, dtype, num_devices)
            return num_devices == 1 or vmem <= _TPU_VMEM_BUDGET
        case _:
            return False


@functools.partial(jax.jit, static_argnames=("axis_name", "eps", "unit_offset", "impl"))
def moe_finalize_add_rms_norm(
    expert_outputs: jax.Array,  # [rows, top_k, hidden]
    weights: jax.Array,  # [rows, top_k]
    residual: jax.Array | None,  # [rows, hidden]
    norm_weight: jax.Array,  # [hidden]
    *,
    axis_name: AxisName | None = None,
    eps: float = 1e-6,
    unit_offset: bool = False,
    impl: Impl | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`norm(residual + sum_over_axis(sum_k weights[:, k] * expert_outputs[:, k]))`, fused.

    The sparse FFN's deferred finalize (its top-k combine, a shared expert carried as one more
    choice of weight one), the sum it owes over `axis_name`, the residual add and the RMSNorm in
    one kernel. With `axis_name`, call inside `jax.shard_map` (with `check_vma` on or off: the
    outputs vary over the mesh axes the reference's do, so not over `axis_name`). The combine
    and the sum stay in float32 up to the add; `moe_finalize_add_rms_norm_reference` (the
    unfused path, which rounds the combine and the sum to the outputs' dtype) is the spec.

    Args:
      expert_outputs: This rank's per-choice outputs, float32, bfloat16 or float16.
      weights: [rows, top_k] routing weights, any floating dtype.
      residual: [rows, hidden] in the outputs' dtype, or None (the new residual is then the
        completed output).
      norm_weight: The norm's scale, any floating dtype.
      axis_name: The mesh axis, or tuple of axes, the output still owes a sum over; None for
        none.
      eps: Added to the mean of squares.
      unit_offset: Scale by `1 + norm_weight` instead of `norm_weight`.
      impl: The backend. None runs the platform's kernel where
        `moe_finalize_add_rms_norm_supported` says it applies, else the reference. `Impl.XLA` is
        the reference; `Impl.PALLAS_INTERPRET` runs the TPU kernels in the TPU interpreter (on
        CPU, remote DMAs simulated); `Impl.PALLAS_GPU_INTERPRET` the Mosaic GPU kernel in its
        interpreter (one device).

    Returns:
      `(normed, new_residual)`, [rows, hidden] each, in `expert_outputs.dtype`. Differentiable:
      the gradients are the reference's (its VJP runs backward).

    Raises:
      TypeError, ValueError: Bad dtypes or shapes (as `add_rms_norm`), or weights not
        [rows, top_k].
      NotImplementedError: An explicit `impl` that cannot run this call.
    """
    if expert_outputs.ndim != 3 or weights.shape != expert_outputs.shape[:2]:
        raise ValueError(
            "expert_outputs must be [rows, top_k, hidden] and weights [rows, top_k]; got "
            f"{expert_outputs.shape=}, {weights.shape=}"
        )
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"weights must have a floating dtype; got {weights.dtype=}")
    rows, top_k, hidden = expert_outputs.shape
    check_inputs(expert_outputs[:, 0], residual, norm_weight, eps=eps)
    check_impl(impl)
    num_devices = 1 if axis_name is None else lax.axis_size(axis_name)
    platform = jax.default_backend()
    supported = functools.partial(
        moe_finalize_add_rms_norm_supported,
        platform=platform,
        rows=rows,
        top_k=top_k,
        hidden=hidden,
        dtype=expert_outputs.dtype,
        num_devices=num_devices,
    )
    if impl is None:
        impl = platform_kernel(platform) if supported() else Impl.XLA
    elif not supported(impl=impl):
        raise NotImplementedError(
            f"{impl} cannot run moe_finalize_add_rms_norm on {platform=} over {num_devices} "
            f"devices with {expert_outputs.shape=}, {expert_outputs.dtype=}; check "
            "moe_finalize_add_rms_norm_supported() first, or pass impl=None to fall back."
        )
    if impl is Impl.XLA or rows == 0:
        return moe_finalize_add_rms_norm_reference(
            expert_outputs,
            weights,
            residual,
            norm_weight,
            axis_name=axis_name,
            eps=eps,
            unit_offset=unit_offset,
        )
    kernel = functools.partial(
        _fused_kernels,
        axis_name=axis_name,
        num_devices=num_devices,
        eps=eps,
        unit_offset=unit_offset,
        impl=impl,
    )
    reference = functools.partial(
        moe_finalize_add_rms_norm_reference, axis_name=axis_name, eps=eps, unit_offset=unit_offset
    )
    if impl in INTERPRETERS:
        kernel = axes.interpreted(kernel, reference)
    return with_reference_vjp(kernel, reference)(expert_outputs, weights, residual, norm_weight)


def _fused_kernels(
    expert_outputs: jax.Array,
    weights: jax.Array,
    residual: jax.Array | None,
    norm_weight: jax.Array,
    *,
    axis_name: AxisName | None,
    num_devices: int,
    eps: float,
    unit_offset: bool,
    impl: Impl,
) -> tuple[jax.Array, jax.Array]:
    """`moe_finalize_add_rms_norm`'s forward through the fused kernel of `impl`."""
    rows, top_k, hidden = expert_outputs.shape
    if impl in (Impl.PALLAS_GPU, Impl.PALLAS_GPU_INTERPRET):
        programs = rows
        if num_devices > 1:
            programs = min(rows, _GPU_PROGRAMS_PER_SM * jax.local_devices()[0].core_count)
        return gpu_moe_finalize_add_rms_norm(
            expert_outputs,
            weights,
            residual,
            norm_weight,
            axis_name=axis_name,
            num_devices=num_devices,
            eps=eps,
            unit_offset=unit_offset,
            num_programs=programs,
            vector_size=gpu_vector_size(hidden, expert_outputs.dtype),
            interpret=None if impl is Impl.PALLAS_GPU else compat.gpu_interpret_params(),
        )
    if num_devices == 1:
        return blocked_moe_finalize_add_rms_norm(
            expert_outputs,
            weights,
            residual,
            norm_weight,
            eps=eps,
            unit_offset=unit_offset,
            block_rows=_block_rows(impl, rows, top_k, hidden, expert_outputs.dtype),
            interpret=impl is Impl.PALLAS_INTERPRET,
            tpu=impl is Impl.PALLAS_TPU,
        )
    return tpu_moe_finalize_all_reduce_add_rms_norm(
        expert_outputs,
        weights,
        residual,
        norm_weight,
        axis_name=axis_name,
        num_devices=num_devices,
        eps=eps,
        unit_offset=unit_offset,
        interpret=pltpu.InterpretParams() if impl is Impl.PALLAS_INTERPRET else False,
    )
