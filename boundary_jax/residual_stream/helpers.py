"""Residual helpers a model calls around its layers: start, leave, and reach into the stream.

Each helper takes the layer output handle and the stream, and returns what it produces; a helper
that keeps the stream alive returns the new stream too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.compat import zeros_varying_like

from .. import ops
from ..batch import BatchFacts
from ..declare import EdgeKind
from ..designs.add_norm import PlainAdd
from ..designs.protocols import Norm
from ..finalize import DeferredFinalize
from ..layout import TokenAxis, Topology
from ..plan import Leave, OwedWork, ResidualRows
from .entry import run_entry
from .stream import (
    WRITE_FIRST,
    Carried,
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
    """Completes what the pending contribution owes (finalize, then sums), on its rows; the
    update stays pending."""
    stream = _checked(output, stream)
    pending = stream.pending
    if pending is None or pending.placement.complete:
        return stream.output, stream
    value, transform = pending.advance(pending.work.in_place)
    return stream.with_pending(pending.moved(pending.work.then, value, transform), stream.leave)


def fold(output: OwedOutput, stream: ResidualStream) -> tuple[OwedOutput, ResidualStream]:
    """Completes the pending contribution and folds it into the residual: the stream is Written."""
    stream = _checked(output, stream)
    if stream.pending is None:
        return stream.output, stream
    residual = stream.pending.apply(stream.residual, _completed_on_residual_rows(stream))
    return stream.written(residual, stream.rows, leave=stream.leave)


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


def take_output(output: OwedOutput, stream: ResidualStream) -> jax.Array:
    """Releases the stream at a terminal exit whose output is written; returns it on the
    attention's rows.

    Raises:
      RuntimeError: A contribution is still pending (fold or norm it first), or the stream has
        not passed the stack's terminal stage.
    """
    stream = _checked(output, stream)
    if stream.state is not StreamState.WRITTEN:
        raise RuntimeError(f"{WRITE_FIRST} ({stream!r})")
    return ops.run(_leave(stream, None, "take_output()").entry(None).move_input, stream.residual)


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


def snapshot(output: OwedOutput, stream: ResidualStream) -> jax.Array:
    """The updated residual on the residual's rows, computed on a copy: the stream still owes
    its work.

    Raises:
      NotImplementedError: The pending update is not a plain add, or the pending output hands
        its finalize on (a handoff needs an explicit capture adapter).
    """
    stream = _checked(output, stream)
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
    return pending.apply(stream.residual, _completed_on_residual_rows(stream))


def add_to_output(
    output: OwedOutput, stream: ResidualStream, extra: jax.Array
) -> tuple[OwedOutput, ResidualStream]:
    """Adds `extra` (on the residual's rows) to the layer output once, after completing what it
    owes.

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
    done = OwedWork.nothing(stream.residual_layout)
    pending = stream.pending
    if pending is None:
        contribution = Contribution(extra, None, Carried(PlainAdd()), None, done, True)
    else:
        value = _completed_on_residual_rows(stream)
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


@dataclasses.dataclass(frozen=True)
class FinalizeRequest:
    """What a fused finalize norm is asked to do: `norm(residual + sum(finalize(handoff)))`.

    Attributes:
      handoff: The sparse FFN's `DeferredFinalize`, on the residual's rows.
      residual: The residual on the same rows.
      norm: The final norm.
      sum_axes: Token axes the finalized value still owes a sum over.
      topology: The topology the stack is bound on: it names the mesh axes of `sum_axes`.
    """

    handoff: DeferredFinalize
    residual: jax.Array
    norm: Norm | None
    sum_axes: tuple[TokenAxis, ...]
    topology: Topology

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Mesh axis names of `sum_axes`, for a kernel's collective."""
        return self.topology.mesh_names(self.sum_axes)


def final_norm(
    output: OwedOutput,
    stream: ResidualStream,
    norm: Norm | None,
    *,
    skip_empty: bool = False,
    finalize_norm: Callable[[FinalizeRequest], jax.Array] | None = None,
) -> jax.Array:
    """Leaves the stack through its final read: completes what is owed, applies the update, and
    reads (by default add + RMSNorm with `norm`).

    Returns the stack output on the attention's rows; rows past a DP rank's token count are zero.
    With `skip_empty`, a rank without tokens still runs every collective (the other ranks join
    them) and skips only the read. A MoE finalize handed to the final read goes to
    `finalize_norm` (a fused finalize + sum + add + norm) when given, else to the stack's
    fusion provider's `final_input` candidates; where none takes it, it completes unfused.
    """
    return _final_read(output, stream, norm, skip_empty, finalize_norm, capture=False)[0]


def final_norm_captured(
    output: OwedOutput, stream: ResidualStream, norm: Norm | None, *, skip_empty: bool = False
) -> tuple[jax.Array, jax.Array]:
    """`final_norm`, also returning the updated residual it normalizes (the last auxiliary
    hidden state), on the attention's rows.

    The owed sum completes unfused first, and a finalize handoff completes unfused (there is no
    fused finalize norm when the residual is captured).
    """
    return _final_read(output, stream, norm, skip_empty, None, capture=True)


def _final_read(output, stream, norm, skip_empty, finalize_norm, *, capture: bool):
    stream = _checked(output, stream)
    leave = _leave(stream, EdgeKind.STACK_EXIT, "final_norm()")
    pending = stream.pending
    entry = leave.entry(None if pending is None else pending.placement)

    def read():
        fused = pending is not None and pending.placement.finalize and finalize_norm is not None
        if fused and not entry.move_input:
            request = FinalizeRequest(
                pending.value,
                stream.residual,
                norm,
                pending.placement.owed,
                stream.batch.topology,
            )
            return finalize_norm(request), None
        normed, residual, _ = run_entry(
            entry,
            stream.residual,
            pending,
            leave.final_read,
            norm,
            candidates=() if capture else leave.final_fusions,
            topology=stream.batch.topology,
            fuse_sum=not capture,
        )
        return normed, ops.run(entry.move_input, residual) if capture else None

    if skip_empty and stream.batch.token_counts is not None:
        result = jax.eval_shape(read)
        normed, residual = lax.cond(
            stream.batch.has_tokens(),
            read,
            lambda: jax.tree.map(zeros_varying_like, result),
        )
    else:
        normed, residual = read()
    mask = stream.batch.valid_rows(normed.shape[0])
    if mask is not None:
        normed = jnp.where(mask[:, None], normed, jnp.zeros((), normed.dtype))
    return normed, residual


def to_pp(output: OwedOutput, stream: ResidualStream) -> dict[str, jax.Array]:
    """Hands the stream to the next pipeline rank as a plain pytree, every owed item complete.

    Completes the pending contribution's finalize and sums on this rank (a partial sum must
    never travel: the transport reassembles a tensor from one slice per attention-TP rank). When
    the residual is on the attention's rows and the update is plain, sends
    `{"hidden_states": completed output, "residual": residual}` for the receiver's fused update
    + read; otherwise folds the output into the residual here and sends
    `{"hidden_states": residual}` alone. Both are on the attention's rows.

    Raises:
      RuntimeError: The stream has not passed the stage before this rank's pipeline send.
    """
    stream = _checked(output, stream)
    leave = _leave(stream, EdgeKind.PIPELINE_SEND, "to_pp()")
    residual, pending = stream.residual, stream.pending
    if pending is not None:
        value = _completed_on_residual_rows(stream)
        if not leave.sends_written:
            return {"hidden_states": value, "residual": residual}
        residual = pending.apply(residual, value)
    return {"hidden_states": ops.run(leave.entry(None).move_input, residual)}


_WAYS_OUT = {
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


def _leave(stream: ResidualStream, kind: EdgeKind | None = None, helper: str = "") -> Leave:
    """The bound way out of a stream that a stage has exited (by `kind`, when given)."""
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
        raise RuntimeError(f"{helper} after {_WAYS_OUT[stream.leave.kind]}")
    return stream.leave


def _checked(output: Any, stream: Any) -> ResidualStream:
    stream = require_stream(stream)
    if stream.state is not StreamState.INITIAL:
        stream.check_output(output)
    return stream


def _completed_on_residual_rows(stream: ResidualStream) -> jax.Array:
    pending = stream.pending
    value, transform = pending.advance(pending.work.onto_residual)
    return value if transform is None else transform(value)
