"""Two-batch overlap (TBO): one batch run as two microbatches, one communicating while the other
computes, in one program.

Each microbatch has its own residual stream, made by the handoff (`split_stream`) and rejoined by
`merge_streams`; a stream is never shared between them. `complete_now` is the operation-scheduled
exit: it completes the sum a stage's output owes at the exit, so no sum is left across a yield
point. `overlap_phases` runs the same list of phases on both microbatches, the second one phase
behind, and puts a yield point after every step: an `optimization_barrier` over both microbatches'
states. A barrier releases one microbatch's compute output (its collectives come next) together
with the other's compute input, so XLA's scheduler finds one's collectives beside the other's
compute, and the two microbatches' collectives stay ordered (never combined into one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..batch import BatchFacts
from ..finalize import DeferredFinalize
from ..layout import TokenAxis
from ..plan import OwedWork
from ..residual_stream.stream import (
    OwedOutput,
    ResidualStream,
    StreamState,
    StreamToken,
    require_stream,
)
from ..stage import StageBoundary

OWED_ACROSS_YIELD = "an owed sum left across a yield point"
MICROBATCHES = 2

Phase = Callable[[Any], Any]
"""One phase of a microbatch: its state in, its state out."""


class MicrobatchToken(StreamToken):
    """The identity of one microbatch's stream: which split made it, and which half it holds.

    Equal to every other stream token, as `StreamToken` is (one trace structure for all).

    Attributes:
      parent: The token of the stream the split took apart.
      index: 0 for the first half of the rows, 1 for the second.
    """

    __slots__ = ("parent", "index")

    def __init__(self, parent: StreamToken, index: int):
        self.parent = parent
        self.index = index

    def __repr__(self) -> str:
        return f"microbatch {self.index} of {self.parent!r}"


Microbatch = tuple[Any, ResidualStream]
"""A microbatch's `(output, stream)`: its layer output handle (or, before the stack entry, its raw
stack input) and its own stream."""


def split_stream(
    output: Any, stream: ResidualStream, batches: Sequence[BatchFacts]
) -> tuple[Microbatch, Microbatch]:
    """The handoff: splits a stream into two microbatch streams along its rows (first half,
    second half of each rank's block).

    An Initial stream splits its raw stack input `output` (which may still owe the stack input's
    sum: a row split commutes with it); a Written stream, or one whose pending contribution owes
    nothing, splits its residual and contribution, which must be on the same rows. Each half gets
    a stream of its own identity, so passing one microbatch's handle to the other's stream fails.

    Args:
      output: The stream's output handle, or an Initial stream's raw stack input [rows, hidden].
      stream: The stream to split; not used afterwards.
      batches: The two microbatches' batch facts (same variant and topology as the stream's),
        each describing its half of the rows.

    Returns:
      `((output_0, stream_0), (output_1, stream_1))`.

    Raises:
      RuntimeError: A stage is prepared and not finished, or the pending contribution owes a
        sum (complete it first: `complete_now`).
      ValueError: Not two batch facts of the stream's variant and topology, or rows that do not
        halve.
      NotImplementedError: The residual is on attention-TP slices (its halves would interleave
        the microbatches' rows): split the Initial stream instead.
    """
    stream = require_stream(stream)
    _check_batches(batches, stream.batch, "split_stream()")
    _check_at_yield(stream, "split_stream()")
    if stream.state is StreamState.INITIAL:
        if isinstance(output, OwedOutput):
            raise TypeError(f"an Initial stream splits its raw stack input; got {output!r}")
        first, second = _halves(jnp.asarray(output), "the stack input")
        return tuple(
            (half, dataclasses.replace(stream, batch=batch, token=MicrobatchToken(stream.token, i)))
            for i, (half, batch) in enumerate(zip((first, second), batches, strict=True))
        )
    stream.check_output(output)
    layout = stream.residual_layout
    if TokenAxis.ATTN_TP in layout.sharded:
        raise NotImplementedError(
            f"split_stream() of a residual on attention-TP slices ({layout}) would give each "
            "microbatch rows of the other; split the Initial stream (before the stack entry "
            "scatters the rows)"
        )
    pending = stream.pending
    if pending is not None and pending.placement.layout != layout:
        raise NotImplementedError(
            f"split_stream() needs the pending contribution on the residual's rows ({layout}); "
            f"got {pending.placement}. Complete it with complete_now() first"
        )
    residual = _halves(stream.residual, "the residual")
    read_state = _tree_halves(stream.read_state)
    contributions = (None, None)
    if pending is not None:
        value = _halves(pending.value, "the pending contribution")
        update_state = _tree_halves(pending.update_state)
        contributions = tuple(
            dataclasses.replace(pending, value=value[i], update_state=update_state[i])
            for i in range(MICROBATCHES)
        )
    halves = []
    for i, batch in enumerate(batches):
        half = dataclasses.replace(
            stream,
            residual=residual[i],
            pending=contributions[i],
            batch=batch,
            read_state=read_state[i],
            token=MicrobatchToken(stream.token, i),
        )
        halves.append((half.output, half))
    return tuple(halves)


def merge_streams(first: Microbatch, second: Microbatch, batch: BatchFacts) -> Microbatch:
    """Rejoins the two microbatch streams one `split_stream` made into one stream of the whole
    rows (the first microbatch's rows, then the second's).

    Args:
      first: `(output, stream)` of microbatch 0.
      second: `(output, stream)` of microbatch 1.
      batch: The batch facts of the merged rows (variant and topology of the microbatches').

    Returns:
      `(output, stream)`: the merged stream, with the identity of the stream that was split.

    Raises:
      ValueError: The streams are not the two halves of one split, in order (merging streams of
        different batches), or they are at different places in the stack.
      RuntimeError: Either stream owes a sum or has a stage prepared and not finished.
    """
    streams = []
    for output, stream in (first, second):
        stream = require_stream(stream)
        stream.check_output(output)
        _check_at_yield(stream, "merge_streams()")
        streams.append(stream)
    one, two = streams
    tokens = (one.token, two.token)
    if not (
        all(isinstance(t, MicrobatchToken) for t in tokens)
        and one.token.parent is two.token.parent
        and (one.token.index, two.token.index) == (0, 1)
    ):
        raise ValueError(
            f"merge_streams() takes microbatch 0 and microbatch 1 of one split_stream(), in "
            f"that order; got {tokens[0]!r} and {tokens[1]!r}: merging streams of different "
            "batches (or in the wrong order)"
        )
    _check_batches((batch,), one.batch, "merge_streams()")
    if one.state is StreamState.INITIAL or (one.state, one.rows, one.leave) != (
        two.state,
        two.rows,
        two.leave,
    ):
        raise ValueError(
            f"merge_streams() needs both microbatches written at the same place in the stack; "
            f"got {one!r} and {two!r}. Run both through the same stages first"
        )
    pending = None
    if one.pending is not None:
        a, b = one.pending, two.pending
        if (a.work, a.update_plain, a.transform) != (b.work, b.update_plain, b.transform):
            raise ValueError(
                f"merge_streams() needs both pending contributions from the same exit; got "
                f"{a.placement} and {b.placement}"
            )
        pending = dataclasses.replace(
            a,
            value=jnp.concatenate([a.value, b.value]),
            update_state=_tree_concat(a.update_state, b.update_state),
        )
    merged = dataclasses.replace(
        one,
        residual=jnp.concatenate([one.residual, two.residual]),
        pending=pending,
        batch=batch,
        read_state=_tree_concat(one.read_state, two.read_state),
        token=one.token.parent,
    )
    return merged.output, merged


def complete_now(
    boundary: StageBoundary, y: jax.Array, stream: ResidualStream
) -> tuple[OwedOutput, ResidualStream]:
    """The operation-scheduled exit: hands compute output `y` on with nothing owed.

    Where the stage's exit binds an option that completes the sum at the exit (an all-reduce, or
    a reduce-scatter the reduction policy allows, followed by the plain move back to the
    residual's rows), the first such option runs; otherwise the stage's preferred option runs
    and the owed sum is completed right after, onto the residual's rows (the bound unfused
    steps). The output transform applies once the value is complete. Never defers a sum to the
    next input and never hands off a finalize.

    Args:
      boundary: The stage whose compute produced `y`.
      y: [rows, hidden] compute output on the stage's compute rows (an array: a finalize is
        run by compute, not handed off).
      stream: The microbatch's stream, prepared by `boundary`.

    Returns:
      `(output, stream)`: a pending contribution complete on the residual's rows (or, at a
      stack exit whose residual is on finer rows, a written stream).

    Raises:
      TypeError: `y` is a `DeferredFinalize`.
    """
    if isinstance(y, DeferredFinalize):
        raise TypeError(
            f"complete_now() completes the output at the exit; the stage appended at "
            f"{boundary.call_site} returned a DeferredFinalize. Finalize inside compute"
        )
    decision = boundary.exit(stream)
    plain = tuple(o for o in decision.options if not o.defers_finalize)
    completing = tuple(o for o in plain if o.completes_now)
    decision = dataclasses.replace(decision, options=completing[:1] or plain[:1])
    output, stream = decision.finish(y, stream)
    pending = stream.pending
    if pending is None or (pending.placement.complete and not pending.work.onto_residual):
        return output, stream
    value, transform = pending.advance(pending.work.onto_residual)
    if transform is not None:
        value, transform = transform(value), None
    done = OwedWork.nothing(stream.residual_layout)
    return stream.with_pending(pending.moved(done, value, transform), stream.leave)


def yield_point(first: Any, second: Any) -> tuple[Any, Any]:
    """A TBO yield point between the microbatches' states: checks them, then orders them.

    Each state is any pytree holding the microbatch's stream(s) and arrays. The states pass
    through one `lax.optimization_barrier`, so what follows depends on everything before in both
    microbatches: the scheduler places the next step's collectives of one beside the next
    step's compute of the other, and never combines the two microbatches' collectives.

    A stream may cross a yield point with its stage prepared (the stage's compute output then
    crosses beside it, and its exit runs after the yield), never with a pending contribution
    that owes a sum.

    Raises:
      RuntimeError: A stream's pending contribution owes a sum (complete it first:
        `complete_now`).
      ValueError: Both microbatches hold the same stream.
    """
    tokens = []
    for state in (first, second):
        streams = _streams(state)
        for stream in streams:
            _check_owed(stream, "a TBO yield point")
        tokens.append([s.token for s in streams])
    shared = [t for t in tokens[0] if any(t is u for u in tokens[1])]
    if shared:
        raise ValueError(
            f"both microbatches hold the stream {shared[0]!r}: do not share one stream between "
            "interleaved microbatches; give each its own with split_stream()"
        )
    return lax.optimization_barrier((first, second))


def overlap_phases(
    phases: Sequence[Phase],
    states: tuple[Any, Any],
    *,
    scope: Callable[[int, int], str] | None = None,
) -> tuple[Any, Any]:
    """Runs `phases` on two microbatches, the second one phase behind the first, with a
    `yield_point` after every step.

    Step t runs phase t of microbatch 0, then phase t - 1 of microbatch 1: where the phases
    alternate between communication (a boundary's exit and the next entry) and compute, one
    microbatch communicates while the other computes. The microbatches share no state: each
    phase takes and returns one microbatch's.

    Args:
      phases: The phases every microbatch runs, in order.
      states: The two microbatches' initial states (e.g. from `split_stream`).
      scope: Names the `jax.named_scope` of (microbatch, phase), for reading the schedule;
        None: `microbatch_<m>`.

    Returns:
      `(state_0, state_1)` after every phase.
    """
    if scope is None:
        scope = _default_scope
    first, second = states
    count = len(phases)
    for step in range(count + 1):
        if step < count:
            with jax.named_scope(scope(0, step)):
                first = phases[step](first)
        if step > 0:
            with jax.named_scope(scope(1, step - 1)):
                second = phases[step - 1](second)
        if step < count:
            first, second = yield_point(first, second)
    return first, second


def _default_scope(microbatch: int, phase: int) -> str:
    del phase
    return f"microbatch_{microbatch}"


def _streams(state: Any) -> list[ResidualStream]:
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ResidualStream))
    return [leaf for leaf in leaves if isinstance(leaf, ResidualStream)]


def _check_owed(stream: ResidualStream, where: str) -> None:
    pending = stream.pending
    if pending is not None and not pending.placement.complete:
        raise RuntimeError(
            f"{OWED_ACROSS_YIELD}: at {where}, {stream!r} still owes "
            f"{pending.placement}; complete the sum before yielding (complete_now() at the "
            "exit, or the next stage's prepare())"
        )


def _check_at_yield(stream: ResidualStream, where: str) -> None:
    _check_owed(stream, where)
    if stream.prepared_by is not None:
        raise RuntimeError(
            f"{where} of a stream the stage appended at {stream.prepared_by} prepared and has "
            "not finished; split or merge between stages"
        )


def _check_batches(batches: Sequence[BatchFacts], like: BatchFacts, where: str) -> None:
    expected = 1 if where == "merge_streams()" else MICROBATCHES
    if len(batches) != expected or not all(isinstance(b, BatchFacts) for b in batches):
        raise ValueError(
            f"{where} takes {expected} BatchFacts; got {[type(b).__name__ for b in batches]}"
        )
    for batch in batches:
        if (batch.variant, batch.topology) != (like.variant, like.topology):
            raise ValueError(
                f"{where}: every microbatch is a {like.variant.value} batch on {like.topology}; "
                f"got a {batch.variant.value} batch on {batch.topology}"
            )


def _halves(value: jax.Array, what: str) -> tuple[jax.Array, jax.Array]:
    rows = value.shape[0]
    if rows % MICROBATCHES:
        raise ValueError(
            f"a two-batch split halves each rank's rows; {what} has {rows=}. Pad each rank's "
            "block to an even number of rows"
        )
    return value[: rows // 2], value[rows // 2 :]


def _tree_halves(tree: Any) -> tuple[Any, Any]:
    if tree is None:
        return None, None
    leaves, structure = jax.tree.flatten(tree)
    pairs = [_halves(leaf, "the read state") for leaf in leaves]
    return tuple(
        jax.tree.unflatten(structure, [pair[i] for pair in pairs]) for i in range(MICROBATCHES)
    )


def _tree_concat(first: Any, second: Any) -> Any:
    if first is None:
        return None
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), first, second)
