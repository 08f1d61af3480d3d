"""Packed token rows: whole sequences spread over attention-DP ranks, padded to static blocks.

The forward runs on rows, not a [batch, seq] grid: each attention-DP rank holds a block of
`rows_per_rank` rows, its sequences packed one after another from row 0, the rest padding.
Under context parallelism (`attn_cp = C > 1`) a DP rank's block is C blocks of
`rows_per_rank / C` rows, one per CP rank, each holding that rank's zigzag share of the packed
sequences (`zigzag.zigzag_order`: chunks i and 2C-1-i of each) from row 0, the rest padding.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence

import jax
import numpy as np

import boundary_jax as bj

from .zigzag import ZigzagOrder, zigzag_order


class RowsPhase(enum.Enum):
    """What a block of rows is, which decides how attention reads and writes the KV cache.

    PREFILL: whole sequences packed from row 0, each contiguous at positions 0, 1, ...; they
    attend among themselves (and are written into the cache, if any).
    DECODE: one row per cache slot (row i is slot i's next token, segment id i or -1); each
    attends over its slot of the cache.
    EXTEND: any tokens of sequences continuing in a paged cache (a chunk of a prompt, or one
    decode token), packed from row 0, segment id the sequence's slot (-1: padding); each is
    written into its sequence's pages at its position and attends to the sequence's cached
    positions up to its own (`models.layers.attention.paged`).
    """

    PREFILL = "prefill"
    DECODE = "decode"
    EXTEND = "extend"


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["ids", "positions", "segment_ids", "adapters"],
    meta_fields=["phase", "max_sequence_rows", "equal_sequences", "slots"],
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
      equal_sequences: Static: every sequence of a prefill block has exactly
        `max_sequence_rows` rows, so each DP rank's block is windows of that many rows, each
        one sequence's from its first row, or padding (`window_rows`). `pack_sequences` sets
        it where that holds; rows built by hand must keep it.
      adapters: int32 LoRA adapter of each row's sequence (0: none, and on padding rows;
        `layers.lora`), or None for a batch without adapters.
      slots: Static: every segment id is below this (the slots per DP rank,
        `PackedBatch.decode_rows_per_rank`), or None: below the rows per rank. cuDNN's ragged
        prefill without a cache keeps an entry per possible segment (with attention sinks, a
        float32 log-sum-exp per entry, head and row: quadratic in the rows under the loose
        bound). `pack_sequences` sets it; rows built by hand must keep it.
    """

    ids: np.ndarray | jax.Array
    positions: np.ndarray | jax.Array
    segment_ids: np.ndarray | jax.Array
    phase: RowsPhase = RowsPhase.PREFILL
    max_sequence_rows: int | None = None
    equal_sequences: bool = False
    adapters: np.ndarray | jax.Array | None = None
    slots: int | None = None

    def __post_init__(self):
        if self.max_sequence_rows is not None and self.max_sequence_rows < 1:
            raise ValueError(f"max_sequence_rows must be >= 1; got {self.max_sequence_rows}")
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"slots must be >= 1; got {self.slots}")
        if self.equal_sequences and self.max_sequence_rows is None:
            raise ValueError("equal_sequences needs the sequences' length as max_sequence_rows")

    @property
    def window_rows(self) -> int | None:
        """Static: with `equal_sequences` in a PREFILL, the rows of each window holding one
        sequence (attention may run window by window); else None."""
        if self.equal_sequences and self.phase is RowsPhase.PREFILL:
            return self.max_sequence_rows
        return None


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Sequences packed onto attention-DP ranks, and where each one landed.

    Attributes:
      rows: The packed rows, [attn_dp * rows_per_rank].
      token_counts: [attn_dp * attn_cp] real rows per (DP, CP) block (the rest of each block
        is padding).
      rank: DP rank of each sequence.
      slot: Slot (segment id) of each sequence on its DP rank.
      start: First row of each sequence within its DP rank's block.
      lengths: Rows of each sequence in this batch.
      rows_per_rank: Static block size per DP rank.
      slots_per_rank: Static number of sequence slots per DP rank.
      decode_rows_per_rank: Block size of a one-row-per-slot decode step (slots rounded up to
        a multiple of attention TP).
      zigzag: Under context parallelism, each DP rank's CP row order of a prefill (`start`
        counts rows of the packed order, before it); None without, and for decode rows.
      attn_cp: The attention-CP size the rows are laid out for.
      microbatch_counts: Packed as two microbatches (`models.serving.overlap.pack_two_batches`):
        [2, attn_dp] real rows of each microbatch per DP rank, from its half of the block's
        first row; None otherwise.
      adapters: The LoRA adapter index of each sequence (0: none), or None without adapters.
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
    zigzag: tuple[ZigzagOrder, ...] | None = None
    attn_cp: int = 1
    microbatch_counts: np.ndarray | None = None
    adapters: tuple[int, ...] | None = None

    def _sequence_rows(self, index: int) -> np.ndarray:
        """The rows (in the concatenated blocks) of sequence `index`, in its order."""
        rank, start, length = self.rank[index], self.start[index], self.lengths[index]
        packed = np.arange(start, start + length)
        within = packed if self.zigzag is None else self.zigzag[rank].inverse[packed]
        return rank * self.rows_per_rank + within

    def unpack(self, values: np.ndarray) -> np.ndarray:
        """[attn_dp * rows_per_rank, ...] row values -> [sequences, longest, ...], zero-padded."""
        values = np.asarray(values)
        out = np.zeros((len(self.lengths), max(self.lengths), *values.shape[1:]), values.dtype)
        for index, length in enumerate(self.lengths):
            out[index, :length] = values[self._sequence_rows(index)]
        return out

    def last_rows(self, values: np.ndarray) -> np.ndarray:
        """The value at each sequence's last row: [sequences, ...]."""
        values = np.asarray(values)
        return values[[self._sequence_rows(i)[-1] for i in range(len(self.lengths))]]

    def last_row_index(self) -> np.ndarray:
        """int32 [attn_dp * attn_cp * decode_rows_per_rank]: per (DP, CP) block of rows and
        slot, the row (within that block) of the slot's sequence's last token; -1 for an empty
        slot, and under context parallelism on the CP ranks that do not hold that row.

        Fed to the model as `last_rows`, it yields one logits row per slot, in slot order (under
        context parallelism alike on every CP rank of the DP rank: `CausalLM.read_out`).
        """
        cp = self.attn_cp
        per_cp = self.rows_per_rank // cp
        index = np.full(len(self.token_counts) * self.decode_rows_per_rank, -1, np.int32)
        for sequence, (rank, slot) in enumerate(zip(self.rank, self.slot, strict=True)):
            row = self._sequence_rows(sequence)[-1] - rank * self.rows_per_rank
            block = rank * cp + row // per_cp
            index[block * self.decode_rows_per_rank + slot] = row % per_cp
        return index

    def slot_order(self) -> np.ndarray:
        """int32 [sequences]: where each sequence sits in a slot-ordered [attn_dp * attn_cp *
        slots] array (under context parallelism, in its DP rank's first CP block)."""
        cp = self.attn_cp
        return np.asarray(
            [
                r * cp * self.decode_rows_per_rank + s
                for r, s in zip(self.rank, self.slot, strict=True)
            ],
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
    adapters: Sequence[int] | None = None,
) -> PackedBatch:
    """Packs whole sequences onto attention-DP ranks, balancing their token counts.

    Longest sequences go first, each to the DP rank with the fewest tokens so far. Blocks are
    padded to a common size that divides over attention TP (so input-scattered batches work);
    under context parallelism each DP block is laid out in zigzag CP order (module docstring),
    its CP blocks padded alike, and `token_counts` counts the real rows of each (DP, CP) block.
    `rows_per_rank` and `slots_per_rank` fix the prefill block and the decode block (cache
    slots per rank) to larger static sizes, so that batches of other sizes share one program.
    `max_sequence_rows` bounds every sequence's length (static, as `TokenRows` carries it), so
    that prefill attention skips the key rows beyond it; batches under one bound share a program.
    `adapters` gives each sequence's LoRA adapter index (0: none), which every row of the
    sequence carries (`TokenRows.adapters`).

    Raises:
      ValueError: A sequence is empty or longer than `max_sequence_rows`, or `rows_per_rank` /
        `slots_per_rank` is too small or not a multiple of attention TP (CP x TP for
        `rows_per_rank`), or `adapters` does not give one index >= 0 per sequence.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("pack_sequences needs at least one sequence and no empty sequence")
    if adapters is not None:
        adapters = tuple(int(a) for a in adapters)
        if len(adapters) != len(sequences) or min(adapters) < 0:
            raise ValueError(
                f"adapters gives one LoRA adapter index >= 0 per sequence (0: none); got "
                f"{len(adapters)} for {len(sequences)} sequences: {list(adapters)}"
            )
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
    cp, tp = topology.attn_cp, topology.attn_tp
    lengths = [[len(sequences[i]) for i in sorted(indices)] for indices in members]
    per_cp = [
        zigzag_order(held, cp).rows_per_cp_rank if held and cp > 1 else total
        for held, total in zip(lengths, load, strict=True)
    ]
    needed = cp * _round_up(max(max(per_cp), 1), tp)
    block = needed if rows_per_rank is None else rows_per_rank
    if block < needed or block % (cp * tp):
        raise ValueError(
            f"rows_per_rank must be a multiple of attention CP x TP ({cp} x {tp}) holding "
            f"{needed} rows; got {rows_per_rank}"
        )
    ids = np.zeros(dp * block, np.int32)
    positions = np.zeros(dp * block, np.int32)
    segments = np.full(dp * block, -1, np.int32)
    adapter_rows = np.zeros(dp * block, np.int32)
    rank_of, slot_of, start_of = [0] * len(sequences), [0] * len(sequences), [0] * len(sequences)
    for rank, indices in enumerate(members):
        offset = 0
        for slot, index in enumerate(sorted(indices)):
            tokens = np.asarray(sequences[index], np.int32)
            row = rank * block + offset
            ids[row : row + len(tokens)] = tokens
            positions[row : row + len(tokens)] = np.arange(len(tokens))
            segments[row : row + len(tokens)] = slot
            adapter_rows[row : row + len(tokens)] = 0 if adapters is None else adapters[index]
            rank_of[index], slot_of[index], start_of[index] = rank, slot, offset
            offset += len(tokens)
    counts = np.asarray(load, np.int32)
    zigzag = None
    if cp > 1:
        ids, positions, segments, adapter_rows, counts, zigzag = _zigzag_blocks(
            (ids, positions, segments, adapter_rows), lengths, cp, block
        )
    slots = _round_up(max(len(m) for m in members), topology.attn_tp)
    if slots_per_rank is not None:
        if slots_per_rank < slots or slots_per_rank % topology.attn_tp:
            raise ValueError(
                f"slots_per_rank must be a multiple of attention TP ({topology.attn_tp}) holding "
                f"{max(len(m) for m in members)} sequences; got {slots_per_rank}"
            )
        slots = slots_per_rank
    return PackedBatch(
        rows=TokenRows(
            ids,
            positions,
            segments,
            max_sequence_rows=max_sequence_rows,
            equal_sequences=cp == 1 and all(len(s) == max_sequence_rows for s in sequences),
            adapters=None if adapters is None else adapter_rows,
            slots=slots,
        ),
        token_counts=counts,
        rank=tuple(rank_of),
        slot=tuple(slot_of),
        start=tuple(start_of),
        lengths=tuple(len(s) for s in sequences),
        rows_per_rank=block,
        slots_per_rank=max(len(m) for m in members),
        decode_rows_per_rank=slots,
        zigzag=zigzag,
        attn_cp=cp,
        adapters=adapters,
    )


def _zigzag_blocks(
    packed: tuple[np.ndarray, ...],
    lengths: list[list[int]],
    cp: int,
    block: int,
) -> tuple:
    """Packed DP blocks (ids, positions, segment ids, adapters) in zigzag CP order, then the
    real rows of each (DP, CP) block and each DP rank's order (an idle DP rank's holds no
    sequence)."""
    out = [np.empty_like(values) for values in packed]
    counts, orders = [], []
    for rank, held in enumerate(lengths):
        if held:
            order = zigzag_order(held, cp, rows_per_cp_rank=block // cp)
        else:
            order = ZigzagOrder(np.full((cp, block // cp), -1, np.int32), np.zeros(0, np.int32), ())
        rows = slice(rank * block, (rank + 1) * block)
        for values, target, fill in zip(packed, out, (0, 0, -1, 0), strict=True):
            target[rows] = order.to_cp(values[rows], fill)
        counts.extend((order.source >= 0).sum(axis=1))
        orders.append(order)
    return (*out, np.asarray(counts, np.int32), tuple(orders))


def decode_rows(packed: PackedBatch, tokens: np.ndarray, positions: np.ndarray) -> PackedBatch:
    """One row per sequence (its next token at its next position), in its prefill slot.

    The block per DP rank holds one row per slot (`decode_rows_per_rank`, the cache's slots per
    rank), so row i of a rank is cache slot i, as a DECODE call requires. Under context
    parallelism every CP rank of a DP rank holds the same block (each attends to its own shard
    of the cache): the DP rank's block is that block once per CP rank, and `token_counts`
    count each (DP, CP) block.
    """
    cp = packed.attn_cp
    dp = len(packed.token_counts) // cp
    block = packed.decode_rows_per_rank
    ids = np.zeros((dp, block), np.int32)
    rows_pos = np.zeros((dp, block), np.int32)
    segments = np.full((dp, block), -1, np.int32)
    adapters = np.zeros((dp, block), np.int32)
    counts = np.zeros(dp, np.int32)
    halves = np.zeros((2, dp), np.int32)
    for index, (rank, slot) in enumerate(zip(packed.rank, packed.slot, strict=True)):
        ids[rank, slot], rows_pos[rank, slot], segments[rank, slot] = (
            tokens[index],
            positions[index],
            slot,
        )
        if packed.adapters is not None:
            adapters[rank, slot] = packed.adapters[index]
        counts[rank] += 1
        if packed.microbatch_counts is not None:
            # Two microbatches: each numbers the slots of its own caches from 0.
            side, segments[rank, slot] = divmod(slot, block // 2)
            halves[side, rank] += 1

    def per_cp_block(values: np.ndarray) -> np.ndarray:
        return np.repeat(values[:, None], cp, axis=1).reshape(-1)

    return dataclasses.replace(
        packed,
        rows=TokenRows(
            per_cp_block(ids),
            per_cp_block(rows_pos),
            per_cp_block(segments),
            RowsPhase.DECODE,
            adapters=None if packed.adapters is None else per_cp_block(adapters),
        ),
        token_counts=np.repeat(counts, cp),
        microbatch_counts=None if packed.microbatch_counts is None else halves,
        start=packed.slot,
        lengths=(1,) * len(packed.lengths),
        rows_per_rank=cp * block,
        zigzag=None,
    )
