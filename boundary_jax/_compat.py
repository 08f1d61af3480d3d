"""The one place that bridges differences between the JAX versions we support (0.11.2, 0.12.x)."""

import jax
from jax import lax


def varying_axes(value) -> tuple[str, ...]:
    """Mesh axes over which `value` (or a `ShapeDtypeStruct`) varies inside `shard_map`."""
    aval = value if isinstance(value, jax.ShapeDtypeStruct) else jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    axes = manual.varying if manual is not None else getattr(aval, "vma", frozenset())
    return tuple(sorted(axes))


def zeros_varying_like(result: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of `result`'s shape and dtype, varying over the same mesh axes."""
    value = jax.numpy.zeros(result.shape, result.dtype)
    axes = varying_axes(result)
    return lax.pcast(value, axes, to="varying") if axes else value
