"""The LoRA adapter: publishes which rows a stage's compute input holds, for LoRA execution.

A multi-LoRA batch names an adapter per token row. Those names (or any per-row values) come with
the batch on the attention's rows, where the token ids, positions and sequence ids are; a stage
may compute on other rows (an FFN over the full TP group on every attention-DP rank's rows, an
FFN on this rank's attention-TP slice). `lora_rows` moves the values the way the stage's
prepared input was moved, so row i of the values belongs to row i of the compute input:

    h, stream = boundary.prepare(x, stream)
    adapters = lora_rows(boundary, stream, rows.adapters)   # one per row of h
    y = compute(h, adapters)

It runs a row movement the plan already implies (an all-gather of the per-row values, a local
block slice), never a sum, and decides nothing: the stage's compute rows are bound.
"""

from __future__ import annotations

import jax

from .. import ops
from ..residual_stream.stream import ResidualStream, StreamState, require_stream
from ..stage import StageBoundary


def lora_rows(boundary: StageBoundary, stream: ResidualStream, values: jax.Array) -> jax.Array:
    """Per-row values of the attention's rows, moved onto the rows `boundary`'s stage computes on.

    Call it inside `shard_map`, between the stage's `prepare` and its `finish`, with the values
    of this rank's block of attention rows (as the batch's token rows hold them, whatever the
    batch variant).

    Args:
      boundary: The stage whose compute input the values must line up with.
      stream: The stream its `prepare` returned.
      values: [attention rows, ...] per-row values (e.g. int32 adapter indices).

    Returns:
      [compute rows, ...]: row i is the value of the compute input's row i.

    Raises:
      RuntimeError: The stage is not bound, or `stream` was not written by a `prepare` of the
        stages its `append_stages` call appended (and not finished since).
    """
    stream = require_stream(stream)
    if boundary.plan is None:
        raise RuntimeError(
            f"the stage appended at {boundary.call_site} is not bound yet: close its "
            "layer_stack() before running the model"
        )
    if stream.state is not StreamState.WRITTEN or stream.prepared_by != boundary.call_site:
        raise RuntimeError(
            f"lora_rows() of the stage appended at {boundary.call_site} needs the stream its "
            f"prepare() returned (state {stream.state.value}, prepared by "
            f"{stream.prepared_by}); call it between that stage's prepare() and finish()"
        )
    topology = boundary.plan.topology
    path = boundary.plan.path(stream.batch.variant)
    steps = ops.relayout(topology.attention_rows(), path.compute_layout, topology)
    return ops.run(steps, values)
