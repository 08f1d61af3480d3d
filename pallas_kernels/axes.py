"""Mesh axes of a kernel called inside `jax.shard_map`: those its collectives run over, and
those its outputs vary over.

Under `shard_map(..., check_vma=True)` every value carries the mesh axes it varies over, and
`shard_map` checks them against its `out_specs`. A Pallas kernel's outputs get no such type of
their own: `pl.pallas_call` takes it from `out_shape` (and refuses an `out_shape` without one),
and Mosaic GPU's `plgpu.kernel` (so also JAX's Hopper `ragged_dot`) returns outputs typed
invariant whatever they hold. So each kernel here declares its outputs' varying axes: the
wrappers read them from the kernel's reference (`reference_varying`), build `out_shape` with
them (`output_type`) and re-type Mosaic GPU outputs (`mark_varying`). The interpreters run
with the check off around them (`interpreted`). Outside `shard_map`, or with the check off,
all of this is inert. The same public JAX API on 0.11.2 and 0.12.
"""

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

AxisName = str | tuple[str, ...]
"""A mesh axis, or a tuple of mesh axes, as `lax.psum` takes it."""


def device_id(axis_name: AxisName, index: jax.Array) -> dict:
    """The mesh device at linear `index` along `axis_name`; other mesh axes stay this device's."""
    if isinstance(axis_name, tuple) and len(axis_name) == 1:
        axis_name = axis_name[0]
    return {axis_name: index}


def varying_axes(*values: jax.Array | None) -> frozenset[str]:
    """The mesh axes any of `values` varies over inside `shard_map` (empty outside it, with
    `check_vma=False`, and for None)."""
    axes = frozenset()
    for value in values:
        if value is not None:
            axes |= jax.typeof(value).mat.varying
    return axes


def reference_varying(reference: Callable, *args, **kwargs) -> tuple[frozenset[str], ...]:
    """The varying axes of each output of `reference(*args, **kwargs)`, in flattened order:
    what the kernel that implements it must declare. Traces the reference; runs nothing."""
    outs = jax.eval_shape(functools.partial(reference, **kwargs), *args)
    return tuple(
        frozenset() if out.manual_axis_type is None else out.manual_axis_type.varying
        for out in jax.tree.leaves(outs)
    )


def output_type(shape: Sequence[int], dtype, varying: frozenset[str]) -> jax.ShapeDtypeStruct:
    """A kernel output's `out_shape`: `shape` and `dtype`, varying over `varying`."""
    axis_type = jax.sharding.ManualAxisType(varying=frozenset(varying))
    return jax.ShapeDtypeStruct(tuple(shape), dtype, manual_axis_type=axis_type)


def mark_varying(value: jax.Array, varying: frozenset[str]) -> jax.Array:
    """`value` typed to vary over `varying` (a superset of its own axes); no data moves.

    For the outputs of Mosaic GPU kernels, which come back typed invariant.
    """
    missing = tuple(sorted(frozenset(varying) - varying_axes(value)))
    return lax.pcast(value, missing, to="varying") if missing else value


def interpreted(kernel: Callable, reference: Callable) -> Callable:
    """`kernel` run by a Pallas interpreter: inside `shard_map`, with the varying-axes check off
    around it and its outputs typed as `reference`'s.

    The interpreters (HLO, TPU, Mosaic GPU) evaluate a kernel's body on its inputs' own types,
    where an operation mixing a varying block with a constant fails the check. So the kernel
    runs inside an inner `shard_map` over the already-manual axes (it makes no axis manual)
    with `check_vma=False`, its inputs copied there (a copy made with the check off is typed
    invariant); its outputs come out typed invariant and are typed back as the reference's.
    For tests only: compiled kernels declare their types (`output_type`, `mark_varying`).

    Args:
      kernel: A function of arrays (pytrees; None allowed) running an interpreted kernel.
      reference: Its specification, a function of the same arguments.

    Returns:
      A function of the same arguments with `kernel`'s values and `reference`'s types.
    """

    def call(*args):
        manual = frozenset(jax.sharding.get_abstract_mesh().manual_axes)
        if not manual:  # outside shard_map
            return kernel(*args)
        varying = reference_varying(reference, *args)

        def unchecked(*args):
            return kernel(*jax.tree.map(lambda a: a + jnp.zeros((), a.dtype), args))

        outs = jax.shard_map(
            unchecked, in_specs=P(), out_specs=P(), axis_names=manual, check_vma=False
        )(*args)
        leaves, tree = jax.tree.flatten(outs)
        return jax.tree.unflatten(tree, list(map(mark_varying, leaves, varying)))

    return call
