"""The block-scaled FP8 matmuls of FP8 linear layers and MoE experts (dense, batched over experts
padded to a capacity, grouped over rows sorted by expert): implementations, the choice between
them, and the public wrappers."""

import enum

import jax
import jax.numpy as jnp

from .. import axes, compat
from ..grouped_matmul import TRITON_MAX_ROUTED_ROWS, GroupedMatmulImpl, grouped_matmul
from ..quantize import dequantize_blocks_reference, dequantize_token_groups_reference
from .kernel_grouped_triton import fp8_expert_matmul
from .kernel_mosaic import fp8_matmul_mosaic
from .kernel_triton import fp8_matmul_triton
from .reference import (
    fp8_batched_matmul_reference,
    fp8_grouped_matmul_reference,
    fp8_matmul_reference,
)
from .tuned_block_sizes import (
    SCALE_BLOCK,
    MosaicFp8Tiling,
    TritonFp8Tiling,
    mosaic_fp8_batched_tiling,
    mosaic_fp8_tiling,
    triton_fp8_tiling,
)


class Fp8MatmulImpl(enum.Enum):
    """How a block-scaled FP8 matmul runs.

    Attributes:
      XLA: `fp8_matmul_reference`: both operands dequantized to float32 and multiplied by XLA
        (the specification; CPU and TPU). On an H200 XLA reaches the FP8 tensor cores only for
        per-tensor scales, and FP8 weights converted in the program ran at 0.38-0.94x the bf16
        matmul (JAX 0.11.2, a [4096, 14336] weight), so GPUs take the kernels below.
      PALLAS_TRITON: `fp8_matmul_triton`, the Triton decode kernel: FP8 weights read once, each
        128-deep product scaled in registers (NVIDIA, compute capability >= 8.9).
      PALLAS_INTERPRET: PALLAS_TRITON's body in the Pallas interpreter (tests, any platform).
      PALLAS_GPU: `fp8_matmul_mosaic`: warp-specialized FP8 wgmma through Mosaic GPU (Hopper),
        scales applied per 128-deep step in registers; at decode sizes the weight takes the
        wgmma's wide side (`MosaicFp8Tiling.swap`).
      PALLAS_GPU_INTERPRET: PALLAS_GPU's body in the Mosaic GPU interpreter (CPU, JAX >= 0.12).
      DEQUANTIZED_BF16: both operands dequantized to bf16 in the program and XLA's bf16 matmul
        with float32 sums (one bf16 rounding of each dequantized value): what plain XLA offers
        on a GPU without the kernels (0.53x / 0.78x bf16's `jnp.dot` at 512 / 4096 rows on an
        H200, `benchmarks/RESULTS.md` run 22).
      GPU_BY_SIZE: PALLAS_TRITON up to `TRITON_MAX_ROWS` rows, PALLAS_GPU above
        (`fp8_matmul_by_size`).
    """

    XLA = enum.auto()
    PALLAS_TRITON = enum.auto()
    PALLAS_INTERPRET = enum.auto()
    PALLAS_GPU = enum.auto()
    PALLAS_GPU_INTERPRET = enum.auto()
    DEQUANTIZED_BF16 = enum.auto()
    GPU_BY_SIZE = enum.auto()


TRITON_MAX_ROWS = 16
"""The most rows `GPU_BY_SIZE` gives the Triton decode kernel; the Mosaic kernel takes more. On one
H200 (a [4096 -> 14336] projection, `benchmarks/RESULTS.md` run 22): at 8 rows Triton 21.4 us,
Mosaic 24.1 us; at 64 rows Triton 32.1 us, Mosaic 23.2 us."""

Fp8Tiling = TritonFp8Tiling | MosaicFp8Tiling


def default_fp8_matmul_impl(platform: str) -> Fp8MatmulImpl:
    """The FP8 matmul for a JAX platform name: `GPU_BY_SIZE` on GPU, `XLA` elsewhere. Decide
    this once, when the model is built."""
    return Fp8MatmulImpl.GPU_BY_SIZE if platform in ("gpu", "cuda") else Fp8MatmulImpl.XLA


def fp8_matmul_by_size(m: int) -> Fp8MatmulImpl:
    """`GPU_BY_SIZE`'s pick for `m` rows."""
    return Fp8MatmulImpl.PALLAS_TRITON if m <= TRITON_MAX_ROWS else Fp8MatmulImpl.PALLAS_GPU


def fp8_matmul(
    x_values: jax.Array,  # [M, K] float8_e4m3fn
    x_scales: jax.Array,  # [M, K / 128] float32
    w_values: jax.Array,  # [N, K] float8_e4m3fn
    w_scales: jax.Array,  # [N / 128, K / 128] float32
    *,
    out_dtype: jnp.dtype,
    impl: Fp8MatmulImpl = Fp8MatmulImpl.XLA,
    tiling: Fp8Tiling | None = None,
) -> jax.Array:
    """`x @ w.T` for rows quantized per 128-feature group and a weight per 128 x 128 block,
    float32 sums: `fp8_matmul_reference` is the specification.

    Args:
      x_values, x_scales: The rows (`pallas_kernels.quantize`'s token-group format).
      w_values, w_scales: The weight, [out, in] with its `weight_scale_inv` (Hugging Face's
        fine-grained FP8 layout).
      out_dtype: The result's dtype.
      impl: How it runs (`Fp8MatmulImpl`).
      tiling: The kernel's tiling (a `TritonFp8Tiling` or `MosaicFp8Tiling` for the kernel
        `impl` runs); None for the tuned tables. Ignored by XLA.

    Returns:
      [M, N] in `out_dtype`; inside `shard_map` it varies as the reference's would. Not
      differentiable: FP8 weights are for inference.

    Raises:
      ValueError: Shapes that do not fit the format (K and N multiples of 128, scales to
        match).
      TypeError: A tiling for the other kernel.
      NotImplementedError: The Mosaic GPU interpreter on a JAX without one.
    """
    _check(x_values, x_scales, w_values, w_scales)
    m = x_values.shape[0]
    k, n = w_values.shape[1], w_values.shape[0]
    if impl is Fp8MatmulImpl.GPU_BY_SIZE:
        impl = fp8_matmul_by_size(m)
    args = (x_values, x_scales, w_values, w_scales)
    match impl:
        case Fp8MatmulImpl.XLA:
            return fp8_matmul_reference(*args, out_dtype=out_dtype)
        case Fp8MatmulImpl.DEQUANTIZED_BF16:
            return _dequantized_bf16(*args, out_dtype=out_dtype)
        case Fp8MatmulImpl.PALLAS_TRITON | Fp8MatmulImpl.PALLAS_INTERPRET:
            chosen = _tiling(tiling, TritonFp8Tiling, triton_fp8_tiling, m, k, n)
            interpret = impl is Fp8MatmulImpl.PALLAS_INTERPRET

            def kernel(*args):
                return fp8_matmul_triton(
                    *args, out_dtype=out_dtype, tiling=chosen, interpret=interpret
                )

        case Fp8MatmulImpl.PALLAS_GPU | Fp8MatmulImpl.PALLAS_GPU_INTERPRET:
            chosen = _tiling(tiling, MosaicFp8Tiling, mosaic_fp8_tiling, m, k, n)
            interpret = None
            if impl is Fp8MatmulImpl.PALLAS_GPU_INTERPRET:
                interpret = _gpu_interpreter(impl)

            def kernel(*args):
                return fp8_matmul_mosaic(
                    *args, out_dtype=out_dtype, tiling=chosen, interpret=interpret
                )

    if impl in (Fp8MatmulImpl.PALLAS_INTERPRET, Fp8MatmulImpl.PALLAS_GPU_INTERPRET):

        def reference(*args):
            return fp8_matmul_reference(*args, out_dtype=out_dtype)

        kernel = axes.interpreted(kernel, reference)
    return kernel(*args)


def _check(x_values, x_scales, w_values, w_scales) -> None:
    m, k = x_values.shape
    n = w_values.shape[0]
    want = {
        "x_scales": (m, k // SCALE_BLOCK),
        "w_values": (n, k),
        "w_scales": (n // SCALE_BLOCK, k // SCALE_BLOCK),
    }
    got = {"x_scales": x_scales.shape, "w_values": w_values.shape, "w_scales": w_scales.shape}
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    if k % SCALE_BLOCK or n % SCALE_BLOCK or got != want:
        raise ValueError(
            f"fp8_matmul takes x [M, K] with scales [M, K/128] and w [N, K] with scales "
            f"[N/128, K/128], K and N multiples of 128; got {x_values.shape=} and {got}"
        )
    if x_values.dtype != fp8 or w_values.dtype != fp8:
        raise ValueError(
            f"fp8_matmul multiplies float8_e4m3fn values; got {x_values.dtype=}, "
            f"{w_values.dtype=}. Quantize them first (pallas_kernels.quantize)"
        )


def _dequantized_bf16(x_values, x_scales, w_values, w_scales, *, out_dtype) -> jax.Array:
    """DEQUANTIZED_BF16: both operands dequantized to bf16, XLA's matmul with float32 sums
    (batched over any leading axes the operands share)."""
    rows = dequantize_token_groups_reference(x_values, x_scales, jnp.bfloat16)
    weight = dequantize_blocks_reference(w_values, w_scales, jnp.bfloat16)
    out = jnp.einsum("...mk,...nk->...mn", rows, weight, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _gpu_interpreter(impl: Fp8MatmulImpl) -> object:
    interpret = compat.gpu_interpret_params()
    if interpret is None:
        raise NotImplementedError(
            f"{impl} needs JAX's Mosaic GPU interpreter (JAX >= 0.12); use PALLAS_INTERPRET or XLA"
        )
    return interpret


def _tiling(tiling, kind: type, table, m: int, k: int, n: int) -> Fp8Tiling:
    if tiling is None:
        return table(m, k, n)
    if not isinstance(tiling, kind):
        raise TypeError(f"this kernel takes a {kind.__name__}; got {tiling=}")
    return tiling


def fp8_batched_matmul(
    x_values: jax.Array,  # [G, M, K] float8_e4m3fn
    x_scales: jax.Array,  # [G, M, K / 128] float32
    w_values: jax.Array,  # [G, N, K] float8_e4m3fn
    w_scales: jax.Array,  # [G, N / 128, K / 128] float32
    *,
    out_dtype: jnp.dtype,
    impl: Fp8MatmulImpl = Fp8MatmulImpl.XLA,
    tiling: MosaicFp8Tiling | None = None,
) -> jax.Array:
    """`out[g] = x[g] @ w[g].T` for every group at once (MoE experts padded to a capacity of M
    rows each): `fp8_batched_matmul_reference` is the specification.

    Args:
      x_values, x_scales: Each group's rows, quantized per 128-feature token group.
      w_values, w_scales: Each group's [N, K] weight with its block scales.
      out_dtype: The result's dtype.
      impl: XLA (the reference), PALLAS_GPU (the Mosaic wgmma kernel, every group in one
        launch; also GPU_BY_SIZE), PALLAS_GPU_INTERPRET (its body in the Mosaic GPU
        interpreter) or DEQUANTIZED_BF16 (both dequantized to bf16 and XLA's batched matmul).
      tiling: The Mosaic kernel's tiling; None for `mosaic_fp8_batched_tiling`.

    Returns:
      [G, M, N] in `out_dtype`, varying inside `shard_map` as the reference's would. Not
      differentiable.

    Raises:
      ValueError: Shapes off the format, or an impl with no batched form (the Triton kernels).
      NotImplementedError: The Mosaic GPU interpreter on a JAX without one.
    """
    if x_values.ndim != 3 or w_values.ndim != 3 or x_values.shape[0] != w_values.shape[0]:
        raise ValueError(
            f"fp8_batched_matmul takes x [G, M, K] and w [G, N, K] with the same G; got "
            f"{x_values.shape=}, {w_values.shape=}"
        )
    args = (x_values, x_scales, w_values, w_scales)
    _check(*(jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in args))  # one group's shapes
    match impl:
        case Fp8MatmulImpl.XLA:
            return fp8_batched_matmul_reference(*args, out_dtype=out_dtype)
        case Fp8MatmulImpl.DEQUANTIZED_BF16:
            return _dequantized_bf16(*args, out_dtype=out_dtype)
        case (
            Fp8MatmulImpl.PALLAS_GPU
            | Fp8MatmulImpl.GPU_BY_SIZE
            | Fp8MatmulImpl.PALLAS_GPU_INTERPRET
        ):
            pass
        case _:
            raise ValueError(
                f"fp8_batched_matmul has no {impl} form; use XLA, PALLAS_GPU, "
                "PALLAS_GPU_INTERPRET or DEQUANTIZED_BF16"
            )
    _, m, k = x_values.shape
    chosen = _tiling(tiling, MosaicFp8Tiling, mosaic_fp8_batched_tiling, m, k, w_values.shape[1])
    if impl is not Fp8MatmulImpl.PALLAS_GPU_INTERPRET:
        return fp8_matmul_mosaic(*args, out_dtype=out_dtype, tiling=chosen)
    interpret = _gpu_interpreter(impl)

    def kernel(*args):
        return fp8_matmul_mosaic(*args, out_dtype=out_dtype, tiling=chosen, interpret=interpret)

    def reference(*args):
        return fp8_batched_matmul_reference(*args, out_dtype=out_dtype)

    return axes.interpreted(kernel, reference)(*args)


class Fp8GroupedImpl(enum.Enum):
    """How the grouped FP8 matmul of MoE experts runs (rows sorted by expert).

    Attributes:
      XLA: `fp8_grouped_matmul_reference`: both dequantized, `jax.lax.ragged_dot` in float32
        (the specification; CPU and TPU).
      PALLAS_TRITON: `fp8_expert_matmul`: only the chosen experts' FP8 weights read,
        dequantized in registers (decode).
      PALLAS_INTERPRET: PALLAS_TRITON's body in the Pallas interpreter (tests).
      GPU_BY_SIZE: PALLAS_TRITON up to `grouped_matmul.TRITON_MAX_ROUTED_ROWS` routed rows.
        Above, the MoE layer pads (`padded_product`), as `GroupedMatmulImpl.PADDED_BATCHED`
        does for bf16 experts: the quantized rows copied expert-major into [local experts, C,
        hidden], C the smallest capacity bucket that holds the busiest expert, and both products
        through `fp8_batched_matmul` on the Mosaic wgmma kernel. Past the
        buckets, and in `fp8_grouped_matmul` itself, the weights and rows are dequantized to
        bf16 in the program for the bf16 grouped matmul (`GroupedMatmulImpl.GPU_BY_SIZE`). On an
        H200 (Qwen3-30B-A3B layer, benchmarks/RESULTS.md run 44) the layer runs 1.10x the bf16
        layer's speed at 8 tokens, 1.49x at 64 and 1.02x at 4096; padding at decode sizes too
        was slower than bf16 (0.61x at 8 tokens), so no strategy pads there.
      PADDED_GPU_INTERPRET: The padded products at any count, with the kernel in the Mosaic GPU
        interpreter, and XLA past the buckets (tests, any platform with JAX >= 0.12).
    """

    XLA = enum.auto()
    PALLAS_TRITON = enum.auto()
    PALLAS_INTERPRET = enum.auto()
    GPU_BY_SIZE = enum.auto()
    PADDED_GPU_INTERPRET = enum.auto()


def padded_product(impl: Fp8GroupedImpl, routed_rows: int) -> Fp8MatmulImpl | None:
    """How the MoE layer multiplies its rows padded to capacity buckets under `impl` at a static
    count of routed rows (`fp8_batched_matmul`'s impl), or None where it runs the grouped
    products on rows sorted by expert instead: the Mosaic GPU interpreter under
    PADDED_GPU_INTERPRET at any count, the wgmma kernel under GPU_BY_SIZE above
    `TRITON_MAX_ROUTED_ROWS`. Past the buckets the layer falls back to `fp8_grouped_matmul`
    with `impl`."""
    if impl is Fp8GroupedImpl.PADDED_GPU_INTERPRET:
        return Fp8MatmulImpl.PALLAS_GPU_INTERPRET
    if impl is Fp8GroupedImpl.GPU_BY_SIZE and routed_rows > TRITON_MAX_ROUTED_ROWS:
        return Fp8MatmulImpl.PALLAS_GPU
    return None


def default_fp8_grouped_impl(platform: str) -> Fp8GroupedImpl:
    """The grouped FP8 matmul for a JAX platform name: `GPU_BY_SIZE` on GPU, `XLA` elsewhere."""
    return Fp8GroupedImpl.GPU_BY_SIZE if platform in ("gpu", "cuda") else Fp8GroupedImpl.XLA


def fp8_grouped_matmul(
    x_values: jax.Array,  # [M, K] float8_e4m3fn, sorted by group
    x_scales: jax.Array,  # [M, K / 128] float32
    w_values: jax.Array,  # [G, N, K] float8_e4m3fn
    w_scales: jax.Array,  # [G, N / 128, K / 128] float32
    group_sizes: jax.Array,  # [G] int32
    *,
    out_dtype: jnp.dtype,
    impl: Fp8GroupedImpl = Fp8GroupedImpl.XLA,
    tiling: TritonFp8Tiling | None = None,
) -> jax.Array:
    """`[M, K] x [G, N, K] -> [M, N]`: each row times its group's FP8 weight, float32 sums
    (`fp8_grouped_matmul_reference` is the specification).

    Args:
      x_values, x_scales: Rows sorted by group, quantized per 128-feature token group.
      w_values, w_scales: One [N, K] weight per group with its block scales.
      group_sizes: Rows per group.
      out_dtype: The result's dtype.
      impl: How it runs (`Fp8GroupedImpl`).
      tiling: The Triton kernel's tiling (None: its default).

    Returns:
      [M, N] in `out_dtype`; rows past `sum(group_sizes)` unspecified (zero for XLA). Not
      differentiable.
    """
    m = x_values.shape[0]
    if impl is Fp8GroupedImpl.PADDED_GPU_INTERPRET:
        impl = Fp8GroupedImpl.XLA
    if impl is Fp8GroupedImpl.GPU_BY_SIZE:
        if m > TRITON_MAX_ROUTED_ROWS:
            rows = dequantize_token_groups_reference(x_values, x_scales, jnp.bfloat16)
            weights = dequantize_blocks_reference(w_values, w_scales, jnp.bfloat16)
            out = grouped_matmul(
                rows,
                jnp.swapaxes(weights, 1, 2),
                group_sizes,
                impl=GroupedMatmulImpl.GPU_BY_SIZE,
            )
            return out.astype(out_dtype)
        impl = Fp8GroupedImpl.PALLAS_TRITON
    args = (x_values, x_scales, w_values, w_scales, group_sizes)
    if impl is Fp8GroupedImpl.XLA:
        return fp8_grouped_matmul_reference(*args, out_dtype=out_dtype)
    interpret = impl is Fp8GroupedImpl.PALLAS_INTERPRET
    return fp8_expert_matmul(*args, out_dtype=out_dtype, tiling=tiling, interpret=interpret)
