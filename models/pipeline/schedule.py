"""Prefill microbatches and the GPipe schedule that runs them through the stages."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

import boundary_jax as bj

from ..inputs.rows import PackedBatch, TokenRows


@dataclasses.dataclass(frozen=True)
class Microbatch:
    """Some of a packed batch's sequences, packed on their own, each in its whole batch's
    KV-cache slot.

    Attributes:
      packed: The microbatch's rows (its sequences from row 0 of each DP rank's block, with
        their segment ids the whole batch's slots) and where each of its sequences landed.
      sequences: The index in the whole batch of each of `packed`'s sequences.
    """

    packed: PackedBatch
    sequences: tuple[int, ...]


def split_microbatches(
    packed: PackedBatch, count: int, topology: bj.Topology, *, rows_per_rank: int | None = None
) -> tuple[Microbatch, ...]:
    """`packed` as at most `count` microbatches: slot i of every DP rank goes to microbatch
    i mod count, so each rank's sequences spread over them; a microbatch that would be empty
    everywhere is left out.

    Every microbatch has the same block of rows per DP rank (so one program runs them all): the
    largest one needs, rounded up to a multiple of attention TP, or `rows_per_rank` when given.

    Raises:
      ValueError: `count` is not positive, or `rows_per_rank` is too small or not a multiple
        of attention TP.
    """
    if count < 1:
        raise ValueError(f"the number of microbatches must be positive; got {count}")
    dp, tp = len(packed.token_counts), topology.attn_tp
    count = min(count, max(packed.slot) + 1)
    members = [[i for i, slot in enumerate(packed.slot) if slot % count == m] for m in range(count)]
    loads = [
        [sum(packed.lengths[i] for i in group if packed.rank[i] == rank) for rank in range(dp)]
        for group in members
    ]
    needed = -(-max(max(load) for load in loads) // tp) * tp
    block = needed if rows_per_rank is None else rows_per_rank
    if block < needed or block % tp:
        raise ValueError(
            f"rows_per_rank must be a multiple of attention TP ({tp}) holding {needed} rows; "
            f"got {rows_per_rank}"
        )
    return tuple(_microbatch(packed, group, block) for group in members)


def _microbatch(packed: PackedBatch, group: Sequence[int], block: int) -> Microbatch:
    dp = len(packed.token_counts)
    ids = np.zeros(dp * block, np.int32)
    positions = np.zeros(dp * block, np.int32)
    segments = np.full(dp * block, -1, np.int32)
    adapters = np.zeros(dp * block, np.int32)
    counts = np.zeros(dp, np.int32)
    ranks, slots, starts, lengths = [], [], [], []
    source = np.asarray(packed.rows.ids)
    order = tuple(sorted(group, key=lambda i: (packed.rank[i], packed.slot[i])))
    for index in order:
        rank, length = packed.rank[index], packed.lengths[index]
        first = rank * packed.rows_per_rank + packed.start[index]
        row = rank * block + counts[rank]
        ids[row : row + length] = source[first : first + length]
        positions[row : row + length] = np.arange(length)
        segments[row : row + length] = packed.slot[index]
        if packed.adapters is not None:
            adapters[row : row + length] = packed.adapters[index]
        ranks.append(rank)
        slots.append(packed.slot[index])
        starts.append(int(counts[rank]))
        lengths.append(length)
        counts[rank] += length
    # Each rank's sequences are packed from its block's first row, as in `packed`, so equal
    # sequences stay in windows.
    rows = TokenRows(
        ids,
        positions,
        segments,
        max_sequence_rows=packed.rows.max_sequence_rows,
        equal_sequences=packed.rows.equal_sequences,
        adapters=None if packed.adapters is None else adapters,
        slots=packed.rows.slots,
    )
    part = dataclasses.replace(
        packed,
        rows=rows,
        token_counts=counts,
        rank=tuple(ranks),
        slot=tuple(slots),
        start=tuple(starts),
        lengths=tuple(lengths),
        rows_per_rank=block,
        slots_per_rank=int(max(np.bincount(ranks, minlength=dp))),
        adapters=None if packed.adapters is None else tuple(packed.adapters[i] for i in order),
    )
    return Microbatch(part, order)


def gpipe_ticks(stages: int, microbatches: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The GPipe forward schedule: at tick t, stage s runs microbatch t - s. Returns per tick
    its `(stage, microbatch)` pairs, last stage first (so a stage's handoff of tick t is
    consumed at tick t + 1)."""
    return tuple(
        tuple(
            (stage, tick - stage)
            for stage in reversed(range(stages))
            if 0 <= tick - stage < microbatches
        )
        for tick in range(stages + microbatches - 1)
    )


def bubble(stages: int, microbatches: int) -> float:
    """The idle fraction of a GPipe forward: (S - 1) / (M + S - 1) of every stage's ticks."""
    return (stages - 1) / (microbatches + stages - 1)
