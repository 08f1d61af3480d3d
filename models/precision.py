"""The precision a program's matmuls are traced with: float32 models get true float32.

JAX's default matmul precision is the platform's: full float32 on CPU, TF32 passes on Hopper
GPUs (about 1e-3 relative error). A runner or trainer takes one precision for all its programs
(the model's `BuildOptions.precision`) and traces them inside `matmul_precision_scope`, so the
choice is part of each compiled program and never a global flag.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
from jax import lax


@contextlib.contextmanager
def matmul_precision_scope(precision: lax.Precision) -> Iterator[None]:
    """Traces the matmuls inside at `precision` (`DEFAULT` leaves the platform's choice)."""
    if precision is lax.Precision.DEFAULT:
        yield
        return
    with jax.default_matmul_precision(precision.name.lower()):
        yield
