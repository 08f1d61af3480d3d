"""Running an NNX module inside `jax.shard_map` under `jit`, on a mesh of boundary-jax axes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from .layout import Topology
from .residual import OwedOutput


def make_mesh(topology: Topology, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with boundary-jax's named axes for `topology`, over the first devices needed.

    Raises:
      ValueError: Fewer devices than the topology needs.
    """
    shape = topology.mesh_shape()
    needed = int(np.prod(list(shape.values())))
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < needed:
        raise ValueError(
            f"the mesh {shape} needs {needed} devices; only {len(devices)} are available"
        )
    return jax.make_mesh(tuple(shape.values()), tuple(shape), devices=devices[:needed])


def place(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """`tree` placed on `mesh`, each leaf sharded as the matching `PartitionSpec` of `specs`."""
    return jax.device_put(tree, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs))


class ShardedModule:
    """An NNX module whose parameters live split over a mesh, with sharded programs over it.

    Attributes:
      mesh: The mesh (its axes are `MeshAxis` names).
      state: The module's state, placed on `mesh` as each parameter's `out_sharding` says.
    """

    def __init__(self, module: nnx.Module, mesh: Mesh):
        self.mesh = mesh
        self._graphdef, state = nnx.split(module)
        self._state_specs = nnx.get_partition_spec(state)
        self.state = place(state, mesh, self._state_specs)

    def program(
        self,
        call: Callable[..., Any],
        *,
        in_specs: tuple[Any, ...],
        out_specs: Any,
        check_vma: bool = True,
        donate_argnums: tuple[int, ...] = (),
    ) -> Callable[..., Any]:
        """A jitted `shard_map` program: `program(state, *args)` runs `call(module, *args)` on
        every rank, the module holding that rank's parameter shards.

        Args:
          call: What each rank runs.
          in_specs: `PartitionSpec` trees of `args` (or prefixes of them).
          out_specs: `PartitionSpec` tree of the result.
          check_vma: `shard_map`'s varying-axes check (the Pallas kernels keep it: each declares
            how its outputs vary).
          donate_argnums: Indices into `args` whose buffers the program may reuse.
        """
        graphdef = self._graphdef

        def body(state, *args):
            result = call(nnx.merge(graphdef, state), *args)
            handles = jax.tree.leaves(result, is_leaf=lambda leaf: isinstance(leaf, OwedOutput))
            if any(isinstance(leaf, OwedOutput) for leaf in handles):
                raise TypeError(
                    "the program returned an OwedOutput: a layer output that still owes its "
                    "sums and residual update, which would be dropped. Leave the stack through "
                    "residual.final_norm(), take_output() or to_pp()"
                )
            return result

        return jax.jit(
            jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=(self._state_specs, *in_specs),
                out_specs=out_specs,
                check_vma=check_vma,
            ),
            donate_argnums=tuple(1 + i for i in donate_argnums),
        )
