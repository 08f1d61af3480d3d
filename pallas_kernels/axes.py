"""Mesh axes of a kernel called inside `jax.shard_map`: those its collectives run over, and
those its outputs vary over.

Under `shard_map(..., check_vma=True)` every value carries the mesh axes it varies over, and
`shard_map` checks them against its `out_specs`. A Pallas kernel's outputs get no such type of
their own: `pl.pallas_call` takes it from `out_shape` (and refuses an `out_shape` without one),
and Mosaic GPU's `plgpu.kernel` (so also JAX's Hopper `ragged_dot`) returns outputs typed
invariant whatever they hold. So each kernel here declares its outputs' varying axes: the
wrappers read them from the kernel's reference (`reference_varying`), build `out_shape` with
them (`output_type`) and re-type Mosaic GPU outputs (`mark_varying`). The interpreters run
on operands typed invariant (`interpreted`, `index_operand`). Outside `shard_map`, or with the
check off, all of this is inert. The same public JAX API on 0.11.2 and 0.12.
"""

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

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


def index_operand(axis_name: AxisName, *, interpret: bool) -> jax.Array:
    """This device's linear index along `axis_name`, int32[1], for a kernel to read from SMEM.

    For kernels that address their peers: the TPU interpreter evaluates `lax.axis_index` in a
    kernel's body as a value varying over the axis, which fails the varying-axes check beside
    the body's constants (see `interpreted`); read from an operand typed invariant, the same
    index passes it. Compiled kernels get the index as it is.
    """
    index = lax.axis_index(axis_name).astype(jnp.int32).reshape(1)
    return invariant_copy(index) if interpret else index


def interpreted(kernel: Callable, reference: Callable) -> Callable:
    """`kernel` run by a Pallas interpreter: inside `shard_map`, on copies of its inputs typed
    invariant, with its outputs typed as `reference`'s.

    The interpreters (HLO, TPU, Mosaic GPU) evaluate a kernel's body when the program is
    lowered, on its operands' own types and with the varying-axes check on, where an operation
    mixing a varying block with a constant fails it; and JAX (from 0.12.1) has no public switch
    for the check inside a `shard_map` whose axes are all manual already. So the kernel gets
    its varying inputs as copies typed invariant (`invariant_copy`: each device's copy holds its
    own data), and its outputs, typed invariant in turn, are typed back as the reference's. For
    tests only: compiled kernels declare their types (`output_type`, `mark_varying`).

    Args:
      kernel: A function of arrays (pytrees; None allowed) running an interpreted kernel.
      reference: Its specification, a function of the same arguments.

    Returns:
      A function of the same arguments with `kernel`'s values and `reference`'s types.
    """

    def call(*args):
        if not jax.sharding.get_abstract_mesh().manual_axes:  # outside shard_map
            return kernel(*args)
        varying = reference_varying(reference, *args)
        outs = kernel(*jax.tree.map(invariant_copy, args))
        leaves, tree = jax.tree.flatten(outs)
        return jax.tree.unflatten(tree, list(map(mark_varying, leaves, varying)))

    return call


def invariant_copy(value: jax.Array) -> jax.Array:
    """`value` typed invariant, for an interpreted kernel's operands: each device's own data,
    copied through the host (a callback's results carry no varying axes). Not for compiled
    kernels: the copy leaves the device."""
    if not varying_axes(value):
        return value
    return jax.pure_callback(
        lambda data: data, jax.ShapeDtypeStruct(value.shape, value.dtype), value
    )
