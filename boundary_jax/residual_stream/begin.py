"""Beginning a stream: a fresh one for a microbatch, one written with a given residual, or the
next pass over a looped stack."""

from __future__ import annotations

import jax

from ..batch import BatchFacts
from ..designs.protocols import Norm
from ..plan import ResidualRows
from .leave import take_output
from .output import fold
from .stream import OwedOutput, ResidualStream, require_stream


def start(batch: BatchFacts) -> ResidualStream:
    """A fresh stream for one microbatch, in the Initial state; call once, before layer 0."""
    if not isinstance(batch, BatchFacts):
        raise TypeError(f"start() takes the batch's BatchFacts; got {type(batch).__name__}")
    return ResidualStream.initial(batch)


def set_written(hidden: jax.Array, stream: ResidualStream) -> tuple[OwedOutput, ResidualStream]:
    """Replaces the stream with a Written one whose residual is `hidden`.

    For compute that produced the full residual itself. Any pending contribution is discarded:
    call `fold()` first when one may be pending. `hidden` is on the stream's residual rows, or on
    the attention's rows for a stream not written yet.
    """
    stream = require_stream(stream)
    if isinstance(hidden, OwedOutput):
        raise TypeError("set_written() takes the residual tensor; fold() handles an OwedOutput")
    rows = stream.rows or ResidualRows.attention(stream.batch.topology)
    if stream.residual is not None and hidden.shape != stream.residual.shape:
        raise ValueError(
            f"set_written() needs the residual's shape {stream.residual.shape}; got {hidden.shape}"
        )
    return stream.written(hidden, rows, leave=stream.leave)


def next_pass(
    output: OwedOutput, stream: ResidualStream, loop_norm: Norm | None = None
) -> tuple[OwedOutput, ResidualStream]:
    """Starts another pass over the same layers (a looped stack, as Nanbeige's).

    Folds what is pending into the residual, brings it to the attention's rows, applies the
    loop norm when given, and starts a new stream written with it: the stack's first stage
    then enters from that written stream without `init_residual`. Call after the stack's last
    stage, in place of `final_norm`, between passes.
    """
    output, stream = fold(output, stream)
    hidden = take_output(output, stream)
    if loop_norm is not None:
        hidden = loop_norm(hidden)
    return set_written(hidden, start(stream.batch))
