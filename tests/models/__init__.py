"""Tests of the model building blocks; helpers to run a module inside `jax.shard_map`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj
from boundary_jax.bind import counted_once
from models.layers.attention.self_attention import WholeProjectionNorm
from tests.meshes import make_mesh  # noqa: F401 (the tests import it from here)

MESHES = ((1, 1), (1, 2), (1, 4), (2, 2), (1, 8))
"""(attn_dp, attn_tp) meshes every sharded layer test runs on."""


@dataclasses.dataclass(frozen=True)
class MoeLayout:
    """A parallel layout of an MoE decoder: attention DP x TP, expert parallelism and dispatch,
    input-scattered batches, a deferred finalize, a fully data-parallel dense FFN."""

    dp: int
    tp: int
    ep: int = 1
    dispatch: bj.MoeDispatch = bj.MoeDispatch.GATHER
    scattered: bool = False
    defer: bool = False
    dense_ffn_dp: bool = False

    def __str__(self) -> str:
        parts = [f"DP{self.dp}xTP{self.tp}", f"EP{self.ep}", self.dispatch.value]
        parts += ["scattered"] * self.scattered + ["deferred"] * self.defer
        return "-".join(parts + ["dense-DP"] * self.dense_ffn_dp)

    def mesh(self) -> jax.sharding.Mesh:
        return bj.make_mesh(bj.Topology(attn_dp=self.dp, attn_tp=self.tp))


def row_spec(topology: bj.Topology, *trailing) -> PartitionSpec:
    """Rows split over attention DP (each DP rank's own tokens), alike over attention TP."""
    return topology.row_spec(topology.layout(bj.TokenAxis.ATTN_DP), *trailing)


def sum_over(x: jax.Array, topology: bj.Topology, group: bj.SumGroup) -> jax.Array:
    """The test-side completion of a partial sum over `group` (models never sum)."""
    names = topology.group_names(group)
    return lax.psum(x, names) if names else x


def run_sharded(
    module: nnx.Module,
    mesh: jax.sharding.Mesh,
    body: Callable[..., Any],
    args: tuple,
    in_specs: tuple,
    out_specs: Any,
    *,
    check_vma: bool = True,
) -> Any:
    """Runs `body(module, *args)` inside a jitted `shard_map` over `mesh`.

    The module's state goes in with its parameters' own partition specs (nnx.split ->
    shard_map -> nnx.merge); `args` are placed on the mesh with `in_specs`.
    """
    graphdef, state = nnx.split(module)
    state_specs = nnx.get_partition_spec(state)

    def inner(state, *args):
        return body(nnx.merge(graphdef, state), *args)

    fn = jax.jit(
        jax.shard_map(
            inner,
            mesh=mesh,
            in_specs=(state_specs, *in_specs),
            out_specs=out_specs,
            check_vma=check_vma,
        )
    )
    place = lambda tree, specs: jax.device_put(  # noqa: E731
        tree, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    )
    return fn(
        place(state, state_specs), *(place(a, s) for a, s in zip(args, in_specs, strict=True))
    )


def unsharded_copy(module: nnx.Module, factory: Callable[[bj.Topology], nnx.Module]) -> nnx.Module:
    """`factory(Topology())` (one device) holding `module`'s global parameter values."""
    reference = factory(bj.Topology())
    nnx.update(reference, nnx.state(module, nnx.Param))
    return reference


def randomize_norms(module: nnx.Module, seed: int) -> None:
    """Gives every RMSNorm weight (whole-projection q/k norms too) random values around 1, so a
    skipped norm, or a rank holding another rank's slice, is visible."""
    rng = np.random.default_rng(seed)
    for _, node in nnx.iter_graph(module):
        if isinstance(node, bj.RMSNorm | WholeProjectionNorm):
            shape = node.weight.shape
            node.weight[...] = (1 + 0.2 * rng.standard_normal(shape)).astype(node.weight.dtype)


def stage_counts(module: nnx.Module) -> Callable[[str], bool | jax.Array]:
    """What a sparse FFN's stage boundary answers for its replicated parts
    (`StageBoundary.counts`), for a MoE run on its own inside `shard_map`: the ranks binding
    gives its stage's declaration (`boundary_jax.bind.counted_once`)."""
    declaration = bj.declare_ffn(
        sparse=True, moe_dispatch=module.dispatch, replicated=module.replicated
    )
    ranks = {part.name: part.ranks for part in counted_once(declaration, module.topology)}
    return lambda name: bj.ops.is_first_rank(ranks[name])
