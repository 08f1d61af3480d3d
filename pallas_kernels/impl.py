"""Backends a fused kernel can run on, and the dtypes and platforms they know."""

import enum

import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(jnp.float32),
    np.dtype(jnp.bfloat16),
    np.dtype(jnp.float16),
)


class Impl(enum.Enum):
    """How a fused kernel is executed.

    Attributes:
      XLA: The plain `jnp` reference, left to XLA's fusion (runs anywhere).
      PALLAS_GPU: Mosaic GPU through `plgpu.kernel` (NVIDIA Hopper and newer).
      PALLAS_TRITON: The deprecated Pallas Triton lowering; a fallback while JAX still ships it.
      PALLAS_TPU: Mosaic TPU through `pl.pallas_call`.
      PALLAS_INTERPRET: The TPU/Triton kernel body run by the Pallas interpreter on any platform
        (distributed kernels use the TPU interpreter, which simulates remote DMAs).
      PALLAS_GPU_INTERPRET: The Mosaic GPU kernel body run by the Mosaic GPU interpreter on CPU
        (JAX >= 0.12; remote memory is not simulated).
    """

    XLA = enum.auto()
    PALLAS_GPU = enum.auto()
    PALLAS_TRITON = enum.auto()
    PALLAS_TPU = enum.auto()
    PALLAS_INTERPRET = enum.auto()
    PALLAS_GPU_INTERPRET = enum.auto()


INTERPRETERS = frozenset({Impl.PALLAS_INTERPRET, Impl.PALLAS_GPU_INTERPRET})
"""The backends that run a kernel in a Pallas interpreter (tests, any platform)."""


def platform_kernel(platform: str) -> Impl:
    """Returns the Pallas backend native to `platform`, or `Impl.XLA` where there is none.

    Args:
      platform: A JAX platform name, as `jax.default_backend()` returns it.
    """
    match platform:
        case "gpu" | "cuda":
            return Impl.PALLAS_GPU
        case "tpu":
            return Impl.PALLAS_TPU
        case _:
            return Impl.XLA


def check_impl(impl: object) -> None:
    """Raises TypeError unless `impl` is an `Impl` or None."""
    if impl is not None and not isinstance(impl, Impl):
        raise TypeError(f"impl must be an Impl member or None; got {impl=!r}")
