"""Per-forward batch facts: the static variant a forward selects its paths by, plus row counts."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from .layout import BatchVariant, Topology


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["token_counts"],
    meta_fields=["variant", "topology"],
)
@dataclasses.dataclass(frozen=True)
class BatchFacts:
    """What a forward's boundaries need to know about its batch.

    Each attention-DP rank (under context parallelism, each DP x CP rank) holds a static, padded
    block of token rows; `token_counts[r]` says how many leading rows of block r are real tokens
    (an idle rank has 0). Shapes stay static under `jit`; only the counts are runtime values.

    Attributes:
      variant: The batch variant; every stage must have a bound path for it.
      topology: The parallel topology the rows are laid out on.
      token_counts: int32 [attn_dp * attn_cp] valid rows per block, replicated; None when
        every row of every block is a real token.
    """

    variant: BatchVariant
    topology: Topology
    token_counts: jax.Array | None = None

    def __post_init__(self):
        counts = self.token_counts
        blocks = self.topology.size(self.topology.attention_rows().sharded)
        if counts is not None and getattr(counts, "shape", None) not in (None, (blocks,)):
            raise ValueError(
                f"token_counts holds one count per block of attention rows (attention DP x CP "
                f"= {blocks}); got shape {counts.shape}"
            )

    @classmethod
    def ordinary(
        cls,
        topology: Topology,
        token_counts=None,
        *,
        rows_per_block: int | None = None,
        rows: int | None = None,
    ) -> BatchFacts:
        """Facts for a batch whose residual is on the attention's rows.

        Args:
          topology: The parallel topology.
          token_counts: [attn_dp * attn_cp] real tokens per block of attention rows, or None
            when every row is a token.
          rows_per_block: The padded rows of each DP rank's block (a count); required with
            `token_counts`, which must lie in [0, rows_per_block].
          rows: Deprecated spelling of `rows_per_block`.

        Raises:
          ValueError: Counts of the wrong shape, negative, past `rows_per_block`, or without it.
        """
        rows_per_block = _rows_per_block(rows_per_block, rows)
        return cls._make(BatchVariant.ORDINARY, topology, token_counts, rows_per_block)

    @classmethod
    def input_scattered(
        cls,
        topology: Topology,
        token_counts=None,
        *,
        rows_per_block: int | None = None,
        rows: int | None = None,
    ) -> BatchFacts:
        """Facts for a batch whose residual is on each rank's attention-TP slice of the rows
        (arguments as for `ordinary`)."""
        rows_per_block = _rows_per_block(rows_per_block, rows)
        return cls._make(BatchVariant.INPUT_SCATTERED, topology, token_counts, rows_per_block)

    @classmethod
    def unpadded(
        cls,
        topology: Topology,
        token_counts=None,
        *,
        rows_per_block: int | None = None,
        rows: int | None = None,
    ) -> BatchFacts:
        """Facts for a batch whose rows need not divide over attention TP (no attention DP):
        an FFN that would run on this rank's attention-TP slice runs on the attention's rows
        (arguments as for `ordinary`)."""
        rows_per_block = _rows_per_block(rows_per_block, rows)
        return cls._make(BatchVariant.UNPADDED, topology, token_counts, rows_per_block)

    @classmethod
    def _make(cls, variant, topology, token_counts, rows) -> BatchFacts:
        if token_counts is None:
            return cls(variant, topology)
        if rows is None:
            raise ValueError(
                "token_counts need the rows each attention-DP rank's block holds, to be checked "
                "against: pass rows_per_block=..."
            )
        counts = np.asarray(token_counts)
        if counts.dtype.kind not in "iu" or np.any(counts < 0) or np.any(counts > rows):
            raise ValueError(
                f"token_counts are whole numbers of real tokens in [0, {rows}] per DP rank's "
                f"block of rows_per_block={rows}; got {counts.tolist()}. Count each rank's "
                "tokens, or pad each block to more rows"
            )
        return cls(variant, topology, jnp.asarray(counts, jnp.int32))

    def spec(self) -> BatchFacts:
        """The `in_specs` entry for passing these facts into `shard_map` (counts replicated)."""
        counts = None if self.token_counts is None else PartitionSpec()
        return dataclasses.replace(self, token_counts=counts)

    def valid_rows(self, rows: int) -> jax.Array | None:
        """bool [rows] mask of this DP rank's real tokens within its block; None if all are real.

        Call inside `shard_map`, on a block of attention rows.
        """
        if self.token_counts is None:
            return None
        return jnp.arange(rows) < self.token_counts[self._block_index()]

    def has_tokens(self) -> jax.Array | bool:
        """Whether this DP rank holds any real token (call inside `shard_map`)."""
        if self.token_counts is None:
            return True
        return self.token_counts[self._block_index()] > 0

    def _block_index(self) -> jax.Array | int:
        """This rank's block of attention rows (its attention DP x CP rank), inside `shard_map`."""
        names = self.topology.mesh_names(self.topology.attention_rows().sharded)
        return jax.lax.axis_index(names) if names else 0


def _rows_per_block(rows_per_block: int | None, rows: int | None) -> int | None:
    """`rows_per_block`, or the deprecated `rows=` that spelled it (with a warning)."""
    if rows is None:
        return rows_per_block
    warnings.warn(
        f"BatchFacts(..., rows=) is deprecated; pass rows_per_block={rows} (the padded rows of "
        "each DP rank's block)",
        DeprecationWarning,
        stacklevel=3,
    )
    if rows_per_block is not None and rows_per_block != rows:
        raise ValueError(
            f"rows= is the old spelling of rows_per_block=; got {rows=} and {rows_per_block=}"
        )
    return rows
