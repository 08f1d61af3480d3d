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


def checks_vma(axis_name: str) -> bool:
    """Whether the enclosing `shard_map` tracks varying mesh axes (`check_vma=True`).

    Pallas kernels cannot run there; a fusion candidate asks before it commits.
    """
    return bool(varying_axes(lax.axis_index(axis_name)))


def argsort(x: jax.Array) -> jax.Array:
    """A stable `jnp.argsort` of the 1-D `x` that varies over the same mesh axes as `x`.

    Inside `shard_map` with `check_vma=True`, JAX 0.12's `jnp.argsort` of a varying array
    types its result invariant (its index operand is an invariant iota). Indices typed
    invariant that differ per rank make gradients wrong: a gather by them transposes to a sum
    over ranks taken before each rank's own scatter. Sorting a varying iota keeps the type.
    """
    iota = jax.numpy.arange(x.shape[0], dtype=jax.numpy.int32)
    axes = varying_axes(x)
    if axes:
        iota = lax.pcast(iota, axes, to="varying")
    return lax.sort_key_val(x, iota, is_stable=True)[1]
