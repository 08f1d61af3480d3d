"""Collectives and token-row movements: the only module that issues a collective.

Each movement is a frozen step with two faces: `after(placement)` says, at bind time, what the
step does to a contribution's rows and owed sum (and rejects an invalid use), and `__call__`
runs it inside `jax.shard_map`. A bound path is a tuple of steps whose composition the binder
has checked, so every owed sum completes exactly once and lands on the rows the consumer reads.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from .contracts import Placement
from .layout import Layout, SumGroup, TokenAxis, Topology, canonical


class PlanError(ValueError):
    """A step was composed where it cannot run (a binding bug or an unsupported transition)."""


def _require_finalized(placement: Placement, what: str) -> None:
    if placement.finalize:
        raise PlanError(
            f"{what} of a value {placement}: a sum or row move never runs on an unfinalized "
            "value; finalize it first"
        )


def _names(axes: Sequence[TokenAxis]) -> tuple[str, ...]:
    return tuple(axis.mesh_name for axis in axes)


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

    def after(self, placement: Placement) -> Placement:
        _require_finalized(placement, f"all-reduce over {self.axes}")
        if not set(self.axes) <= set(placement.owed):
            raise PlanError(f"all-reduce over {self.axes} of a value {placement}")
        return Placement(placement.layout, canonical(set(placement.owed) - set(self.axes)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return lax.psum(x, _names(self.axes))


@dataclasses.dataclass(frozen=True)
class ReduceScatter:
    """Completes the sum over `axes` and keeps this rank's block of rows (`lax.psum_scatter`)."""

    axes: tuple[TokenAxis, ...]
    parts: int

    def after(self, placement: Placement) -> Placement:
        _require_finalized(placement, f"reduce-scatter over {self.axes}")
        if not set(self.axes) <= set(placement.owed):
            raise PlanError(f"reduce-scatter over {self.axes} of a value {placement}")
        layout = _refine(placement.layout, self.axes, "reduce-scatter")
        return Placement(layout, canonical(set(placement.owed) - set(self.axes)))

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_rows(x, self.parts, "a reduce-scatter")
        return lax.psum_scatter(x, _names(self.axes), scatter_dimension=0, tiled=True)


@dataclasses.dataclass(frozen=True)
class AllGather:
    """Concatenates the row blocks of `axes` (`lax.all_gather`); every member holds the result."""

    axes: tuple[TokenAxis, ...]

    def after(self, placement: Placement) -> Placement:
        if not placement.complete:
            raise PlanError(f"all-gather of a value {placement}: complete the sum first")
        sharded = placement.layout.sharded
        if sharded[len(sharded) - len(self.axes) :] != self.axes:
            raise PlanError(f"all-gather over {self.axes} of rows {placement.layout}")
        return Placement(Layout(sharded[: len(sharded) - len(self.axes)]))

    def __call__(self, x: jax.Array) -> jax.Array:
        return lax.all_gather(x, _names(self.axes), axis=0, tiled=True, to="invarying")


@dataclasses.dataclass(frozen=True)
class TakeBlock:
    """Keeps this rank's block of rows over `axes`: a local slice, no communication."""

    axes: tuple[TokenAxis, ...]
    parts: int

    def after(self, placement: Placement) -> Placement:
        _require_finalized(placement, f"block slice over {self.axes}")
        return Placement(_refine(placement.layout, self.axes, "block slice"), placement.owed)

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_rows(x, self.parts, "a block slice")
        rows = x.shape[0] // self.parts
        index = lax.axis_index(_names(self.axes))
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


def all_reduce(axes: Sequence[TokenAxis]) -> tuple[Step, ...]:
    """An all-reduce over `axes`, or nothing when `axes` is empty."""
    return (AllReduce(tuple(axes)),) if axes else ()


def reduce_scatter(axes: Sequence[TokenAxis], topology: Topology) -> tuple[Step, ...]:
    return (ReduceScatter(tuple(axes), topology.size(axes)),) if axes else ()


def all_gather(axes: Sequence[TokenAxis]) -> tuple[Step, ...]:
    return (AllGather(tuple(axes)),) if axes else ()


def take_block(axes: Sequence[TokenAxis], topology: Topology) -> tuple[Step, ...]:
    return (TakeBlock(tuple(axes), topology.size(axes)),) if axes else ()


def relayout(source: Layout, target: Layout, topology: Topology) -> tuple[Step, ...]:
    """Moves a complete value from `source` rows to `target` rows: gathers, then local slices."""
    common = 0
    while (
        common < min(len(source.sharded), len(target.sharded))
        and source.sharded[common] == target.sharded[common]
    ):
        common += 1
    return all_gather(source.sharded[common:]) + take_block(target.sharded[common:], topology)


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
            return reduce_scatter(scatter, topology) + all_reduce(rest)
    return all_reduce(placement.owed) + relayout(placement.layout, target, topology)


@dataclasses.dataclass(frozen=True)
class OwedWork:
    """What a handed-on contribution still owes, with the unfused steps that complete it.

    Bound with the exit that hands it on, so a residual helper runs only decided steps.

    Attributes:
      placement: The value's rows and owed work (finalize, then sums).
      in_place: Completes every owed item on the value's own rows (`complete_output`).
      onto_residual: Completes it and moves it onto the residual's rows (`fold`, `snapshot`,
        `add_to_output`).
      then: The record after `in_place` ran; None when nothing is owed.
    """

    placement: Placement
    in_place: tuple[Step, ...]
    onto_residual: tuple[Step, ...]
    then: OwedWork | None


def owed_work(placement: Placement, residual: Layout, topology: Topology) -> OwedWork:
    """The owed-work record of a value on `placement` whose residual is on `residual` rows."""
    in_place = ((Finalize(),) if placement.finalize else ()) + all_reduce(placement.owed)
    then = None if placement.complete else owed_work(placement.completed(), residual, topology)
    return OwedWork(placement, in_place, complete_onto(placement, residual, topology), then)


def local_block_index(axes: Sequence[TokenAxis]) -> jax.Array:
    """This rank's linear index along `axes` (0 when `axes` is empty)."""
    return lax.axis_index(_names(tuple(axes))) if axes else 0


def shard_index(topology: Topology, group: SumGroup) -> jax.Array | int:
    """This rank's index among the ranks of `group` (0 when the group has one rank).

    For models that split a weight over `group` (`Topology.shard_entry(group)`) and need to
    know which slice they hold, e.g. a vocab-parallel embedding's row offset.
    """
    return local_block_index(topology.sum_axes(group))


def gather_last_dim(x: jax.Array, topology: Topology, group: SumGroup) -> jax.Array:
    """Concatenates the last dimension of `x` over the ranks of `group`, in rank order.

    For outputs split column-wise over `group`, e.g. vocab-parallel logits.
    """
    axes = topology.sum_axes(group)
    if not axes:
        return x
    return lax.all_gather(x, _names(axes), axis=x.ndim - 1, tiled=True, to="invarying")


def sharded_rms_norm(
    x: jax.Array, weight: jax.Array, topology: Topology, group: SumGroup, *, eps: float
) -> jax.Array:
    """RMSNorm over a last dimension split column-wise over the ranks of `group`.

    Each rank holds its columns of `x` [rows, width / ranks] and its slice of `weight`; the mean
    of squares is summed over the group (one small all-reduce of [rows, 1]), in FP32 or wider.
    For a norm over a whole projection whose heads are split over attention TP (OLMo 2's q/k
    norm). Call inside `shard_map`.
    """
    return sharded_rms_norms((x,), (weight,), topology, group, eps=eps)[0]


def sharded_rms_norms(
    xs: tuple[jax.Array, ...],
    weights: tuple[jax.Array, ...],
    topology: Topology,
    group: SumGroup,
    *,
    eps: float,
) -> tuple[jax.Array, ...]:
    """`sharded_rms_norm` of several inputs over the same rows, their sums in one all-reduce.

    Each `xs[i]` [rows, width_i / ranks] is normalized over its whole width with `weights[i]`
    (this rank's slice); the [rows, len(xs)] sums of squares cross the group together (OLMo 2's
    q and k norms: one small all-reduce per layer, not two). A rank may hold the same columns as
    other ranks (a kv head shared by `r` ranks): its squares then count `r` times, and so does
    its width, so the mean is still that of the whole projection. Call inside `shard_map`.

    Raises:
      ValueError: The inputs and weights differ in number, or the inputs in their rows.
    """
    if len(xs) != len(weights) or not xs or len({x.shape[:-1] for x in xs}) != 1:
        raise ValueError(
            "sharded_rms_norms takes as many weights as inputs, the inputs over the same rows; "
            f"got inputs {[x.shape for x in xs]} and weights {[w.shape for w in weights]}"
        )
    axes = topology.sum_axes(group)
    acc = functools.reduce(jnp.promote_types, [x.dtype for x in xs], jnp.dtype(jnp.float32))
    wide = [x.astype(acc) for x in xs]
    squares = jnp.concatenate([jnp.sum(w * w, axis=-1, keepdims=True) for w in wide], axis=-1)
    if axes:
        squares = lax.psum(squares, _names(axes))
    ranks = topology.size(axes)
    out = []
    for index, (x, value, weight) in enumerate(zip(xs, wide, weights, strict=True)):
        mean = squares[..., index : index + 1] / (x.shape[-1] * ranks)
        scale = weight.astype(acc).reshape((1,) * (x.ndim - 1) + weight.shape)
        out.append((value * lax.rsqrt(mean + eps) * scale).astype(x.dtype))
    return tuple(out)


def vocab_parallel_cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    topology: Topology,
    group: SumGroup,
    *,
    vocab_size: int,
) -> jax.Array:
    """Per-row cross-entropy of logits whose vocabulary columns are split over `group`, without
    gathering them: a max and a sum of exponentials per row over the local columns, completed
    over the group (two [rows] collectives and one for the label's logit).

    Args:
      logits: [rows, columns] this rank's block of vocabulary columns (rank r of `group` holds
        ids r * columns ... (r + 1) * columns - 1); columns at ids >= `vocab_size` are padding
        and never count.
      labels: [rows] int target ids; rows with a label outside [0, vocab_size) (e.g. -1) are
        masked: their loss is zero and they give no gradient.
      topology: The parallel topology the columns are split for.
      group: The group the columns are split over (a vocab-parallel LM head: attention TP).
      vocab_size: Number of real ids.

    Returns:
      float32 [rows] `logsumexp(logits) - logits[label]` per row, alike on every rank of
      `group`; zero on masked rows.
    """
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            "vocab_parallel_cross_entropy takes logits [rows, columns] and labels [rows]; got "
            f"{logits.shape=}, {labels.shape=}"
        )
    axes = _names(topology.sum_axes(group))
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    columns = logits.shape[1]
    ids = shard_index(topology, group) * columns + jnp.arange(columns)
    real = ids < vocab_size
    # The max only keeps exp() in range: it cancels in the loss, so it carries no gradient.
    peak = lax.stop_gradient(jnp.max(jnp.where(real[None, :], logits, -jnp.inf), axis=1))
    if axes:
        peak = lax.pmax(peak, axes)
    exps = jnp.sum(jnp.where(real[None, :], jnp.exp(logits - peak[:, None]), 0), axis=1)
    target = jnp.sum(jnp.where(ids[None, :] == labels[:, None], logits, 0), axis=1)
    if axes:
        exps = lax.psum(exps, axes)
        target = lax.psum(target, axes)
    valid = (labels >= 0) & (labels < vocab_size)
    return jnp.where(valid, jnp.log(exps) + peak - target, 0)


def total_over_rows(values: jax.Array, topology: Topology) -> jax.Array:
    """The sum of per-row `values` over every row of the batch: a scalar alike on every rank.

    `values` [rows, ...] are on the attention's rows (each attention-DP rank its own rows, alike
    over attention TP, as a stack output and its per-row losses are); the local sum is
    completed over attention DP only, so no row counts twice.
    """
    total = jnp.sum(values)
    axes = _names(topology.attention_rows().sharded)
    return lax.psum(total, axes) if axes else total


# --------------------------------------------------------------------------------------------
# Token movement for an all-to-all expert dispatch (inside a MoE's compute)
# --------------------------------------------------------------------------------------------


def group_order(groups: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The stable order of rows by their group id, by counting (no comparison sort).

    For grouped matmuls: rows sorted by expert, and the way back. Cheaper than an argsort on
    GPU (RESULTS run 12: 32768 rows of 129 groups, 13 us against 32 us for the sort and 33 us
    for the inverse's). The orders vary over the mesh axes `groups` varies over, so gathers by
    them transpose to per-rank scatters (an index typed invariant would sum the ranks' gradients
    before each rank's own scatter).

    Args:
      groups: [N] int group id of each row, each in [0, num_groups).
      num_groups: The number of groups (static).

    Returns:
      `(order, positions, sizes)`: `order[i]` is the row at place i of the sorted rows (rows of
      one group keep their order), `positions[r]` the place of row r (`order`'s inverse), and
      `sizes[g]` the rows of group g; all int32.
    """
    if groups.ndim != 1:
        raise ValueError(f"group_order takes [N] group ids; got {groups.shape=}")
    onehot = (groups[:, None] == jnp.arange(num_groups, dtype=groups.dtype)[None, :]).astype(
        jnp.int32
    )
    before = jnp.cumsum(onehot, axis=0) - onehot  # rows of each group ahead of this row
    sizes = jnp.sum(onehot, axis=0)
    starts = jnp.cumsum(sizes) - sizes
    place = jnp.take_along_axis(before + starts[None, :], groups[:, None].astype(jnp.int32), 1)
    positions = place[:, 0]
    rows = jnp.arange(groups.shape[0], dtype=jnp.int32)
    # Scattered into a varying operand, the order varies as `groups` does.
    order = jnp.zeros_like(positions).at[positions].set(rows, unique_indices=True)
    return order, positions, sizes


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["rows", "tags", "slots"],
    meta_fields=["capacity"],
)
@dataclasses.dataclass(frozen=True)
class Dispatched:
    """Rows received by this rank's expert-parallel position, and how to send them back.

    With `moe_tp > 1` each expert's width is split over the `SumGroup.MOE_TP` ranks, so every
    one of them needs the rows its EP position received: the blocks of all `moe_tp` ranks are
    gathered, `moe_tp` rank outermost.

    Attributes:
      rows: [moe_tp * moe_ep * capacity, hidden] received rows, source rank outermost within
        each `moe_tp` rank's block; a source's unused slots are zero rows.
      tags: [moe_tp * moe_ep * capacity] int32 the tag each row was sent with (e.g. its
        expert's local id on this rank); -1 in unused slots.
      slots: [sent rows] int32 where each row this rank sent sits in its destination's block
        (destination * capacity + position); `combine_from_experts` reads the answers there.
      capacity: Rows each rank sends to each rank (static).
    """

    rows: jax.Array
    tags: jax.Array
    slots: jax.Array
    capacity: int


def dispatch_to_experts(
    rows: jax.Array,
    tags: jax.Array,
    destination: jax.Array,
    topology: Topology,
    *,
    max_rows_per_rank: int,
    capacity: int | None = None,
) -> Dispatched:
    """Sends each row to the expert-parallel rank `destination` names (`lax.all_to_all` over
    `SumGroup.MOE_EP`), and gathers what the `SumGroup.MOE_TP` ranks received (`lax.all_gather`)
    when each expert's width is split over them.

    Static shapes: every rank sends every rank a block of `capacity` rows. The default capacity,
    `max_rows_per_rank`, is the most rows this rank can send one rank (for top-k routing of T
    tokens to distinct experts, `T * min(k, experts per rank)`), so nothing is ever dropped.

    Args:
      rows: [N, hidden] rows to send (e.g. one per (token, choice)).
      tags: [N] int32 carried with each row (e.g. the chosen expert's id on its rank).
      destination: [N] int32 expert-parallel rank (`ops.shard_index(topology, MOE_EP)` order)
        each row goes to, in [0, moe_ep).
      topology: Its `SumGroup.MOE_EP` axes are the group exchanged over.
      max_rows_per_rank: The most rows of `rows` that may name one destination.
      capacity: Rows per (source, destination) block; None for `max_rows_per_rank`.

    Returns:
      The received rows, their tags, and the slots `combine_from_experts` needs.

    Raises:
      ValueError: `capacity` is below `max_rows_per_rank` (it could drop tokens), or the
        shapes disagree.
    """
    if rows.ndim != 2 or tags.shape != rows.shape[:1] or destination.shape != rows.shape[:1]:
        raise ValueError(
            "dispatch_to_experts takes rows [N, hidden] with tags [N] and destination [N]; got "
            f"{rows.shape=}, {tags.shape=}, {destination.shape=}"
        )
    if capacity is None:
        capacity = max_rows_per_rank
    if capacity < max_rows_per_rank:
        raise ValueError(
            f"an all-to-all capacity of {capacity} rows per rank could drop tokens: up to "
            f"{max_rows_per_rank=} rows may go to one rank. Pass capacity=None (drop nothing) "
            f"or at least {max_rows_per_rank}"
        )
    ranks = topology.moe_ep
    axes = topology.sum_axes(SumGroup.MOE_EP)
    # A row's position among the rows sent to the same rank, in row order.
    onehot = destination[:, None] == jnp.arange(ranks, dtype=destination.dtype)[None, :]
    position = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    slots = (destination * capacity + position).astype(jnp.int32)
    send = jnp.zeros((ranks * capacity, rows.shape[1]), rows.dtype).at[slots].set(rows)
    send_tags = jnp.full((ranks * capacity,), -1, jnp.int32).at[slots].set(tags.astype(jnp.int32))
    received, received_tags = _exchange(send, axes), _exchange(send_tags, axes)
    width = topology.sum_axes(SumGroup.MOE_TP)
    if width:
        received, received_tags = AllGather(width)(received), AllGather(width)(received_tags)
    return Dispatched(received, received_tags, slots, capacity)


def combine_from_experts(outputs: jax.Array, dispatched: Dispatched, topology: Topology):
    """Sends the experts' answers back: [N, ...] in the order rows were sent.

    With `moe_tp > 1` each answer is this rank's share over its slice of the expert width: the
    shares are summed and each `moe_tp` rank keeps its own block (`lax.psum_scatter`) before
    the answers go back (`lax.all_to_all`).

    Args:
      outputs: [moe_tp * moe_ep * capacity, ...] one answer per row of `dispatched.rows`.
      dispatched: What `dispatch_to_experts` returned.
      topology: As for the dispatch.
    """
    if outputs.shape[0] != dispatched.rows.shape[0]:
        raise ValueError(
            f"combine_from_experts takes one answer per received row ({dispatched.rows.shape[0]}); "
            f"got {outputs.shape=}"
        )
    width = topology.sum_axes(SumGroup.MOE_TP)
    if width:
        outputs = ReduceScatter(width, topology.moe_tp)(outputs)
    returned = _exchange(outputs, topology.sum_axes(SumGroup.MOE_EP))
    return jnp.take(returned, dispatched.slots, axis=0)


def _exchange(x: jax.Array, axes: tuple[TokenAxis, ...]) -> jax.Array:
    """Block r of `x`'s rows goes to rank r; block s of the result came from rank s."""
    if not axes:
        return x
    return lax.all_to_all(x, _names(axes), split_axis=0, concat_axis=0, tiled=True)
