"""The precision a program's matmuls are traced with: float32 models get true float32.

JAX's default matmul precision is the platform's: full float32 on CPU, TF32 passes on Hopper
GPUs (about 1e-3 relative error). A runner or trainer picks one precision for all its programs
and traces them inside `matmul_precision_scope`, so the choice is part of each compiled program
and never a global flag.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax


def resolve_matmul_precision(precision: lax.Precision | None, dtype: jnp.dtype) -> lax.Precision:
    """`precision`, or for None the default of a model of `dtype`: `HIGHEST` for float32 (what
    the user asked for), `DEFAULT` (the platform's fastest) for other dtypes."""
    if precision is not None:
        return precision
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


@contextlib.contextmanager
def matmul_precision_scope(precision: lax.Precision) -> Iterator[None]:
    """Traces the matmuls inside at `precision` (`DEFAULT` leaves the platform's choice)."""
    if precision is lax.Precision.DEFAULT:
        yield
        return
    with jax.default_matmul_precision(precision.name.lower()):
        yield
