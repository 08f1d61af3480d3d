"""Rows quantized per token group in one pass, after an optional activation: the FP8 input of a
projection whose input comes from elementwise work (the attention output into o_proj, `act(gate)
* up` into down_proj, an expert's activation).

`values, scales = quantize(act(x))`, or with gate and up stacked `quantize(act(gate) * up)`: the
activation in float32 (wider for float64), rounded to the input's dtype as the unfused layer
rounds it, then quantized per `group` features (`pallas_kernels.quantize`'s format). XLA's GPU
compiler makes that a maximum pass and a values pass that both read the input and redo the
activation (on an H200, 110 + 50 us for the down projection's input in a Llama-3-8B prefill
layer of 4096 rows); the kernel reads it once and writes the values and scales.

Layout: the reference (the spec), the kernel body (BlockSpec: Triton on GPU, the interpreter),
the public wrapper. Inference only: FP8 values carry no gradient.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import axes
from .impl import SUPPORTED_DTYPES, Impl, check_impl
from .quantize import FP8_DTYPE, quantize_token_groups_reference, store_token_groups

Activation = Callable[[jax.Array], jax.Array]
"""An elementwise function (`jax.nn.silu`, ...): static, so a module-level function."""

MAX_BLOCK_FEATURES = 512
"""Features per program at most (a power of two dividing the row, or one group)."""

MAX_BLOCK_ROWS = 16
"""Rows per program at most (a power of two dividing the rows)."""

KERNEL_MIN_ROWS = 1024
"""`impl=None` runs the kernel on GPU from this many rows; XLA below. On one H200 (JAX 0.11.2,
`benchmarks/bench_fp8.py --parts e2e moe` with `--quantize-rows kernel` and `xla`,
`benchmarks/RESULTS.md` run 24): the Llama-3-8B-shaped prefill of 4096 rows took 80.4 against
81.8 ms, but the decode step of 8 rows 3.93 against 3.83 ms and the Qwen3-30B-A3B MoE layer at 8
tokens (64 routed rows) 0.104 against 0.100 ms: at decode XLA's fusions take the rows with
their producers, the kernel is one more launch."""

# ---------------------------------------------------------------------------------------------
# Reference


def activated_reference(x: jax.Array, activation: Activation | None) -> jax.Array:
    """`activation(x)` ([rows, features]) or `activation(gate) * up` ([rows, 2, features]), in
    float32 (wider for float64) and rounded to `x.dtype`; None is the identity."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    act = _identity if activation is None else activation
    gated = x.ndim == 3
    y = act(x[:, 0].astype(acc)) * x[:, 1].astype(acc) if gated else act(x.astype(acc))
    return y.astype(x.dtype)


def _identity(x: jax.Array) -> jax.Array:
    return x


def quantize_rows_reference(
    x: jax.Array, *, activation: Activation | None = None, group: int = 128
) -> tuple[jax.Array, jax.Array]:
    """The specification of `quantize_rows`: `activated_reference`, then
    `quantize_token_groups_reference` of it.

    Returns:
      `(values, scales)`: float8_e4m3fn [rows, features] and float32 [rows, features / group].
    """
    return quantize_token_groups_reference(activated_reference(x, activation), group)


# ---------------------------------------------------------------------------------------------
# Kernel body


def _quantize_rows_kernel(*refs, activation: Activation | None, gated: bool, group: int):
    """One [block_rows, block_features] block, the reference's arithmetic in its order (a run in
    the interpreter equals it bit for bit)."""
    *inputs, values_ref, scales_ref = refs
    act = _identity if activation is None else activation
    y = act(inputs[0][...].astype(jnp.float32))
    if gated:
        y = y * inputs[1][...].astype(jnp.float32)
    rounded = y.astype(inputs[0].dtype).astype(jnp.float32)
    store_token_groups(rounded, group, values_ref, scales_ref)


# ---------------------------------------------------------------------------------------------
# Public wrapper


def quantize_rows_supported(
    *,
    platform: str,
    features: int,
    dtype: jnp.dtype,
    group: int = 128,
    impl: Impl | None = None,
) -> bool:
    """Whether a Pallas kernel takes this call; pure Python, no side effects.

    Args:
      platform: Where it would run, as `jax.default_backend()` names it.
      features: Features per row (of the activation's output).
      dtype: The input's dtype.
      group: Features per scale.
      impl: A backend to ask about; None asks about the platform's own kernel (Triton on GPU;
        none elsewhere).

    Returns:
      True when `quantize_rows(..., impl=impl)` would run a Pallas kernel (for `Impl.XLA`:
      always, given a shape the format takes).
    """
    check_impl(impl)
    if impl is None:
        if platform not in ("gpu", "cuda"):
            return False
        impl = Impl.PALLAS_TRITON
    if features < 1 or features % group:
        return False
    if impl is Impl.XLA:
        return True
    if np.dtype(dtype) not in SUPPORTED_DTYPES:
        return False
    match impl:
        case Impl.PALLAS_INTERPRET:
            return True
        case Impl.PALLAS_TRITON:
            # Triton blocks have power-of-two sides.
            return platform in ("gpu", "cuda") and group == pl.next_power_of_2(group)
        case _:
            return False


@functools.partial(jax.jit, static_argnames=("activation", "group", "impl"))
def quantize_rows(
    x: jax.Array,
    *,
    activation: Activation | None = None,
    group: int = 128,
    impl: Impl | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Applies an activation to rows and quantizes them per token group, in one pass.

    Args:
      x: [rows, features] float32, bfloat16 or float16 (any float for XLA), or [rows, 2,
        features]: a gate and an up projection stacked, quantized as `activation(gate) * up`.
      activation: An elementwise function (static: a module-level function), or None for the
        identity.
      group: Features per scale; must divide `features`.
      impl: The backend. None picks Triton on GPU for `KERNEL_MIN_ROWS` rows or more where
        `quantize_rows_supported` says it takes the shape, else the XLA reference.

    Returns:
      `(values, scales)` as `quantize_rows_reference` (the spec) gives them. Inside `shard_map`
      each varies over the mesh axes the reference's would.

    Raises:
      TypeError: A non-`Impl` impl.
      ValueError: A shape other than [rows, features] or [rows, 2, features], or features not a
        multiple of `group`.
      NotImplementedError: An explicit `impl` that cannot run this call on this platform.
    """
    check_impl(impl)
    if not (x.ndim == 2 or (x.ndim == 3 and x.shape[1] == 2)) or x.shape[-1] % group:
        raise ValueError(
            f"quantize_rows takes [rows, features] or [rows, 2, features] (gate and up) with "
            f"features a multiple of group={group}; got {x.shape=}"
        )
    platform = jax.default_backend()
    features = x.shape[-1]
    if impl is None:
        supported = quantize_rows_supported(
            platform=platform, features=features, dtype=x.dtype, group=group
        )
        fast = x.shape[0] >= KERNEL_MIN_ROWS
        impl = Impl.PALLAS_TRITON if supported and fast else Impl.XLA
    elif not quantize_rows_supported(
        platform=platform, features=features, dtype=x.dtype, group=group, impl=impl
    ):
        raise NotImplementedError(
            f"{impl} cannot run quantize_rows on {platform=} with {x.shape=}, {x.dtype=}, "
            f"{group=}; check quantize_rows_supported() first, or pass impl=None to fall back "
            "to XLA."
        )
    reference = functools.partial(quantize_rows_reference, activation=activation, group=group)
    if impl is Impl.XLA or x.shape[0] == 0:
        return reference(x)
    kernel = functools.partial(_pallas_call, activation=activation, group=group, impl=impl)
    if impl is Impl.PALLAS_INTERPRET:
        kernel = axes.interpreted(kernel, reference)
    return kernel(x)


def block_shape(rows: int, features: int, group: int) -> tuple[int, int]:
    """`(block_rows, block_features)`: the largest powers of two dividing the rows and the
    features, at most `MAX_BLOCK_ROWS` and `MAX_BLOCK_FEATURES` (at least one group)."""
    largest = lambda n, cap: min(n & -n, cap)  # noqa: E731 (the largest power of two dividing n)
    return largest(rows, MAX_BLOCK_ROWS), largest(features, max(MAX_BLOCK_FEATURES, group))


def _pallas_call(
    x: jax.Array, *, activation: Activation | None, group: int, impl: Impl
) -> tuple[jax.Array, jax.Array]:
    rows, features = x.shape[0], x.shape[-1]
    gated = x.ndim == 3
    block_rows, block_features = block_shape(rows, features, group)
    blocks = features // block_features
    if gated:  # [rows, 2 x features]: the gate's block j, the up's block j + blocks
        operands = (x.reshape(rows, 2 * features),) * 2
        in_specs = [
            pl.BlockSpec((block_rows, block_features), lambda i, j: (i, j)),
            pl.BlockSpec((block_rows, block_features), lambda i, j: (i, j + blocks)),
        ]
    else:
        operands = (x,)
        in_specs = [pl.BlockSpec((block_rows, block_features), lambda i, j: (i, j))]
    reference = functools.partial(quantize_rows_reference, activation=activation, group=group)
    varying = axes.reference_varying(reference, x)
    shapes = ((rows, features), (rows, features // group))
    out_shape = tuple(map(axes.output_type, shapes, (FP8_DTYPE, jnp.float32), varying))
    call = pl.pallas_call(
        functools.partial(_quantize_rows_kernel, activation=activation, gated=gated, group=group),
        out_shape=out_shape,
        grid=(rows // block_rows, blocks),
        in_specs=in_specs,
        out_specs=(
            pl.BlockSpec((block_rows, block_features), lambda i, j: (i, j)),
            pl.BlockSpec((block_rows, block_features // group), lambda i, j: (i, j)),
        ),
        compiler_params=pltriton.CompilerParams(num_warps=4)
        if impl is Impl.PALLAS_TRITON
        else None,
        interpret=impl is Impl.PALLAS_INTERPRET,
    )
    return tuple(call(*operands))
