"""Packed token rows: whole sequences spread over attention-DP ranks, padded to static blocks.

The forward runs on rows, not a [batch, seq] grid: each attention-DP rank holds a block of
`rows_per_rank` rows, its sequences packed one after another from row 0, the rest padding.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence

import jax
import numpy as np

import boundary_jax as bj


class RowsPhase(enum.Enum):
    """What a block of rows is, which decides how attention reads and writes the KV cache.

    PREFILL: whole sequences packed from row 0, each contiguous at positions 0, 1, ...; they
    attend among themselves (and are written into the cache, if any).
    DECODE: one row per cache slot (row i is slot i's next token, segment id i or -1); each
    attends over its slot of the cache.
    """

    PREFILL = "prefill"
    DECODE = "decode"


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["ids", "positions", "segment_ids"],
    meta_fields=["phase", "max_sequence_rows"],
)
@dataclasses.dataclass(frozen=True)
class TokenRows:
    """Token rows of every attention-DP rank, concatenated: [attn_dp * rows_per_rank] each.

    Attributes:
      ids: int32 token ids (0 on padding rows).
      positions: int32 position of each row within its sequence.
      segment_ids: int32 slot of the row's sequence on its DP rank; -1 on padding rows.
      phase: Static: packed prefill rows or one decode row per slot.
      max_sequence_rows: Static: no sequence of a prefill block has more rows than this, or
        None. A bound well short of the block lets attention skip the key rows beyond it
        (`pack_sequences` checks it; rows built by hand must keep it).
    """

    ids: np.ndarray | jax.Array
    positions: np.ndarray | jax.Array
    segment_ids: np.ndarray | jax.Array
    phase: RowsPhase = RowsPhase.PREFILL
    max_sequence_rows: int | None = None


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Sequences packed onto attention-DP ranks, and where each one landed.

    Attributes:
      rows: The packed rows, [attn_dp * rows_per_rank].
      token_counts: [attn_dp] real rows per DP rank (the rest of each block is padding).
      rank: DP rank of each sequence.
      slot: Slot (segment id) of each sequence on its DP rank.
      start: First row of each sequence within its DP rank's block.
      lengths: Rows of each sequence in this batch.
      rows_per_rank: Static block size per DP rank.
      slots_per_rank: Static number of sequence slots per DP rank.
      decode_rows_per_rank: Block size of a one-row-per-slot decode step (slots rounded up to
        a multiple of attention TP).
    """

    rows: TokenRows
    token_counts: np.ndarray
    rank: tuple[int, ...]
    slot: tuple[int, ...]
    start: tuple[int, ...]
    lengths: tuple[int, ...]
    rows_per_rank: int
    slots_per_rank: int
    decode_rows_per_rank: int

    def unpack(self, values: np.ndarray) -> np.ndarray:
        """[attn_dp * rows_per_rank, ...] row values -> [sequences, longest, ...], zero-padded."""
        values = np.asarray(values)
        out = np.zeros((len(self.lengths), max(self.lengths), *values.shape[1:]), values.dtype)
        for index, (rank, start, length) in enumerate(
            zip(self.rank, self.start, self.lengths, strict=True)
        ):
            first = rank * self.rows_per_rank + start
            out[index, :length] = values[first : first + length]
        return out

    def last_rows(self, values: np.ndarray) -> np.ndarray:
        """The value at each sequence's last row: [sequences, ...]."""
        values = np.asarray(values)
        rows = [
            rank * self.rows_per_rank + start + length - 1
            for rank, start, length in zip(self.rank, self.start, self.lengths, strict=True)
        ]
        return values[rows]

    def last_row_index(self) -> np.ndarray:
        """int32 [attn_dp * decode_rows_per_rank]: per DP rank and slot, the row (within the
        rank's block) of that slot's sequence's last token; -1 for an empty slot.

        Fed to the model as `last_rows`, it yields one logits row per slot, in slot order.
        """
        dp = len(self.token_counts)
        index = np.full(dp * self.decode_rows_per_rank, -1, np.int32)
        for rank, slot, start, length in zip(
            self.rank, self.slot, self.start, self.lengths, strict=True
        ):
            index[rank * self.decode_rows_per_rank + slot] = start + length - 1
        return index

    def slot_order(self) -> np.ndarray:
        """int32 [sequences]: where each sequence sits in a slot-ordered [attn_dp * slots] array."""
        return np.asarray(
            [r * self.decode_rows_per_rank + s for r, s in zip(self.rank, self.slot, strict=True)],
            np.int32,
        )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pack_sequences(
    sequences: Sequence[Sequence[int]],
    topology: bj.Topology,
    *,
    rows_per_rank: int | None = None,
    slots_per_rank: int | None = None,
    max_sequence_rows: int | None = None,
) -> PackedBatch:
    """Packs whole sequences onto attention-DP ranks, balancing their token counts.

    Longest sequences go first, each to the DP rank with the fewest tokens so far. Blocks are
    padded to a common size that divides over attention TP (so input-scattered batches work).
    `rows_per_rank` and `slots_per_rank` fix the prefill block and the decode block (cache
    slots per rank) to larger static sizes, so that batches of other sizes share one program.
    `max_sequence_rows` bounds every sequence's length (static, as `TokenRows` carries it), so
    that prefill attention skips the key rows beyond it; batches under one bound share a program.

    Raises:
      ValueError: A sequence is empty or longer than `max_sequence_rows`, or `rows_per_rank` /
        `slots_per_rank` is too small or not a multiple of attention TP.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("pack_sequences needs at least one sequence and no empty sequence")
    if max_sequence_rows is not None and max(map(len, sequences)) > max_sequence_rows:
        raise ValueError(
            f"a sequence of {max(map(len, sequences))} tokens is longer than "
            f"max_sequence_rows={max_sequence_rows}"
        )
    dp = topology.attn_dp
    load, members = [0] * dp, [[] for _ in range(dp)]
    for index in sorted(range(len(sequences)), key=lambda i: (-len(sequences[i]), i)):
        rank = min(range(dp), key=lambda r: (load[r], len(members[r]), r))
        members[rank].append(index)
        load[rank] += len(sequences[index])
    needed = _round_up(max(max(load), 1), topology.attn_tp)
    block = needed if rows_per_rank is None else rows_per_rank
    if block < needed or block % topology.attn_tp:
        raise ValueError(
            f"rows_per_rank must be a multiple of attention TP ({topology.attn_tp}) holding "
            f"{max(load)} rows; got {rows_per_rank}"
        )
    ids = np.zeros(dp * block, np.int32)
    positions = np.zeros(dp * block, np.int32)
    segments = np.full(dp * block, -1, np.int32)
    rank_of, slot_of, start_of = [0] * len(sequences), [0] * len(sequences), [0] * len(sequences)
    for rank, indices in enumerate(members):
        offset = 0
        for slot, index in enumerate(sorted(indices)):
            tokens = np.asarray(sequences[index], np.int32)
            row = rank * block + offset
            ids[row : row + len(tokens)] = tokens
            positions[row : row + len(tokens)] = np.arange(len(tokens))
            segments[row : row + len(tokens)] = slot
            rank_of[index], slot_of[index], start_of[index] = rank, slot, offset
            offset += len(tokens)
    slots = _round_up(max(len(m) for m in members), topology.attn_tp)
    if slots_per_rank is not None:
        if slots_per_rank < slots or slots_per_rank % topology.attn_tp:
            raise ValueError(
                f"slots_per_rank must be a multiple of attention TP ({topology.attn_tp}) holding "
                f"{max(len(m) for m in members)} sequences; got {slots_per_rank}"
            )
        slots = slots_per_rank
    return PackedBatch(
        rows=TokenRows(ids, positions, segments, max_sequence_rows=max_sequence_rows),
        token_counts=np.asarray(load, np.int32),
        rank=tuple(rank_of),
        slot=tuple(slot_of),
        start=tuple(start_of),
        lengths=tuple(len(s) for s in sequences),
        rows_per_rank=block,
        slots_per_rank=max(len(m) for m in members),
        decode_rows_per_rank=slots,
    )


def decode_rows(packed: PackedBatch, tokens: np.ndarray, positions: np.ndarray) -> PackedBatch:
    """One row per sequence (its next token at its next position), in its prefill slot.

    The block per DP rank holds one row per slot (`decode_rows_per_rank`, the cache's slots per
    rank), so row i of a rank is cache slot i, as a DECODE call requires.
    """
    dp = len(packed.token_counts)
    block = packed.decode_rows_per_rank
    ids = np.zeros(dp * block, np.int32)
    rows_pos = np.zeros(dp * block, np.int32)
    segments = np.full(dp * block, -1, np.int32)
    counts = np.zeros(dp, np.int32)
    for index, (rank, slot) in enumerate(zip(packed.rank, packed.slot, strict=True)):
        row = rank * block + slot
        ids[row], rows_pos[row], segments[row] = tokens[index], positions[index], slot
        counts[rank] += 1
    return dataclasses.replace(
        packed,
        rows=TokenRows(ids, rows_pos, segments, RowsPhase.DECODE),
        token_counts=counts,
        start=packed.slot,
        lengths=(1,) * len(packed.lengths),
        rows_per_rank=block,
    )
