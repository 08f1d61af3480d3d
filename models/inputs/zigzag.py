"""Zigzag (load-balanced) row order for context parallelism over attention CP.

Causal attention's work grows with a row's position, so cutting a sequence into `C` contiguous
pieces gives the last CP rank most of it. Zigzag cuts each sequence into `2C` chunks and gives
CP rank `i` chunks `i` and `2C - 1 - i`: an early and a late chunk, about the same work on every
rank. Rows keep their positions and segment ids, so attention masks by them, not by row order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class ZigzagOrder:
    """Which packed rows each CP rank holds, and the way back.

    Packed rows are one attention-DP rank's block as `pack_sequences` lays it out: sequences
    one after another from row 0, `sum(lengths)` real rows, then padding.

    Attributes:
      source: int32 [cp, rows_per_cp_rank]: the packed row that each CP rank's row holds; -1
        for a CP padding row. Per rank, sequence by sequence: chunk `i`, then chunk `2C-1-i`.
      inverse: int32 [sum(lengths)]: where each real packed row sits in the CP rows flattened
        to [cp * rows_per_cp_rank] (rank-major).
      lengths: Rows of each packed sequence.
    """

    source: np.ndarray
    inverse: np.ndarray
    lengths: tuple[int, ...]

    @property
    def cp(self) -> int:
        """The CP size."""
        return self.source.shape[0]

    @property
    def rows_per_cp_rank(self) -> int:
        """Rows of each CP rank's block (its real rows, then padding)."""
        return self.source.shape[1]

    def to_cp(self, values: np.ndarray, fill) -> np.ndarray:
        """Packed row values [>= sum(lengths), ...] -> CP rows [cp * rows_per_cp_rank, ...],
        rank-major; CP padding rows hold `fill`."""
        values = np.asarray(values)
        flat = self.source.reshape(-1)
        out = np.full((flat.size, *values.shape[1:]), fill, values.dtype)
        real = flat >= 0
        out[real] = values[flat[real]]
        return out

    def from_cp(self, values):
        """CP row values [cp * rows_per_cp_rank, ...] (numpy or jax) -> the real packed rows,
        [sum(lengths), ...], in packed order."""
        return values[self.inverse]


def chunk_bounds(length: int, cp: int) -> np.ndarray:
    """int [2 * cp + 1]: chunk j of a `length`-row sequence is rows [bounds[j], bounds[j+1]).

    Chunks differ by at most one row; a sequence shorter than `2 * cp` rows has empty chunks.
    """
    return np.arange(2 * cp + 1) * length // (2 * cp)


def zigzag_order(
    lengths: Sequence[int], cp: int, *, rows_per_cp_rank: int | None = None
) -> ZigzagOrder:
    """The zigzag CP order of packed sequences: CP rank i holds chunks i and 2C-1-i of each.

    Args:
      lengths: Rows of each packed sequence (contiguous from row 0, in this order).
      cp: The CP size C.
      rows_per_cp_rank: Static block size per CP rank (so batches share a program); None for
        the fullest rank's rows.

    Returns:
      The order and its inverse.

    Raises:
      ValueError: A non-positive `cp`, an empty sequence, or `rows_per_cp_rank` smaller than
        the fullest CP rank's rows.
    """
    if cp < 1 or not lengths or min(lengths) < 1:
        raise ValueError(
            f"zigzag_order needs cp >= 1 and non-empty sequences; got {cp=}, {lengths=}"
        )
    starts = np.cumsum([0, *lengths])[:-1]
    per_rank: list[list[np.ndarray]] = [[] for _ in range(cp)]
    for start, length in zip(starts, lengths, strict=True):
        bounds = start + chunk_bounds(length, cp)
        for rank in range(cp):
            for chunk in (rank, 2 * cp - 1 - rank):
                per_rank[rank].append(np.arange(bounds[chunk], bounds[chunk + 1]))
    rows = [np.concatenate(chunks) for chunks in per_rank]
    fullest = max(len(r) for r in rows)
    block = fullest if rows_per_cp_rank is None else rows_per_cp_rank
    if block < fullest:
        raise ValueError(
            f"rows_per_cp_rank must hold the fullest CP rank's {fullest} rows; got "
            f"{rows_per_cp_rank=}. Pass None or at least {fullest}"
        )
    source = np.full((cp, block), -1, np.int32)
    for rank, held in enumerate(rows):
        source[rank, : len(held)] = held
    flat = source.reshape(-1)
    inverse = np.empty(sum(lengths), np.int32)
    inverse[flat[flat >= 0]] = np.flatnonzero(flat >= 0)
    return ZigzagOrder(source=source, inverse=inverse, lengths=tuple(int(n) for n in lengths))
