"""Moving arrays between pipeline stages' device groups, and back to every process.

Each stage runs on its own mesh: the full mesh's devices at one `pp` index, with the same axis
names (`pp` of size one). A handoff is one program over the two stages' devices (a mesh whose
`pp` axis has size two): each attention-TP rank of the sender takes its slice of the rows, one
collective-permute over `pp` carries it to the same rank of the receiver, and the receiver
gathers the slices over attention TP. On GPUs that is a peer-to-peer copy; across processes it
runs on JAX's own collectives (NCCL, or gloo on the CPU), so nothing here assumes one process.

Every array moved is rows-leading: its leading axis is token rows (or cache slots) split over
attention DP, the rest replicated (`to_pp`'s tensors, sampled tokens). A process that holds none
of a program's devices skips it; the others call it in the same order.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import boundary_jax as bj


def stage_meshes(mesh: Mesh) -> tuple[Mesh, ...]:
    """One mesh per pipeline stage: the devices of `mesh` at each `pp` index, under the same
    axis names (their `pp` axis has size one).

    Raises:
      ValueError: `mesh` lacks the `pp` axis or does not hold it outermost.
    """
    names = tuple(mesh.axis_names)
    if not names or names[0] != bj.MeshAxis.PP.value:
        raise ValueError(
            f"a pipeline mesh holds the {bj.MeshAxis.PP.value!r} axis outermost; got axes {names}. "
            "Build it with boundary_jax.make_mesh"
        )
    return tuple(
        Mesh(mesh.devices[index : index + 1], names, axis_types=mesh.axis_types)
        for index in range(mesh.devices.shape[0])
    )


def holds(mesh: Mesh) -> bool:
    """This process holds at least one of `mesh`'s devices (and so runs its programs)."""
    process = jax.process_index()
    return any(device.process_index == process for device in mesh.devices.flat)


def over_gloo(mesh: Mesh) -> bool:
    """`mesh`'s collectives between processes run on gloo (CPU devices, several processes).

    XLA's gloo communicators tag every operation alike, and the CPU client starts a device's
    program as soon as its inputs are ready, not after the device's previous one: two programs
    on one device group (two microbatches of a stage, or a stage and a handoff) can then take
    each other's messages, and gloo aborts the process on the size mismatch. On such a mesh
    every program is waited for before the next is dispatched (`settle`), so each device runs
    its collectives one program at a time, in the order every process dispatches them.
    """
    return jax.process_count() > 1 and mesh.devices.flat[0].platform == "cpu"


def settle(tree: Any, mesh: Mesh) -> Any:
    """`tree`, waited for where `mesh`'s collectives run on gloo (`over_gloo`)."""
    return jax.block_until_ready(tree) if over_gloo(mesh) else tree


REPLICATED = PartitionSpec()
"""The spec of a value every device of a stage holds whole."""


def rows_spec(topology: bj.Topology) -> PartitionSpec:
    """The spec of a rows-leading array on a stage mesh of `topology`: rows over attention DP
    (over both its mesh axes where `moe_ep` splits it)."""
    return PartitionSpec(topology.spec_entry((bj.TokenAxis.ATTN_DP,)))


def place_rows(tree: Any, mesh: Mesh, spec: PartitionSpec) -> Any:
    """Host arrays placed on `mesh` by `spec` (`rows_spec`, or `REPLICATED`); their
    `jax.ShapeDtypeStruct`s on a process that holds none of its devices. Every process passes
    the same values; each builds only its own devices' shards."""
    sharding = NamedSharding(mesh, spec)
    if not holds(mesh):
        return jax.tree.map(lambda value: _shape_of(np.asarray(value), sharding), tree)

    def put(value):
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree.map(put, tree)


def _pp_first(spec: PartitionSpec) -> PartitionSpec:
    """`spec` with the `pp` axis prepended to its leading (rows) entry."""
    entry = spec[0] if len(spec) else None
    if entry is None:
        leading = bj.MeshAxis.PP.value
    else:
        leading = (bj.MeshAxis.PP.value, *((entry,) if isinstance(entry, str) else entry))
    return PartitionSpec(leading, *spec[1:])


class _GroupArrays:
    """Assembles arrays over a mesh of several stages from per-stage arrays, and back."""

    def __init__(self, meshes: tuple[Mesh, ...], spec: PartitionSpec):
        self.meshes = meshes
        names = meshes[0].axis_names
        self.mesh = Mesh(
            np.concatenate([mesh.devices for mesh in meshes]),
            names,
            axis_types=meshes[0].axis_types,
        )
        self.spec = spec
        self._zeros: dict[tuple, jax.Array] = {}

    def assemble(self, value: jax.Array | jax.ShapeDtypeStruct, stage: int) -> jax.Array:
        """The array over all the stages' devices whose block at `stage` is `value` (zeros on
        the other stages); `value` is a `jax.ShapeDtypeStruct` on a process that holds none of
        the stage's devices."""
        process = jax.process_index()
        shards = {}
        if isinstance(value, jax.Array):
            shards = {shard.device: shard.data for shard in value.addressable_shards}
        local = NamedSharding(self.meshes[stage], self.spec).shard_shape(value.shape)
        buffers = []
        for index, mesh in enumerate(self.meshes):
            for device in mesh.devices.flat:
                if device.process_index != process:
                    continue
                if index == stage:
                    buffers.append(shards[device])
                else:
                    buffers.append(self._zero(device, local, value.dtype))
        shape = (len(self.meshes) * value.shape[0], *value.shape[1:])
        sharding = NamedSharding(self.mesh, _pp_first(PartitionSpec(*self.spec)))
        return jax.make_array_from_single_device_arrays(shape, sharding, buffers)

    def take(self, value: jax.Array, stage: int) -> jax.Array | jax.ShapeDtypeStruct:
        """The block at `stage` of an array over all the stages' devices, on that stage's mesh
        (its `jax.ShapeDtypeStruct` on a process that holds none of the stage's devices)."""
        mesh = self.meshes[stage]
        shape = (value.shape[0] // len(self.meshes), *value.shape[1:])
        sharding = NamedSharding(mesh, self.spec)
        if not holds(mesh):
            return jax.ShapeDtypeStruct(shape, value.dtype, sharding=sharding)
        devices = set(mesh.devices.flat)
        buffers = [shard.data for shard in value.addressable_shards if shard.device in devices]
        return jax.make_array_from_single_device_arrays(shape, sharding, buffers)

    def _zero(self, device, shape, dtype) -> jax.Array:
        key = (device, tuple(shape), np.dtype(dtype))
        if key not in self._zeros:
            self._zeros[key] = jax.device_put(np.zeros(shape, dtype), device)
        return self._zeros[key]


class Transfer:
    """Hands rows-leading arrays from one stage's devices to another's.

    Attributes:
      source: The sending stage's mesh.
      target: The receiving stage's mesh.
      involved: This process holds devices of either stage (and must call the transfer).
    """

    def __init__(self, source: Mesh, target: Mesh, topology: bj.Topology):
        if source.axis_names != target.axis_names or source.devices.shape != target.devices.shape:
            raise ValueError(
                f"pipeline stages have meshes of one shape; got {dict(source.shape)} and "
                f"{dict(target.shape)}"
            )
        self.source, self.target = source, target
        self.involved = holds(source) or holds(target)
        self._group = _GroupArrays((source, target), rows_spec(topology))
        self._tp = topology.active((bj.TokenAxis.ATTN_TP,))
        self._tp_size = topology.attn_tp
        self._slice = bj.ops.take_block(self._tp, topology)
        self._gather = bj.ops.all_gather(self._tp, topology)
        self._program = jax.jit(
            jax.shard_map(
                self._move,
                mesh=self._group.mesh,
                in_specs=_pp_first(PartitionSpec(*self._group.spec)),
                out_specs=_pp_first(PartitionSpec(*self._group.spec)),
            )
        )

    def _move(self, tree):
        def move(x):
            # Each attention-TP rank sends 1/tp of the rows where they divide, as the original's
            # transport does; the receiver gathers them back.
            sliced = bool(self._tp) and x.shape[0] % self._tp_size == 0
            if sliced:
                x = bj.ops.run(self._slice, x)
            x = lax.ppermute(x, bj.MeshAxis.PP.value, [(0, 1)])
            return bj.ops.run(self._gather, x) if sliced else x

        return jax.tree.map(move, tree)

    def __call__(self, tree: Any) -> Any:
        """`tree` on the target mesh.

        Args:
          tree: Rows-leading arrays on the source mesh, or their `jax.ShapeDtypeStruct`s on a
            process that holds none of the source's devices.

        Returns:
          The arrays on the target mesh; their `jax.ShapeDtypeStruct`s on a process that holds
          none of the target's devices.
        """
        leaves, structure = jax.tree.flatten(tree)
        if not self.involved:
            sharding = NamedSharding(self.target, self._group.spec)
            return jax.tree.unflatten(structure, [_shape_of(leaf, sharding) for leaf in leaves])
        assembled = [self._group.assemble(leaf, 0) for leaf in leaves]
        moved = self._program(jax.tree.unflatten(structure, assembled))
        moved = jax.tree.leaves(settle(moved, self._group.mesh))
        return jax.tree.unflatten(structure, [self._group.take(leaf, 1) for leaf in moved])


class Collect:
    """Brings a rows-leading array from one stage's devices to every process, whole.

    One program over every stage's devices: the stage's block is summed over `pp` (the other
    stages contribute zeros, so the values are exact) and gathered over attention DP.
    """

    def __init__(self, meshes: tuple[Mesh, ...], topology: bj.Topology):
        self._group = _GroupArrays(meshes, rows_spec(topology))
        # Without attention DP the rows are whole on every device: nothing to gather.
        axes = (bj.TokenAxis.ATTN_DP,) if topology.attn_dp > 1 else ()
        gather = bj.ops.all_gather(axes, topology)
        self._program = jax.jit(
            jax.shard_map(
                lambda x: bj.ops.run(
                    gather,
                    lax.psum(x, bj.MeshAxis.PP.value),
                ),
                mesh=self._group.mesh,
                in_specs=_pp_first(PartitionSpec(*self._group.spec)),
                out_specs=PartitionSpec(),
            )
        )

    def __call__(self, value: jax.Array | jax.ShapeDtypeStruct, stage: int) -> np.ndarray:
        """The whole of `value`, held on stage `stage`'s devices (its `jax.ShapeDtypeStruct` on
        a process that holds none of them), as a numpy array on every process; read back
        directly where this one process holds every device."""
        if jax.process_count() == 1:
            return np.asarray(jax.device_get(value))
        gathered = self._program(self._group.assemble(value, stage))
        return np.asarray(gathered.addressable_data(0))


def _shape_of(value, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
