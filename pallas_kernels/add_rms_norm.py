"""Fused residual add + RMSNorm: `normed, new_residual = norm(x + residual) * weight, x + residual`.

Layout: the reference (the spec), the kernel bodies (a BlockSpec body shared by Mosaic TPU, Triton
and the interpreter; a Mosaic GPU body), block sizes, and the public wrapper.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from . import axes, compat
from .impl import INTERPRETERS, SUPPORTED_DTYPES, Impl, check_impl, platform_kernel
from .rms_norm_common import (
    MAX_HIDDEN_GPU,
    check_inputs,
    gpu_vector_size,
    inverse_rms,
    weight_factor,
)
from .vjp import with_reference_vjp

# ---------------------------------------------------------------------------------------------
# Reference


def add_rms_norm_reference(
    x: jax.Array,  # [..., hidden]
    residual: jax.Array | None,  # [..., hidden]
    weight: jax.Array,  # [hidden]
    *,
    eps: float = 1e-6,
    unit_offset: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The one specification of add + RMSNorm (the kernels' and `boundary_jax`'s), in plain
    `jnp`, accumulating in float32 (or in the inputs' dtype where that is wider, so float64
    stays float64).

    Args:
      x: The stage output to add.
      residual: The residual stream, or None to normalize `x` alone.
      weight: The norm's scale.
      eps: Added to the mean of squares.
      unit_offset: Scale by `1 + weight` instead of `weight`.

    Returns:
      `(normed, new_residual)`: the accumulated sum `x + residual` normalized, scaled and cast
      to `x.dtype`, and that sum rounded to `residual.dtype` (`x` itself when `residual` is
      None): a bf16 stream loses no precision between the add and the norm.
    """
    dtype = x.dtype if residual is None else jnp.promote_types(x.dtype, residual.dtype)
    acc = jnp.promote_types(dtype, jnp.float32)
    summed = x.astype(acc)
    if residual is not None:
        summed = summed + residual.astype(acc)
    mean_square = jnp.mean(summed * summed, axis=-1, keepdims=True)
    scale = weight.astype(acc).reshape((1,) * (x.ndim - 1) + weight.shape)
    scale = 1.0 + scale if unit_offset else scale
    normed = (summed * lax.rsqrt(mean_square + eps) * scale).astype(x.dtype)
    return normed, (x if residual is None else round_residual(summed, residual.dtype))


def round_residual(summed: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`summed` rounded to the residual stream's `dtype`, kept rounded where XLA compiles it.

    XLA's GPU compiler may drop a float32 -> bf16 -> float32 round trip (excess precision): the
    stream then stays float32 from layer to layer, twice its bytes, and each norm re-adds every
    term since the last one it kept (measured in the DeepSeek-V2-Lite prefill: about 90 us per
    layer against 28 us for the same adds in bf16, `benchmarks/RESULTS.md` run 22). Rounding to
    bf16 in integer arithmetic (to nearest even, NaN kept quiet) leaves no convert pair for it
    to drop, and leaves XLA free to fuse it with the ops around it (run 28); other narrowings
    store the rounded value behind an optimization barrier.
    """
    dtype = jnp.dtype(dtype)
    if dtype == summed.dtype:
        return summed
    if (summed.dtype, dtype) != (jnp.float32, jnp.bfloat16):
        return lax.optimization_barrier(summed.astype(dtype))
    bits = lax.bitcast_convert_type(summed, jnp.uint32)
    nearest_even = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    quiet_nan = (bits >> 16) | 0x40
    high = jnp.where((bits & 0x7FFFFFFF) > 0x7F800000, quiet_nan, nearest_even)
    return lax.bitcast_convert_type(high.astype(jnp.uint16), jnp.bfloat16)


# ---------------------------------------------------------------------------------------------
# Kernel bodies


def _add_rms_norm_kernel(*refs, hidden: int, eps: float, unit_offset: bool, has_residual: bool):
    """One [block_rows, hidden] block (Mosaic TPU, the interpreter)."""
    if has_residual:
        x_ref, residual_ref, weight_ref, out_ref, residual_out_ref = refs
    else:
        x_ref, weight_ref, out_ref = refs
    summed = x_ref[...].astype(jnp.float32)
    if has_residual:
        summed = summed + residual_ref[...].astype(jnp.float32)
        residual_out_ref[...] = summed.astype(residual_out_ref.dtype)
    inv_rms = inverse_rms(jnp.sum(summed * summed, axis=1, keepdims=True), hidden=hidden, eps=eps)
    scale = weight_factor(weight_ref[...], unit_offset=unit_offset)
    out_ref[...] = (summed * inv_rms * scale).astype(out_ref.dtype)


_PROGRAMS = "programs"


def _add_rms_norm_gpu_kernel(
    *refs,
    rows: int,
    hidden: int,
    eps: float,
    unit_offset: bool,
    has_residual: bool,
    num_programs: int,
    rows_per_step: int,
    vector_size: int,
):
    """Mosaic GPU: each program (one warpgroup) walks its rows, `rows_per_step` rows at a time.

    A row lives in registers in the warpgroup-strided layout (16-byte accesses). The rows of one
    step are all loaded before any is reduced, so their memory latencies overlap. A short last
    step re-does row `rows - 1` instead of branching: the duplicate writes carry equal values.
    """
    if has_residual:
        x_ref, residual_ref, weight_ref, out_ref, residual_out_ref = refs
    else:
        x_ref, weight_ref, out_ref = refs
    layout = plgpu.Layout.WG_STRIDED((hidden,), vec_size=vector_size)
    scale = weight_factor(plgpu.load(weight_ref, layout=layout), unit_offset=unit_offset)
    first = lax.axis_index(_PROGRAMS) * rows_per_step

    @pl.loop(first, rows, step=num_programs * rows_per_step)
    def _step(row):
        step_rows = (
            [row]
            if rows_per_step == 1
            else [jnp.minimum(row + i, rows - 1) for i in range(rows_per_step)]
        )
        sums = []
        for r in step_rows:
            summed = plgpu.load(x_ref.at[r], layout=layout).astype(jnp.float32)
            if has_residual:
                summed = summed + plgpu.load(residual_ref.at[r], layout=layout).astype(jnp.float32)
            sums.append(summed)
        for r, summed in zip(step_rows, sums, strict=True):
            if has_residual:
                residual_out_ref[r] = summed.astype(residual_out_ref.dtype)
            inv_rms = inverse_rms(jnp.sum(summed * summed), hidden=hidden, eps=eps)
            out_ref[r] = (summed * inv_rms * scale).astype(out_ref.dtype)


def _add_rms_norm_triton_kernel(
    *refs,
    rows_per_program: int,
    chunks: tuple[tuple[int, int], ...],
    hidden: int,
    eps: float,
    unit_offset: bool,
    has_residual: bool,
):
    """Triton: `rows_per_program` whole rows per program, read once and kept in registers.

    A row is read in power-of-two chunks of lanes (`row_chunks`) that tile it exactly, so no
    array is padded and no lane is masked at any width. The last program slides back to end at
    the last row: the rows it shares with the previous program get equal values again.
    """
    if has_residual:
        x_ref, residual_ref, weight_ref, out_ref, residual_out_ref = refs
    else:
        x_ref, weight_ref, out_ref = refs
    rows = x_ref.shape[0]
    first = jnp.minimum(pl.program_id(0) * rows_per_program, rows - rows_per_program)
    row_slice = pl.ds(first, rows_per_program)
    sums, sum_of_squares = [], 0.0
    for offset, size in chunks:
        lanes = pl.ds(offset, size)
        summed = pltriton.load(x_ref.at[row_slice, lanes]).astype(jnp.float32)
        if has_residual:
            summed = summed + pltriton.load(residual_ref.at[row_slice, lanes]).astype(jnp.float32)
            stored = summed.astype(residual_out_ref.dtype)
            pltriton.store(residual_out_ref.at[row_slice, lanes], stored)
        sums.append(summed)
        sum_of_squares = sum_of_squares + jnp.sum(summed * summed, axis=1, keepdims=True)
    inv_rms = inverse_rms(sum_of_squares, hidden=hidden, eps=eps)
    for (offset, size), summed in zip(chunks, sums, strict=True):
        lanes = pl.ds(offset, size)
        scale = weight_factor(pltriton.load(weight_ref.at[:, lanes]), unit_offset=unit_offset)
        pltriton.store(
            out_ref.at[row_slice, lanes], (summed * inv_rms * scale).astype(out_ref.dtype)
        )


# ---------------------------------------------------------------------------------------------
# Block sizes


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """Grid blocking of the BlockSpec kernel (Mosaic TPU, Triton, interpreter).

    Attributes:
      block_rows: Rows per grid step; the last block may be ragged (for Triton the arrays are
        padded to whole blocks: `whole_blocks`).
      block_hidden: Hidden lanes per block: `hidden`, or for Triton the next power of two.
      num_warps: Triton warps per program (None elsewhere).
    """

    block_rows: int
    block_hidden: int
    num_warps: int | None = None


@dataclasses.dataclass(frozen=True)
class GpuLaunch:
    """Launch shape of the Mosaic GPU kernel.

    Attributes:
      num_programs: Warpgroups launched; each walks rows with this stride.
      rows_per_step: Rows whose loads a program issues together.
      vector_size: Elements per thread per vector access.
    """

    num_programs: int
    rows_per_step: int
    vector_size: int


_TPU_BLOCK_BYTES = 512 * 1024
_TPU_MAX_HIDDEN = 16384  # a minimal block (8-16 rows), double-buffered, stays within ~8 MiB of VMEM
_INTERPRET_BLOCK_ROWS = 8  # small, so CPU tests cover multi-block grids and ragged last blocks
_TRITON_BLOCK_ELEMENTS = 8192
# Measured on H200 at GPT-OSS's width (benchmarks/RESULTS.md run 38): the Triton kernel 28.9 us
# against XLA's 35.9 at 4096 rows, 7.4 against 8.2 at 1024, 4.5 against 2.7 at 256.
TRITON_MIN_ROWS = 1024
_TRITON_MIN_CHUNK = 8  # the Triton kernel's narrowest lane chunk: widths are multiples of it
# Measured on H200 (benchmarks/RESULTS.md run 1): one program per row, scheduled by the hardware,
# beat 1-8 persistent programs per SM by 3-5% at 4096-32768 rows; 2 rows per step did not help.
_GPU_ROWS_PER_STEP = 1


def block_shape(impl: Impl, rows: int, hidden: int, dtype: np.dtype) -> BlockShape:
    """Block sizes of the BlockSpec kernel for `impl` on a [rows, hidden] input."""
    itemsize = np.dtype(dtype).itemsize
    if impl is Impl.PALLAS_TRITON:
        block_hidden = pl.next_power_of_2(hidden)
        block_rows = min(max(1, _TRITON_BLOCK_ELEMENTS // block_hidden), pl.next_power_of_2(rows))
        num_warps = 4 if block_rows * block_hidden <= 2048 else 8 if block_hidden <= 8192 else 16
        return BlockShape(block_rows, block_hidden, num_warps)
    if impl is Impl.PALLAS_INTERPRET:
        return BlockShape(min(rows, _INTERPRET_BLOCK_ROWS), hidden)
    sublanes = 32 // itemsize  # Mosaic TPU tiles rows by 8 (f32) or 16 (16-bit)
    block_rows = max(sublanes, _TPU_BLOCK_BYTES // (hidden * itemsize) // sublanes * sublanes)
    return BlockShape(rows if rows <= block_rows else block_rows, hidden)


def whole_blocks(
    impl: Impl, blocks: BlockShape, weight: jax.Array, *arrays: jax.Array | None
) -> tuple[jax.Array | None, ...]:
    """The [hidden] weight as [1, hidden] and the [rows, hidden] arrays, for Triton zero-padded
    to whole blocks: JAX 0.11.2's Triton lowering stores a block that runs past an array
    without a mask, over whatever memory follows. Other backends take them as they are."""
    weight = weight.reshape(1, -1)
    if impl is not Impl.PALLAS_TRITON:
        return weight, *arrays
    rows = pl.cdiv(arrays[0].shape[0], blocks.block_rows) * blocks.block_rows

    def pad(array: jax.Array, to_rows: int) -> jax.Array:
        extra = ((0, to_rows - array.shape[0]), (0, blocks.block_hidden - array.shape[1]))
        return jnp.pad(array, extra) if any(after for _, after in extra) else array

    return pad(weight, 1), *(None if array is None else pad(array, rows) for array in arrays)


def gpu_launch(rows: int, hidden: int, dtype: np.dtype) -> GpuLaunch:
    """Launch shape of the Mosaic GPU kernel on a [rows, hidden] input."""
    num_programs = pl.cdiv(rows, _GPU_ROWS_PER_STEP)
    return GpuLaunch(num_programs, _GPU_ROWS_PER_STEP, gpu_vector_size(hidden, dtype))


# ---------------------------------------------------------------------------------------------
# Public wrapper


def add_rms_norm_supported(
    *, platform: str, rows: int, hidden: int, dtype: jnp.dtype, impl: Impl | None = None
) -> bool:
    """Whether a fused Pallas kernel takes this call; pure Python, no side effects.

    Args:
      platform: Where it would run, as `jax.default_backend()` names it.
      rows: Rows after flattening leading dimensions.
      hidden: The normalized (last) dimension.
      dtype: The dtype of `x` and `residual`.
      impl: A backend to ask about; None asks about the platform's own kernel.

    Returns:
      True when `add_rms_norm(..., impl=impl)` would run a Pallas kernel (for `Impl.XLA`: always).
      False for the platform default on CPU, where no kernel beats XLA.
    """
    check_impl(impl)
    if impl is None:
        impl = _platform_impl(platform, rows, hidden, dtype)
        if impl is Impl.XLA:
            return False
    if np.dtype(dtype) not in SUPPORTED_DTYPES or rows < 1 or hidden < 1:
        return False
    match impl:
        case Impl.XLA | Impl.PALLAS_INTERPRET:
            return True
        case Impl.PALLAS_GPU:
            return platform in ("gpu", "cuda") and _gpu_kernel_fits(hidden, dtype)
        case Impl.PALLAS_GPU_INTERPRET:
            return compat.gpu_interpret_params() is not None and _gpu_kernel_fits(hidden, dtype)
        case Impl.PALLAS_TRITON:
            return platform in ("gpu", "cuda") and _triton_kernel_fits(hidden)
        case Impl.PALLAS_TPU:
            return platform == "tpu" and hidden <= _TPU_MAX_HIDDEN


def _gpu_kernel_fits(hidden: int, dtype: jnp.dtype) -> bool:
    return hidden <= MAX_HIDDEN_GPU and gpu_vector_size(hidden, dtype) > 0


def _triton_kernel_fits(hidden: int) -> bool:
    return hidden <= MAX_HIDDEN_GPU and hidden % _TRITON_MIN_CHUNK == 0


def _platform_impl(platform: str, rows: int, hidden: int, dtype: jnp.dtype) -> Impl:
    """The platform's kernel for this call: on GPU, Mosaic GPU where its layout divides the row;
    Triton at other widths (GPT-OSS's 2880, for one) from TRITON_MIN_ROWS rows; XLA below."""
    impl = platform_kernel(platform)
    if impl is Impl.PALLAS_GPU and not _gpu_kernel_fits(hidden, dtype):
        return Impl.PALLAS_TRITON if rows >= TRITON_MIN_ROWS else Impl.XLA
    return impl


@functools.partial(jax.jit, static_argnames=("eps", "unit_offset", "impl"))
def add_rms_norm(
    x: jax.Array,  # [..., rows, hidden]
    residual: jax.Array | None,  # like x
    weight: jax.Array,  # [hidden]
    *,
    eps: float = 1e-6,
    unit_offset: bool = False,
    impl: Impl | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Adds `x` to the residual stream and RMS-normalizes the sum, in one pass over memory.

    The sum is formed in float32; the new residual is that sum rounded to `x.dtype`, and the
    normalized output is computed from the unrounded sum. `add_rms_norm_reference` is the spec.

    Args:
      x: The stage output, float32, bfloat16 or float16; leading dimensions are flattened.
      residual: The residual stream (x's shape and dtype), or None to normalize `x` alone.
      weight: The norm's scale, any floating dtype.
      eps: Added to the mean of squares.
      unit_offset: Scale by `1 + weight` instead of `weight` (the weight holds its offset from
        one, as Gemma's norms store it).
      impl: The backend. None picks the platform's kernel (on GPU Mosaic GPU where its layout
        divides the row, Triton at other widths from `TRITON_MIN_ROWS` rows; Mosaic TPU on TPU)
        when `add_rms_norm_supported` says it takes the shape, and the XLA reference otherwise.

    Returns:
      `(normed, new_residual)`, both shaped like `x`, in `x.dtype`; `new_residual` is `x` itself
      when `residual` is None. Differentiable: the gradients are the reference's (its VJP runs
      backward). Inside `shard_map` the outputs vary over the mesh axes the reference's would,
      so `check_vma=True` holds around the kernel.

    Raises:
      TypeError: Bad dtypes or a non-`Impl` impl.
      ValueError: Bad shapes or eps.
      NotImplementedError: An explicit `impl` that cannot run this call on this platform.
    """
    check_inputs(x, residual, weight, eps=eps)
    check_impl(impl)
    hidden = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    platform = jax.default_backend()
    if impl is None:
        impl = _platform_impl(platform, rows, hidden, x.dtype)
        if not add_rms_norm_supported(platform=platform, rows=rows, hidden=hidden, dtype=x.dtype):
            impl = Impl.XLA
    elif not add_rms_norm_supported(
        platform=platform, rows=max(rows, 1), hidden=hidden, dtype=x.dtype, impl=impl
    ):
        raise NotImplementedError(
            f"{impl} cannot run add_rms_norm on {platform=} with {x.shape=}, {x.dtype=}; "
            "check add_rms_norm_supported() first, or pass impl=None to fall back to XLA."
        )
    if impl is Impl.XLA or rows == 0:
        return add_rms_norm_reference(x, residual, weight, eps=eps, unit_offset=unit_offset)

    kernel = functools.partial(_add_rms_norm_kernels, eps=eps, unit_offset=unit_offset, impl=impl)
    reference = functools.partial(add_rms_norm_reference, eps=eps, unit_offset=unit_offset)
    if impl in INTERPRETERS:
        kernel = axes.interpreted(kernel, reference)
    return with_reference_vjp(kernel, reference)(x, residual, weight)


def _add_rms_norm_kernels(
    x: jax.Array,
    residual: jax.Array | None,
    weight: jax.Array,
    *,
    eps: float,
    unit_offset: bool,
    impl: Impl,
) -> tuple[jax.Array, jax.Array]:
    """`add_rms_norm`'s forward through the Pallas kernel of `impl`."""
    rows, hidden = math.prod(x.shape[:-1]), x.shape[-1]
    x_rows = x.reshape(rows, hidden)
    residual_rows = None if residual is None else residual.reshape(rows, hidden)
    if impl in (Impl.PALLAS_GPU, Impl.PALLAS_GPU_INTERPRET):
        outs = mosaic_gpu_add_rms_norm(
            x_rows,
            residual_rows,
            weight,
            eps=eps,
            unit_offset=unit_offset,
            launch=gpu_launch(rows, hidden, x.dtype),
            interpret=None if impl is Impl.PALLAS_GPU else compat.gpu_interpret_params(),
        )
    elif impl is Impl.PALLAS_TRITON:
        outs = triton_add_rms_norm(x_rows, residual_rows, weight, eps=eps, unit_offset=unit_offset)
    else:
        outs = _pallas_call_add_rms_norm(
            x_rows, residual_rows, weight, eps=eps, unit_offset=unit_offset, impl=impl
        )
    normed = outs[0].reshape(x.shape)
    return normed, (x if residual is None else outs[1].reshape(x.shape))


def mosaic_gpu_add_rms_norm(
    x: jax.Array,  # [rows, hidden]
    residual: jax.Array | None,  # [rows, hidden]
    weight: jax.Array,  # [hidden]
    *,
    eps: float,
    unit_offset: bool,
    launch: GpuLaunch,
    interpret: object = None,
) -> tuple[jax.Array, ...]:
    """Runs the Mosaic GPU kernel with an explicit launch shape (benchmarks sweep it).

    Args:
      x, residual, weight, eps, unit_offset: As for `add_rms_norm`, already flattened to rows and
        validated.
      launch: The grid and vector shape; `gpu_launch` gives the tuned default.
      interpret: None to compile for the GPU, or Mosaic GPU interpret parameters to run on CPU.

    Returns:
      `(normed,)`, or `(normed, new_residual)` when a residual is given, varying over the mesh
      axes `add_rms_norm_reference`'s outputs would.
    """
    rows, hidden = x.shape
    has_residual = residual is not None
    varying = axes.reference_varying(add_rms_norm_reference, x, residual, weight, eps=eps)
    kernel = functools.partial(
        _add_rms_norm_gpu_kernel,
        rows=rows,
        hidden=hidden,
        eps=eps,
        unit_offset=unit_offset,
        has_residual=has_residual,
        num_programs=launch.num_programs,
        rows_per_step=launch.rows_per_step,
        vector_size=launch.vector_size,
    )
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    call = plgpu.kernel(
        kernel,
        out_type=(out, out) if has_residual else (out,),
        grid=(launch.num_programs,),
        grid_names=(_PROGRAMS,),
        # Safe: no thread reads memory it also writes.
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane, unsafe_no_auto_barriers=True
        ),
        interpret=interpret,
    )
    outs = call(x, residual, weight) if has_residual else call(x, weight)
    # Mosaic GPU types its outputs invariant; they vary as the reference's do.
    return tuple(map(axes.mark_varying, outs, varying))


def row_chunks(hidden: int) -> tuple[tuple[int, int], ...]:
    """(offset, size) of the power-of-two lane chunks that tile a row of `hidden` lanes, largest
    first (2880: 2048, 512, 256, 64)."""
    chunks, offset = [], 0
    for bit in reversed(range(hidden.bit_length())):
        if hidden & (1 << bit):
            chunks.append((offset, 1 << bit))
            offset += 1 << bit
    return tuple(chunks)


def triton_add_rms_norm(
    x: jax.Array,  # [rows, hidden]
    residual: jax.Array | None,  # [rows, hidden]
    weight: jax.Array,  # [hidden]
    *,
    eps: float,
    unit_offset: bool,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Runs the Triton kernel: one pass over memory at any width `_triton_kernel_fits` takes.

    Args:
      x, residual, weight, eps, unit_offset: As for `add_rms_norm`, already flattened to rows and
        validated (at least one row).
      interpret: Run the kernel body in the Pallas interpreter (CPU tests).

    Returns:
      `(normed,)`, or `(normed, new_residual)` when a residual is given, varying over the mesh
      axes `add_rms_norm_reference`'s outputs would.
    """
    rows, hidden = x.shape
    # Whole rows of at most _TRITON_BLOCK_ELEMENTS per program, a power of two, at most `rows`.
    per_program = 1 << (min(max(1, _TRITON_BLOCK_ELEMENTS // hidden), rows).bit_length() - 1)
    has_residual = residual is not None
    operands, out_shape = _operands_and_outputs(x, residual, weight, eps=eps)
    call = pl.pallas_call(
        functools.partial(
            _add_rms_norm_triton_kernel,
            rows_per_program=per_program,
            chunks=row_chunks(hidden),
            hidden=hidden,
            eps=eps,
            unit_offset=unit_offset,
            has_residual=has_residual,
        ),
        out_shape=out_shape,
        grid=(pl.cdiv(rows, per_program),),
        compiler_params=pltriton.CompilerParams(num_warps=8 if per_program * hidden > 2048 else 4),
        interpret=interpret,
    )
    return tuple(call(*operands, weight.reshape(1, hidden)))


def _operands_and_outputs(
    x: jax.Array, residual: jax.Array | None, weight: jax.Array, *, eps: float
) -> tuple[tuple[jax.Array, ...], tuple[jax.ShapeDtypeStruct, ...]]:
    """A BlockSpec or Triton kernel's row operands (x, and the residual where given) and output
    types, varying over the mesh axes `add_rms_norm_reference`'s outputs would."""
    varying = axes.reference_varying(add_rms_norm_reference, x, residual, weight, eps=eps)
    operands = (x,) if residual is None else (x, residual)
    return operands, tuple(axes.output_type(x.shape, x.dtype, v) for v in varying[: len(operands)])


def _pallas_call_add_rms_norm(
    x: jax.Array,  # [rows, hidden]
    residual: jax.Array | None,  # [rows, hidden]
    weight: jax.Array,  # [hidden]
    *,
    eps: float,
    unit_offset: bool,
    impl: Impl,
) -> tuple[jax.Array, ...]:
    """The BlockSpec kernel (Mosaic TPU, or the interpreter): whole rows, blocks of rows."""
    rows, hidden = x.shape
    blocks = block_shape(impl, rows, hidden, x.dtype)
    row_block = pl.BlockSpec((blocks.block_rows, blocks.block_hidden), lambda i: (i, 0))
    weight_block = pl.BlockSpec((1, blocks.block_hidden), lambda i: (0, 0))
    has_residual = residual is not None
    operands, out_shape = _operands_and_outputs(x, residual, weight, eps=eps)
    compiler_params = None
    if impl is Impl.PALLAS_TPU:
        compiler_params = pltpu.CompilerParams(dimension_semantics=("parallel",))
    call = pl.pallas_call(
        functools.partial(
            _add_rms_norm_kernel,
            hidden=hidden,
            eps=eps,
            unit_offset=unit_offset,
            has_residual=has_residual,
        ),
        out_shape=out_shape,
        grid=(pl.cdiv(rows, blocks.block_rows),),
        in_specs=[row_block] * len(operands) + [weight_block],
        out_specs=(row_block, row_block) if has_residual else (row_block,),
        compiler_params=compiler_params,
        interpret=impl is Impl.PALLAS_INTERPRET,
    )
    return tuple(call(*operands, weight.reshape(1, hidden)))
