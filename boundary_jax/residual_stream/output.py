"""Reaching into a layer's output while the stream still holds it: complete what it owes, fold it
into the residual, read the updated residual on a copy, or add an extra contribution to it.

Each helper takes the output handle and the stream it came from, and runs only steps that binding
recorded with the pending contribution (its `OwedWork`).
"""

from __future__ import annotations

import jax

from .. import ops
from ..designs.add_norm import PlainAdd
from ..plan import OwedWork
from .stream import (
    Carried,
    Contribution,
    OwedOutput,
    ResidualStream,
    StreamState,
    require_output_of,
    require_stream,
)


def complete_output(
    output: OwedOutput, stream: ResidualStream
) -> tuple[OwedOutput, ResidualStream]:
    """Completes what the pending contribution owes (finalize, then sums), on its rows; the
    update stays pending."""
    stream = require_output_of(output, stream)
    pending = stream.pending
    if pending is None or pending.placement.complete:
        return stream.output, stream
    value, transform = pending.advance(pending.work.in_place)
    return stream.with_pending(pending.moved(pending.work.then, value, transform), stream.leave)


def fold(output: OwedOutput, stream: ResidualStream) -> tuple[OwedOutput, ResidualStream]:
    """Completes the pending contribution and folds it into the residual: the stream is Written."""
    stream = require_output_of(output, stream)
    if stream.pending is None:
        return stream.output, stream
    pending = stream.pending
    residual = pending.apply(stream.residual, pending.completed_on_residual_rows())
    return stream.written(residual, stream.rows, leave=stream.leave)


def snapshot(output: OwedOutput, stream: ResidualStream) -> jax.Array:
    """The updated residual on the residual's rows, computed on a copy: the stream still owes
    its work.

    Raises:
      NotImplementedError: The pending update is not a plain add, or the pending output hands
        its finalize on (a handoff needs an explicit capture adapter).
    """
    stream = require_output_of(output, stream)
    pending = stream.pending
    if pending is None:
        return stream.residual
    if not pending.update_plain:
        raise NotImplementedError(
            "snapshot requires a plain residual update; got "
            f"{type(pending.update.resolve()).__name__}"
        )
    if pending.placement.finalize:
        raise NotImplementedError(
            "snapshot of a pending MoE finalize handoff is not supported; complete_output() "
            "runs the unfused finalize first"
        )
    return pending.apply(stream.residual, pending.completed_on_residual_rows())


def add_to_output(
    output: OwedOutput, stream: ResidualStream, extra: jax.Array
) -> tuple[OwedOutput, ResidualStream]:
    """Adds `extra` (on the residual's rows) to the layer output once, after completing what it
    owes.

    The residual update stays pending; the next boundary applies it.
    """
    stream = require_output_of(output, stream)
    if stream.state is StreamState.INITIAL:
        raise RuntimeError(f"add_to_output() needs a written or pending stream ({stream!r})")
    if extra.shape != stream.residual.shape:
        raise ValueError(
            f"extra must be on the residual's rows, shape {stream.residual.shape}; "
            f"got {extra.shape}"
        )
    done = OwedWork.nothing(stream.residual_layout)
    pending = stream.pending
    if pending is None:
        contribution = Contribution(extra, None, Carried(PlainAdd()), None, done, True)
    else:
        value = pending.completed_on_residual_rows()
        contribution = pending.moved(done, value + extra.astype(value.dtype), None)
    return stream.with_pending(contribution, stream.leave)


def onto_residual_rows(x: jax.Array, stream: ResidualStream) -> jax.Array:
    """`x` on the attention's rows (this DP rank's block, alike on every attention-TP rank),
    moved onto the stream's residual rows: for `add_to_output`'s `extra` (e.g. deepstack
    visual features computed per token) where the residual is on attention-TP slices.

    A local slice, no communication; `x` is returned as is where the residual is on the
    attention's rows.

    Raises:
      RuntimeError: The stream is Initial (it has no residual rows yet).
    """
    stream = require_stream(stream)
    if stream.state is StreamState.INITIAL:
        raise RuntimeError(f"onto_residual_rows() needs a written or pending stream ({stream!r})")
    return ops.run(stream.rows.from_attention, x)
