"""Public wrapper: complete a partial sum over mesh axes, add it to the residual, RMS-normalize."""

import enum
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import axes
from ..add_rms_norm import add_rms_norm
from ..axes import AxisName
from ..impl import INTERPRETERS, SUPPORTED_DTYPES, Impl, check_impl, platform_kernel
from ..rms_norm_common import MAX_HIDDEN_GPU, check_inputs, gpu_vector_size
from ..vjp import with_reference_vjp
from .kernel_gpu import gpu_all_reduce_add_rms_norm
from .kernel_tpu import tpu_all_reduce_add_rms_norm
from .reference import all_reduce_add_rms_norm_reference


class AllReduceAlgorithm(enum.Enum):
    """How a fused kernel completes the sum.

    Attributes:
      ONE_SHOT: Every device gets every partial and sums them itself: one hop of latency,
        (devices - 1) x the bytes. For small (decode-sized) inputs. TPU and GPU.
      RING: Reduce-scatter ring, then all-gather ring of the completed sums (in `x.dtype`, as
        `psum` returns them), then add + norm of every row: 2 (devices - 1) hops,
        2 (devices - 1) / devices x the bytes. TPU only.
    """

    ONE_SHOT = enum.auto()
    RING = enum.auto()


# Not measured (no TPU here): one-shot is latency-bound, the ring moves fewer bytes per device.
_TPU_ONE_SHOT_MAX_BYTES = 256 * 1024
_TPU_VMEM_BUDGET = 12 * 1024 * 1024  # whole arrays live in VMEM; leave room for temporaries
_GPU_MAX_ROWS = 2048  # measured up to here; one-shot reads (devices - 1) x the bytes
_GPU_MAX_DEVICES = 8
_GPU_PROGRAMS_PER_SM = 2  # every program must be resident: programs wait on their peers
# On JAX 0.11.2 / 2 x H200 the fused kernel beat psum + add + norm 1.2-1.4x from this size of
# partial sum up and broke even at half of it (benchmarks/RESULTS.md): XLA puts a multi-GPU
# barrier kernel before every Mosaic GPU collective launch, and XLA's own small psum is already a
# one-shot kernel.
_GPU_MIN_FUSED_BYTES = 16 * 2**20


def _choose_algorithm(impl: Impl, rows: int, hidden: int, dtype: jnp.dtype) -> AllReduceAlgorithm:
    if impl is Impl.PALLAS_GPU:
        return AllReduceAlgorithm.ONE_SHOT
    small = rows * hidden * np.dtype(dtype).itemsize <= _TPU_ONE_SHOT_MAX_BYTES
    return AllReduceAlgorithm.ONE_SHOT if small else AllReduceAlgorithm.RING


def _ring_rows(rows: int, num_devices: int, dtype: jnp.dtype) -> int:
    """Rows after padding, so each device's chunk is a whole number of TPU sublane tiles."""
    multiple = num_devices * (32 // np.dtype(dtype).itemsize)
    return pl.cdiv(rows, multiple) * multiple


def _tpu_vmem_bytes(
    algorithm: AllReduceAlgorithm, rows: int, hidden: int, dtype: jnp.dtype, num_devices: int
) -> int:
    """VMEM the TPU kernel needs: its arrays, scratch and float32 temporaries."""
    itemsize = np.dtype(dtype).itemsize
    if algorithm is AllReduceAlgorithm.ONE_SHOT:
        array = rows * hidden * itemsize
        return (4 + num_devices) * array + 3 * rows * hidden * 4
    padded = _ring_rows(rows, num_devices, dtype)
    array = padded * hidden * itemsize
    scratch = (2 * num_devices - 3) * array // num_devices
    return 4 * array + scratch + 3 * padded * hidden * 4


def all_reduce_add_rms_norm_supported(
    *,
    platform: str,
    rows: int,
    hidden: int,
    dtype: jnp.dtype,
    num_devices: int,
    impl: Impl | None = None,
    algorithm: AllReduceAlgorithm | None = None,
) -> bool:
    """Whether a fused kernel completes this sum; pure Python, touches no device or array.

    A boundary can call this before committing to the fused path and otherwise decline.

    Args:
      platform: Where it would run, as `jax.default_backend()` names it.
      rows: Rows per device, after flattening leading dimensions.
      hidden: The normalized (last) dimension.
      dtype: The dtype of `x` and `residual`.
      num_devices: Devices along the summed axes.
      impl: A backend to ask about; None asks whether the default would run a fused kernel.
      algorithm: An algorithm to ask about; None asks about the one the kernel would pick.

    Returns:
      True when `all_reduce_add_rms_norm` with these arguments would run a fused kernel (for
      `Impl.XLA`: always). False on CPU for the platform default, for a single device, and for
      shapes or device counts the kernels don't take. With `impl=None` on GPU also False below
      16 MiB of partial sum per device, where the fused kernel measured no faster than
      `psum` + `add_rms_norm`; `impl=Impl.PALLAS_GPU` asks about the kernel alone.
    """
    check_impl(impl)
    if np.dtype(dtype) not in SUPPORTED_DTYPES or rows < 1 or hidden < 1:
        return False
    if impl is None:
        impl = platform_kernel(platform)
        small = rows * hidden * np.dtype(dtype).itemsize < _GPU_MIN_FUSED_BYTES
        if impl is Impl.XLA or (impl is Impl.PALLAS_GPU and small):
            return False
    if impl is Impl.XLA:
        return True
    if num_devices < 2:
        return False
    algorithm = algorithm or _choose_algorithm(impl, rows, hidden, dtype)
    match impl:
        case Impl.PALLAS_GPU:
            return (
                platform in ("gpu", "cuda")
                and algorithm is AllReduceAlgorithm.ONE_SHOT
                and num_devices <= _GPU_MAX_DEVICES
                and rows <= _GPU_MAX_ROWS
                and hidden <= MAX_HIDDEN_GPU
                and gpu_vector_size(hidden, dtype) > 0
                # Peer pointers are exchanged within one process; across processes they failed.
                and jax.process_count() == 1
            )
        case Impl.PALLAS_TPU | Impl.PALLAS_INTERPRET:
            on_tpu = platform == "tpu" or impl is Impl.PALLAS_INTERPRET
            vmem = _tpu_vmem_bytes(algorithm, rows, hidden, dtype, num_devices)
            return on_tpu and vmem <= _TPU_VMEM_BUDGET
        case _:
            return False


@functools.partial(
    jax.jit, static_argnames=("axis_name", "eps", "unit_offset", "impl", "algorithm")
)
def all_reduce_add_rms_norm(
    x: jax.Array,  # [..., rows, hidden]: this device's partial sum
    residual: jax.Array | None,  # like x
    weight: jax.Array,  # [hidden]
    *,
    axis_name: AxisName,
    eps: float = 1e-6,
    unit_offset: bool = False,
    impl: Impl | None = None,
    algorithm: AllReduceAlgorithm | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Completes the sum of `x` over `axis_name`, adds it to `residual` and RMS-normalizes.

    Call inside `jax.shard_map` (`check_vma` on or off: the outputs vary over the mesh axes the
    reference's do, invariant over `axis_name`). Every device gets
    the same completed sum, adds it in float32 to its own `residual` and normalizes with its own
    `weight` (replicated in a tensor-parallel boundary, so all outputs agree). The one-shot
    kernels keep the sum in float32 up to the add; the ring rounds partial and completed sums to
    `x.dtype`, as `psum` does. Results match `all_reduce_add_rms_norm_reference` up to that
    rounding, and every device sums in the same order, so all devices get bit-identical sums.

    Args:
      x: This device's partial sum, float32, bfloat16 or float16.
      residual: The residual stream (x's shape and dtype), or None: the new residual is then the
        completed sum rounded to `x.dtype`.
      weight: The norm's scale, any floating dtype.
      axis_name: The mesh axis, or tuple of axes, to sum over.
      eps: Added to the mean of squares.
      unit_offset: Scale by `1 + weight` instead of `weight`.
      impl: The backend. None runs the platform's fused kernel (Mosaic GPU peer-to-peer on GPU,
        remote DMAs on TPU) when `all_reduce_add_rms_norm_supported` says it applies and pays
        off, and otherwise `lax.psum` followed by `add_rms_norm`. `Impl.XLA` is the reference;
        `Impl.PALLAS_INTERPRET` runs the TPU kernel in the TPU interpreter (on CPU).
      algorithm: Force one-shot or ring; None picks by size.

    Returns:
      `(normed, new_residual)`, both shaped like `x`, in `x.dtype`. Differentiable: the
      gradients are the reference's (its VJP, `psum` transposed, runs backward).

    Raises:
      TypeError, ValueError: As for `add_rms_norm`.
      NotImplementedError: An explicit `impl`/`algorithm` that cannot run this call.
    """
    check_inputs(x, residual, weight, eps=eps)
    check_impl(impl)
    if algorithm is not None and not isinstance(algorithm, AllReduceAlgorithm):
        raise TypeError(f"algorithm must be an AllReduceAlgorithm or None; got {algorithm=!r}")
    num_devices = lax.axis_size(axis_name)
    hidden = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    platform = jax.default_backend()
    supported = functools.partial(
        all_reduce_add_rms_norm_supported,
        platform=platform,
        rows=rows,
        hidden=hidden,
        dtype=x.dtype,
        num_devices=num_devices,
        algorithm=algorithm,
    )
    if impl is None:
        if not supported():
            return add_rms_norm(
                lax.psum(x, axis_name), residual, weight, eps=eps, unit_offset=unit_offset
            )
        impl = platform_kernel(platform)
    elif impl is not Impl.XLA and num_devices == 1:
        return add_rms_norm(x, residual, weight, eps=eps, unit_offset=unit_offset)
    elif not supported(impl=impl):
        raise NotImplementedError(
            f"{impl} with {algorithm=} cannot run all_reduce_add_rms_norm on {platform=} over "
            f"{num_devices} devices with {x.shape=}, {x.dtype=}; check "
            "all_reduce_add_rms_norm_supported() first, or pass impl=None to fall back to psum."
        )
    if impl is Impl.XLA:
        return all_reduce_add_rms_norm_reference(
            x, residual, weight, axis_name=axis_name, eps=eps, unit_offset=unit_offset
        )

    kernel = functools.partial(
        _fused_kernels,
        axis_name=axis_name,
        num_devices=num_devices,
        eps=eps,
        unit_offset=unit_offset,
        impl=impl,
        algorithm=algorithm or _choose_algorithm(impl, rows, hidden, x.dtype),
    )
    reference = functools.partial(
        all_reduce_add_rms_norm_reference, axis_name=axis_name, eps=eps, unit_offset=unit_offset
    )
    if impl in INTERPRETERS:
        kernel = axes.interpreted(kernel, reference)
    return with_reference_vjp(kernel, reference)(x, residual, weight)


def _fused_kernels(
    x: jax.Array,
    residual: jax.Array | None,
    weight: jax.Array,
    *,
    axis_name: AxisName,
    num_devices: int,
    eps: float,
    unit_offset: bool,
    impl: Impl,
    algorithm: AllReduceAlgorithm,
) -> tuple[jax.Array, jax.Array]:
    """`all_reduce_add_rms_norm`'s forward through the fused kernel of `impl`."""
    rows, hidden = math.prod(x.shape[:-1]), x.shape[-1]
    x_rows = x.reshape(rows, hidden)
    residual_rows = None if residual is None else residual.reshape(rows, hidden)
    if impl is Impl.PALLAS_GPU:
        num_sms = jax.local_devices()[0].core_count
        normed, new_residual = gpu_all_reduce_add_rms_norm(
            x_rows,
            residual_rows,
            weight,
            axis_name=axis_name,
            num_devices=num_devices,
            eps=eps,
            unit_offset=unit_offset,
            num_programs=min(rows, _GPU_PROGRAMS_PER_SM * num_sms),
            vector_size=gpu_vector_size(hidden, x.dtype),
        )
    else:
        ring = algorithm is AllReduceAlgorithm.RING
        padded = _ring_rows(rows, num_devices, x.dtype) if ring else rows
        pad = ((0, padded - rows), (0, 0))
        normed, new_residual = tpu_all_reduce_add_rms_norm(
            jnp.pad(x_rows, pad),
            None if residual_rows is None else jnp.pad(residual_rows, pad),
            weight,
            axis_name=axis_name,
            num_devices=num_devices,
            ring=ring,
            eps=eps,
            unit_offset=unit_offset,
            interpret=pltpu.InterpretParams() if impl is Impl.PALLAS_INTERPRET else False,
        )
        normed, new_residual = normed[:rows], new_residual[:rows]
    return normed.reshape(x.shape), new_residual.reshape(x.shape)
