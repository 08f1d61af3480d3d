"""Running an NNX module inside `jax.shard_map` under `jit`, on a mesh of boundary-jax axes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from .layout import Topology
from .residual_stream import OwedOutput


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

    A program is a pure function of the module's state and its inputs: it takes the state as an
    argument, never captures it, so one compiled program runs any state of this structure
    (trained parameters, a scaled copy), gradients come back in the same form, buffers may be
    donated, and `jit` bakes no array into the program as a constant. One way per purpose:

    - run: `forward = program(call, in_specs=..., out_specs=...)`, then `forward(leaves, *args)`;
    - compile or inspect: `forward.lower(leaves, *args)`;
    - differentiate, or jit together with other work: `sharded(call, ...)`, the same program
      before `jit`; `state_of(grads)` maps its gradients back to an `nnx.State`;
    - read the state: `leaves` (what programs take), or its views `state` and `module`.

    Programs take the state as `leaves`, a flat tuple of arrays, not as an `nnx.State`: `jit`
    flattens a tuple in C++ but an `nnx.State` in Python at every call (0.6 ms more for a
    27-layer model's 350 arrays on a 2-core CPU machine), host time that a prefill or a decode
    call would pay before its kernels launch.

    Attributes:
      mesh: The mesh (its axes are `MeshAxis` names).
      leaves: The module's state as a tuple of global arrays (`jax.tree.leaves` order of its
        `nnx.State`), placed on `mesh` as each parameter's `out_sharding` says; unplaced
        `jax.ShapeDtypeStruct`s of those shardings where the module is not `held`.
      leaf_specs: The `PartitionSpec` of each of `leaves`.
    """

    def __init__(self, module: nnx.Module, mesh: Mesh, *, held: bool = True):
        """`held=False` on a process that holds none of `mesh`'s devices (a pipeline stage on
        another process): its programs can then only be traced, for their shapes."""
        self.mesh = mesh
        self._graphdef, state = nnx.split(module)
        specs = nnx.get_partition_spec(state)
        if held:
            state = place(state, mesh, specs)
        else:
            shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
            state = jax.tree.map(
                lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                state,
                shardings,
            )
        leaves, self._treedef = jax.tree.flatten(state)
        self.leaves = tuple(leaves)
        self.leaf_specs = tuple(self._treedef.flatten_up_to(specs))

    @property
    def state(self) -> nnx.State:
        """The placed state as an `nnx.State` (the same arrays as `leaves`)."""
        return self.state_of(self.leaves)

    def state_of(self, leaves: Sequence[Any]) -> nnx.State:
        """`leaves` of this module's structure (a program's argument, or its gradient) as an
        `nnx.State`."""
        return jax.tree.unflatten(self._treedef, leaves)

    @property
    def module(self) -> nnx.Module:
        """The module over the placed state; no copy is made."""
        return nnx.merge(self._graphdef, self.state)

    def program(
        self,
        call: Callable[..., Any],
        *,
        in_specs: tuple[Any, ...],
        out_specs: Any,
        check_vma: bool = True,
        donate_argnums: tuple[int, ...] = (),
        compiler_options: dict[str, Any] | None = None,
    ) -> Callable[..., Any]:
        """A jitted `shard_map` program: `program(leaves, *args)` (`leaves` this module's or a
        tuple of the same structure) runs `call(module, *args)` on every rank, the module
        holding that rank's parameter shards. `program.lower(leaves, *args)` lowers it as
        `jax.jit` does; `program.compiled_shapes()` counts the input shapes compiled so far.

        Args:
          call: What each rank runs.
          in_specs: `PartitionSpec` trees of `args` (or prefixes of them).
          out_specs: `PartitionSpec` tree of the result.
          check_vma: `shard_map`'s varying-axes check (the Pallas kernels keep it: each declares
            how its outputs vary).
          donate_argnums: Indices into `args` whose buffers the program may reuse.
          compiler_options: XLA options for compiling this program alone (`jax.jit`'s).
        """
        sharded = self.sharded(call, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
        donated = tuple(1 + i for i in donate_argnums)
        return _Program(jax.jit(sharded, donate_argnums=donated, compiler_options=compiler_options))

    def sharded(
        self,
        call: Callable[..., Any],
        *,
        in_specs: tuple[Any, ...],
        out_specs: Any,
        check_vma: bool = True,
    ) -> Callable[..., Any]:
        """`program`'s `shard_map` before `jit`, `f(leaves, *args)`: for a caller that
        differentiates it or jits it with others (the pipeline's training steps)."""
        graphdef, treedef = self._graphdef, self._treedef

        def body(leaves, *args):
            result = call(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), *args)
            handles = jax.tree.leaves(result, is_leaf=lambda leaf: isinstance(leaf, OwedOutput))
            if any(isinstance(leaf, OwedOutput) for leaf in handles):
                raise TypeError(
                    "the program returned an OwedOutput: a layer output that still owes its "
                    "sums and residual update, which would be dropped. Leave the stack through "
                    "residual_stream.final_norm(), take_output() or to_pp()"
                )
            return result

        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(self.leaf_specs, *in_specs),
            out_specs=out_specs,
            check_vma=check_vma,
        )


class _Program:
    """A `ShardedModule` program: the jitted function, which rejects a state given in any form
    but the flat tuple of `ShardedModule.leaves`."""

    def __init__(self, jitted: Callable[..., Any]):
        self._jitted = jitted

    def __call__(self, leaves: tuple, *args: Any) -> Any:
        return self._jitted(_checked(leaves), *args)

    def lower(self, leaves: tuple, *args: Any):
        """The lowered program for these arguments (`jax.jit(...).lower`)."""
        return self._jitted.lower(_checked(leaves), *args)

    def compiled_shapes(self) -> int:
        """How many input shapes the program has compiled for so far."""
        return self._jitted._cache_size()


def _checked(leaves: Any) -> Any:
    if not isinstance(leaves, (tuple, list)):
        raise TypeError(
            "a ShardedModule program takes the module's state as ShardedModule.leaves (a tuple "
            f"of arrays), not a {type(leaves).__name__}"
        )
    return leaves
