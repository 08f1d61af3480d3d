"""What the decoder layers that start with an attention stage share: entering the layer (plainly
or captured) and running an attention on the step's token rows."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

import boundary_jax as bj

from ..inputs.rows import TokenRows


def attend_rows(
    attn: nnx.Module, h: jax.Array, rows: TokenRows, cache: Any
) -> tuple[jax.Array, Any]:
    """An attention's compute on `h`'s rows: its o_proj partial, and its updated cache."""
    return attn(
        h,
        rows.positions,
        rows.segment_ids,
        cache,
        phase=rows.phase,
        max_sequence_rows=rows.max_sequence_rows,
        window_rows=rows.window_rows,
    )


class AttentionFirstLayer(nnx.Module):
    """A layer whose first stage is an attention (`attn_boundary`): entering it, plainly or
    captured, then `run_stages` (the subclass's) from the attention's input."""

    def __call__(
        self,
        x: jax.Array | bj.OwedOutput,
        stream: bj.ResidualStream,
        rows: TokenRows,
        cache: Any,
    ) -> tuple[bj.OwedOutput, bj.ResidualStream, Any]:
        h, stream = self.attn_boundary.prepare(x, stream)
        return self.run_stages(h, stream, rows, cache)

    def captured(
        self,
        x: jax.Array | bj.OwedOutput,
        stream: bj.ResidualStream,
        rows: TokenRows,
        cache: Any,
    ) -> tuple[bj.OwedOutput, bj.ResidualStream, Any, jax.Array]:
        """`__call__`, also returning the residual stream entering this layer (an auxiliary
        hidden state, as EAGLE-3 drafting reads it) on the attention's rows.

        For layer i that is transformers' `output_hidden_states[i]`: the stack input (the
        embedding output) for layer 0, else the residual after layer i - 1's update. The sum
        the previous stage owes completes unfused before the attention's add + norm (the same
        collectives run); a residual on attention-TP slices is gathered for the capture.
        """
        h, stream, hidden = self.attn_boundary.prepare_captured(x, stream, gathered=True)
        x, stream, cache = self.run_stages(h, stream, rows, cache)
        return x, stream, cache, hidden
