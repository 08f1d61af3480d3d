"""Residual helpers a model calls around its layers: start, leave, and reach into the stream.

Each helper takes the layer output handle and the stream, and returns what it produces; a helper
that keeps the stream alive returns the new stream too.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import ops
from .._compat import zeros_varying_like
from ..batch import BatchFacts
from ..contracts import Placement
from .add_norm import AddNormRead, PlainAdd
from .protocols import Norm
from .stream import (
    WRITE_FIRST,
    Contribution,
    OwedOutput,
    ResidualStream,
    StreamState,
    require_stream,
)


def start(batch: BatchFacts) -> ResidualStream:
    """A fresh stream for one microbatch, in the Initial state; call once, before layer 0."""
    if not isinstance(batch, BatchFacts):
        raise TypeError(f"start() takes the batch's BatchFacts; got {type(batch).__name__}")
    return ResidualStream.initial(batch)


def complete_output(
    output: OwedOutput, stream: ResidualStream
) -> tuple[OwedOutput, ResidualStream]:
    """Completes the sum the pending contribution owes, on its rows; the update stays pending."""
    stream = _checked(output, stream)
    pending = stream.pending
    if pending is None or pending.placement.complete:
        return stream.output, stream
    value, transform = pending.advance(ops.all_reduce(pending.placement.owed))
    return stream.with_pending(
        Contribution(value, transform, pending.placement.completed(), pending.update)
    )


def fold(output: OwedOutput, stream: ResidualStream) -> tuple[OwedOutput, ResidualStream]:
    """Completes the pending contribution and folds it into the residual: the stream is Written."""
    stream = _checked(output, stream)
    if stream.pending is None:
        return stream.output, stream
    value = _completed_on_residual_rows(stream)
    residual = stream.pending.update.apply(stream.residual, value)
    return stream.written(residual, stream.residual_layout)


def set_written(hidden: jax.Array, stream: ResidualStream) -> tuple[OwedOutput, ResidualStream]:
    """Replaces the stream with a Written one whose residual is `hidden`.

    For compute that produced the full residual itself. Any pending contribution is discarded:
    call `fold()` first when one may be pending. `hidden` is on the stream's residual rows, or on
    the attention's rows for a stream not written yet.
    """
    stream = require_stream(stream)
    if isinstance(hidden, OwedOutput):
        raise TypeError("set_written() takes the residual tensor; fold() handles an OwedOutput")
    layout = stream.residual_layout or stream.batch.topology.attention_rows()
    if stream.residual is not None and hidden.shape != stream.residual.shape:
        raise ValueError(
            f"set_written() needs the residual's shape {stream.residual.shape}; got {hidden.shape}"
        )
    return stream.written(hidden, layout)


def take_output(output: OwedOutput, stream: ResidualStream) -> jax.Array:
    """Releases the stream at a terminal exit whose output is written; returns it on the
    attention's rows.

    Raises:
      RuntimeError: A contribution is still pending (fold or norm it first).
    """
    stream = _checked(output, stream)
    if stream.state is not StreamState.WRITTEN:
        raise RuntimeError(f"{WRITE_FIRST} ({stream!r})")
    topology = stream.batch.topology
    move = ops.relayout(stream.residual_layout, topology.attention_rows(), topology)
    return ops.run(move, stream.residual)


def snapshot(output: OwedOutput, stream: ResidualStream) -> jax.Array:
    """The updated residual on the residual's rows, computed on a copy: the stream still owes
    its work.

    Raises:
      NotImplementedError: The pending update is not a plain add.
    """
    stream = _checked(output, stream)
    pending = stream.pending
    if pending is None:
        return stream.residual
    if not pending.update.plain:
        raise NotImplementedError(
            f"snapshot requires a plain residual update; got {type(pending.update).__name__}"
        )
    return pending.update.apply(stream.residual, _completed_on_residual_rows(stream))


def add_to_output(
    output: OwedOutput, stream: ResidualStream, extra: jax.Array
) -> tuple[OwedOutput, ResidualStream]:
    """Adds `extra` (on the residual's rows) to the layer output once, after completing its sum.

    The residual update stays pending; the next boundary applies it.
    """
    stream = _checked(output, stream)
    if stream.state is StreamState.INITIAL:
        raise RuntimeError(f"add_to_output() needs a written or pending stream ({stream!r})")
    if extra.shape != stream.residual.shape:
        raise ValueError(
            f"extra must be on the residual's rows, shape {stream.residual.shape}; "
            f"got {extra.shape}"
        )
    if stream.pending is None:
        value, update = extra, PlainAdd()
    else:
        value = _completed_on_residual_rows(stream) + extra.astype(stream.pending.value.dtype)
        update = stream.pending.update
    return stream.with_pending(Contribution(value, None, Placement(stream.residual_layout), update))


def final_norm(
    output: OwedOutput, stream: ResidualStream, norm: Norm | None, *, skip_empty: bool = False
) -> jax.Array:
    """Leaves the stack: completes what is owed, applies the update and normalizes.

    Returns the stack output on the attention's rows; rows past a DP rank's token count are zero.
    With `skip_empty`, a rank without tokens still runs every collective (the other ranks join
    them) and skips only the norm.
    """
    stream = _checked(output, stream)
    if stream.state is StreamState.INITIAL:
        raise RuntimeError(f"{WRITE_FIRST} ({stream!r})")
    topology = stream.batch.topology
    rows = stream.batch.topology.attention_rows()
    move = ops.relayout(stream.residual_layout, rows, topology)
    read = AddNormRead()
    if stream.pending is not None and not move:
        value = _completed_on_residual_rows(stream)

        def normalize():
            return read.update_and_read(stream.pending.update, value, stream.residual, norm)[0]
    else:
        residual = stream.residual
        if stream.pending is not None:
            residual = stream.pending.update.apply(residual, _completed_on_residual_rows(stream))
        residual = ops.run(move, residual)

        def normalize():
            return read.read(residual, norm)[0]

    if skip_empty and stream.batch.token_counts is not None:
        result = jax.eval_shape(normalize)
        normed = lax.cond(stream.batch.has_tokens(), normalize, lambda: zeros_varying_like(result))
    else:
        normed = normalize()
    mask = stream.batch.valid_rows(normed.shape[0])
    if mask is not None:
        normed = jnp.where(mask[:, None], normed, jnp.zeros((), normed.dtype))
    return normed


def _checked(output: Any, stream: Any) -> ResidualStream:
    stream = require_stream(stream)
    if stream.state is not StreamState.INITIAL:
        stream.check_output(output)
    return stream


def _completed_on_residual_rows(stream: ResidualStream) -> jax.Array:
    pending = stream.pending
    steps = ops.complete_onto(pending.placement, stream.residual_layout, stream.batch.topology)
    value, transform = pending.advance(steps)
    return value if transform is None else transform(value)
