"""Token movement for an all-to-all expert dispatch (inside a MoE's compute), and the counting
sort that groups rows by expert."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..layout import SumGroup, Topology


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
        (destination * capacity + position; past every block for a row not sent);
        `combine_from_experts` reads the answers there.
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
        each row goes to, in [0, moe_ep); -1: the row is not sent (a choice of an expert no
        rank holds, such as a zero-computation expert), and its answer comes back zero.
      topology: Its `SumGroup.MOE_EP` mesh axes are the group exchanged over.
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
    experts = topology.group_names(SumGroup.MOE_EP)
    # A row's position among the rows sent to the same rank, in row order.
    onehot = destination[:, None] == jnp.arange(ranks, dtype=destination.dtype)[None, :]
    position = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    # A row not sent gets the slot past the last block: dropped here, read back as zero.
    slots = jnp.where(destination >= 0, destination * capacity + position, ranks * capacity).astype(
        jnp.int32
    )
    send = jnp.zeros((ranks * capacity, rows.shape[1]), rows.dtype).at[slots].set(rows, mode="drop")
    send_tags = (
        jnp.full((ranks * capacity,), -1, jnp.int32)
        .at[slots]
        .set(tags.astype(jnp.int32), mode="drop")
    )
    received, received_tags = _exchange(send, experts), _exchange(send_tags, experts)
    width = topology.group_names(SumGroup.MOE_TP)
    if width:
        received, received_tags = (
            lax.all_gather(x, width, axis=0, tiled=True, to="invarying")
            for x in (received, received_tags)
        )
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
    width = topology.group_names(SumGroup.MOE_TP)
    if width:
        outputs = lax.psum_scatter(outputs, width, scatter_dimension=0, tiled=True)
    returned = _exchange(outputs, topology.group_names(SumGroup.MOE_EP))
    return jnp.take(returned, dispatched.slots, axis=0, mode="fill", fill_value=0)


def _exchange(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """Block r of `x`'s rows goes to rank r of the mesh axes `names`; block s of the result
    came from rank s."""
    if not names:
        return x
    return lax.all_to_all(x, names, split_axis=0, concat_axis=0, tiled=True)
