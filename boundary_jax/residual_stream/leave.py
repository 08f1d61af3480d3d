"""Leaving the stack: the bound way out a stream has after its last stage, and `take_output`.

Every stage's exit records on the stream how the stack may be left after it (`Leave`); the final
read (`final_norm`), a pipeline send (`to_pp`) and `take_output` each check here that they are
the way out binding chose, then run its steps.
"""

from __future__ import annotations

import jax

from .. import ops
from ..declare import EdgeKind
from ..plan import Leave
from .stream import WRITE_FIRST, OwedOutput, ResidualStream, StreamState, require_output_of

WAYS_OUT = {
    EdgeKind.STACK_EXIT: (
        "the model's terminal stage: there is no next pipeline rank; leave through final_norm()"
    ),
    EdgeKind.PIPELINE_SEND: (
        "a stage that leaves by a pipeline send: this rank's stack continues on the next "
        "pipeline rank; leave through to_pp()"
    ),
    EdgeKind.NEXT_STAGE: (
        "a stage that is not the stack's last: run every layer of the stack first (take_output "
        "may leave anywhere, once the stream is written)"
    ),
    EdgeKind.BRANCH_MERGE: (
        "a branch's last stage: a branch's stream merges back into the stream it forked from "
        "through branch_output() and merge_branch()"
    ),
}
"""What to do instead, by the edge the stream's last stage really leaves by."""


def way_out(stream: ResidualStream, kind: EdgeKind | None = None, helper: str = "") -> Leave:
    """The bound way out of a stream that a stage has exited (by `kind`, when given).

    Args:
      stream: The stream to leave.
      kind: The edge `helper` leaves by; None accepts any.
      helper: The caller's name, for messages (e.g. "final_norm()").

    Raises:
      RuntimeError: The stream is Initial, has an open branch or is a branch's stream, no stage
        has exited it, or its last stage leaves by another edge than `kind`.
    """
    if stream.state is StreamState.INITIAL:
        raise RuntimeError(f"{WRITE_FIRST} ({stream!r})")
    stream.require_merged(helper or "leaving the stack")
    if stream.forked_from is not None:
        raise RuntimeError(
            f"{helper or 'leaving the stack'} on a branch's stream: it merges back into the "
            "stream it forked from through branch_output() and merge_branch()"
        )
    if stream.leave is None:
        raise RuntimeError(
            f"leaving the stack needs a stream a stage has exited; run a stage's finish() first "
            f"({stream!r})"
        )
    if kind is not None and stream.leave.kind is not kind:
        raise RuntimeError(f"{helper} after {WAYS_OUT[stream.leave.kind]}")
    return stream.leave


def take_output(output: OwedOutput, stream: ResidualStream) -> jax.Array:
    """Releases the stream at a terminal exit whose output is written; returns it on the
    attention's rows.

    Raises:
      RuntimeError: A contribution is still pending (fold or norm it first), or the stream has
        not passed the stack's terminal stage.
    """
    stream = require_output_of(output, stream)
    if stream.state is not StreamState.WRITTEN:
        raise RuntimeError(f"{WRITE_FIRST} ({stream!r})")
    return ops.run(way_out(stream, None, "take_output()").entry(None).move_input, stream.residual)
