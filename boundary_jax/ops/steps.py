"""The token-row movements a bound plan composes: sums, scatters, gathers, slices, a finalize.

Each movement is a frozen step with two faces: `after(placement)` says, at bind time, what the
step does to a contribution's rows and owed sum (and rejects an invalid use), and `__call__`
runs it inside `jax.shard_map`. A bound path is a tuple of steps whose composition the binder
has checked, so every owed sum completes exactly once and lands on the rows the consumer reads.
A step moves rows over token axes and holds the `Topology` that names their mesh axes (a token
axis the expert-parallel size splits is two of them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
from jax import lax

from ..layout import Layout, TokenAxis, Topology, canonical
from ..placement import Placement


class PlanError(ValueError):
    """A step was composed where it cannot run (a binding bug or an unsupported transition)."""


def _require_finalized(placement: Placement, what: str) -> None:
    if placement.finalize:
        raise PlanError(
            f"{what} of a value {placement}: a sum or row move never runs on an unfinalized "
            "value; finalize it first"
        )


def _check_rows(x: jax.Array, parts: int, what: str) -> None:
    if x.shape[0] % parts:
        raise ValueError(
            f"{what} splits {x.shape[0]} rows into {parts} equal parts; pad each rank's rows to "
            f"a multiple of {parts} (got rows={x.shape[0]})"
        )


def _refine(layout: Layout, axes: tuple[TokenAxis, ...], what: str) -> Layout:
    if layout.sharded and axes and axes[0].order <= layout.sharded[-1].order:
        raise PlanError(f"{what} over {axes} cannot refine rows already split over {layout}")
    return Layout(layout.sharded + axes)


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """Completes the sum over `axes` in place (`lax.psum`)."""

    axes: tuple[TokenAxis, ...]
    topology: Topology = dataclasses.field(repr=False)

    def after(self, placement: Placement) -> Placement:
        _require_finalized(placement, f"all-reduce over {self.axes}")
        if not set(self.axes) <= set(placement.owed):
            raise PlanError(f"all-reduce over {self.axes} of a value {placement}")
        return Placement(placement.layout, canonical(set(placement.owed) - set(self.axes)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, self.topology.mesh_names(self.axes))


@dataclasses.dataclass(frozen=True)
class ReduceScatter:
    """Completes the sum over `axes` and keeps this rank's block of rows (`lax.psum_scatter`)."""

    axes: tuple[TokenAxis, ...]
    topology: Topology = dataclasses.field(repr=False)

    @property
    def parts(self) -> int:
        """The blocks the rows are split into: the ranks along `axes`."""
        return self.topology.size(self.axes)

    def after(self, placement: Placement) -> Placement:
        _require_finalized(placement, f"reduce-scatter over {self.axes}")
        if not set(self.axes) <= set(placement.owed):
            raise PlanError(f"reduce-scatter over {self.axes} of a value {placement}")
        layout = _refine(placement.layout, self.axes, "reduce-scatter")
        return Placement(layout, canonical(set(placement.owed) - set(self.axes)))

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_rows(x, self.parts, "a reduce-scatter")
        names = self.topology.mesh_names(self.axes)
        return lax.psum_scatter(x, names, scatter_dimension=0, tiled=True)


RowGather = Callable[[jax.Array, Topology], "jax.Array | None"]
"""A stage's own gather over attention TP (`declare_attn(attn_tp_gather=...)`): this rank's
[rows, ...] slice -> the attention's rows (the slices concatenated in attention-TP rank order), or
None, before any collective starts, to leave the gather to the built-in one. It may use only the
communication state of the rank it runs on."""


@dataclasses.dataclass(frozen=True)
class AllGather:
    """Concatenates the row blocks of `axes` (`lax.all_gather`); every member holds the result.

    Attributes:
      axes: The token axes whose blocks are concatenated.
      topology: Names their mesh axes.
      custom: A stage's own gather over attention TP (only for `axes == (ATTN_TP,)`), tried
        first on every batch; the built-in gather runs where it declines.
    """

    axes: tuple[TokenAxis, ...]
    topology: Topology = dataclasses.field(repr=False)
    custom: RowGather | None = None

    def __post_init__(self):
        if self.custom is not None and self.axes != (TokenAxis.ATTN_TP,):
            raise PlanError(f"a stage's own gather is over attention TP only; got {self.axes}")

    def after(self, placement: Placement) -> Placement:
        if not placement.complete:
            raise PlanError(f"all-gather of a value {placement}: complete the sum first")
        sharded = placement.layout.sharded
        if sharded[len(sharded) - len(self.axes) :] != self.axes:
            raise PlanError(f"all-gather over {self.axes} of rows {placement.layout}")
        return Placement(Layout(sharded[: len(sharded) - len(self.axes)]))

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.custom is not None:
            gathered = self.custom(x, self.topology)
            if gathered is not None:
                want = (x.shape[0] * self.topology.size(self.axes), *x.shape[1:])
                if gathered.shape != want or gathered.dtype != x.dtype:
                    raise ValueError(
                        f"a stage's own gather over attention TP must return {want} "
                        f"{x.dtype}; got {gathered.shape} {gathered.dtype}"
                    )
                return gathered
        names = self.topology.mesh_names(self.axes)
        return lax.all_gather(x, names, axis=0, tiled=True, to="invarying")


@dataclasses.dataclass(frozen=True)
class TakeBlock:
    """Keeps this rank's block of rows over `axes`: a local slice, no communication."""

    axes: tuple[TokenAxis, ...]
    topology: Topology = dataclasses.field(repr=False)

    @property
    def parts(self) -> int:
        """The blocks the rows are split into: the ranks along `axes`."""
        return self.topology.size(self.axes)

    def after(self, placement: Placement) -> Placement:
        _require_finalized(placement, f"block slice over {self.axes}")
        return Placement(_refine(placement.layout, self.axes, "block slice"), placement.owed)

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_rows(x, self.parts, "a block slice")
        rows = x.shape[0] // self.parts
        index = lax.axis_index(self.topology.mesh_names(self.axes))
        return lax.dynamic_slice_in_dim(x, index * rows, rows, axis=0)


@dataclasses.dataclass(frozen=True)
class Finalize:
    """Runs a `DeferredFinalize`'s combine on this rank's rows: local work, no communication."""

    def after(self, placement: Placement) -> Placement:
        if not placement.finalize:
            raise PlanError(f"finalize of a value {placement}: it owes no finalize")
        return Placement(placement.layout, placement.owed)

    def __call__(self, x) -> jax.Array:
        return x.complete()


Step = AllReduce | ReduceScatter | AllGather | TakeBlock | Finalize


def simulate(steps: Sequence[Step], placement: Placement) -> Placement:
    """The placement after `steps`; raises `PlanError` if any step cannot run there."""
    for step in steps:
        placement = step.after(placement)
    return placement


def run(steps: Sequence[Step], x: jax.Array) -> jax.Array:
    """Runs `steps` in order on `x` (inside `shard_map`)."""
    for step in steps:
        x = step(x)
    return x


def move_rows(steps: Sequence[Step], rows):
    """Runs row movements (gathers, block slices) on every leaf of a pytree of [rows, ...]
    arrays alike: a quantized input's values and scales move together."""
    return jax.tree.map(lambda leaf: run(steps, leaf), rows)


def all_reduce(axes: Sequence[TokenAxis], topology: Topology) -> tuple[Step, ...]:
    """An all-reduce over `axes`, or nothing when `axes` is empty."""
    return (AllReduce(tuple(axes), topology),) if axes else ()


def reduce_scatter(axes: Sequence[TokenAxis], topology: Topology) -> tuple[Step, ...]:
    return (ReduceScatter(tuple(axes), topology),) if axes else ()


def all_gather(axes: Sequence[TokenAxis], topology: Topology) -> tuple[Step, ...]:
    return (AllGather(tuple(axes), topology),) if axes else ()


def with_gather(steps: Sequence[Step], gather: RowGather | None) -> tuple[Step, ...]:
    """`steps` with `gather` tried first in each all-gather over attention TP alone."""
    if gather is None:
        return tuple(steps)
    return tuple(
        dataclasses.replace(step, custom=gather)
        if isinstance(step, AllGather) and step.axes == (TokenAxis.ATTN_TP,)
        else step
        for step in steps
    )


def take_block(axes: Sequence[TokenAxis], topology: Topology) -> tuple[Step, ...]:
    return (TakeBlock(tuple(axes), topology),) if axes else ()


def relayout(source: Layout, target: Layout, topology: Topology) -> tuple[Step, ...]:
    """Moves a complete value from `source` rows to `target` rows: gathers, then local slices."""
    common = 0
    while (
        common < min(len(source.sharded), len(target.sharded))
        and source.sharded[common] == target.sharded[common]
    ):
        common += 1
    gather = all_gather(source.sharded[common:], topology)
    return gather + take_block(target.sharded[common:], topology)


def complete_onto(placement: Placement, target: Layout, topology: Topology) -> tuple[Step, ...]:
    """Completes every owed item, then moves the value onto `target` rows (the unfused fallback).

    A finalize runs first; where the target refines the rows over owed axes, a reduce-scatter
    then completes the sum and moves the rows at once.
    """
    if placement.finalize:
        return (Finalize(),) + complete_onto(
            Placement(placement.layout, placement.owed), target, topology
        )
    extra = tuple(a for a in target.sharded if a not in placement.layout)
    if placement.layout.sharded == target.sharded[: len(placement.layout.sharded)]:
        scatter = tuple(a for a in extra if a in placement.owed)
        if scatter == extra and scatter:
            rest = canonical(set(placement.owed) - set(scatter))
            return reduce_scatter(scatter, topology) + all_reduce(rest, topology)
    return all_reduce(placement.owed, topology) + relayout(placement.layout, target, topology)
