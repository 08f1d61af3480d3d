"""Branches: side paths that start from the input a source stage has already prepared and merge
back into the source's output (LongCat-Flash's dense path beside its shortcut MoE).

A branch is appended with `append_stages(..., prepared_from=source)`; binding gives its first
stage a `BranchFork` and its last a `BranchMerge` (`bind.bind_fork`, `bind.bind_merge`). A layer
runs it functionally, each call taking the streams and returning them:

    h, stream = source.prepare(x, stream)
    g, stream, branch = branch_input(first, source, h, stream)   # fork: no second norm
    y, stream = source.finish(source_compute(h), stream)
    y_b, branch = first.finish(first_compute(g), branch)          # ... the branch's stages ...
    y_b, branch = branch_output(last, y_b, branch)
    y, stream = merge_branch(y, stream, y_b, branch)

The branch's residual holds the residual it forked from, so the merged stream takes the branch's
residual in place of the source's, and the source's output stays pending on it: the next input
completes and adds it as if no branch had run. These functions run bound steps only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from .. import ops
from ..residual_stream.output import fold
from ..residual_stream.stream import (
    Contribution,
    ForkedFrom,
    OpenBranch,
    OwedOutput,
    ResidualStream,
    StreamState,
    StreamToken,
    require_stream,
)
from ..stage import StageBoundary

OTHER_STREAM = "merge_branch() merges a branch into the stream it forked from"


def _path(boundary: StageBoundary, stream: ResidualStream):
    if boundary.plan is None:
        raise RuntimeError(
            f"the stage appended at {boundary.call_site} is not bound yet: close its "
            "layer_stack() before running the model"
        )
    return boundary.plan.path(stream.batch.variant)


def branch_input(
    boundary: StageBoundary, source: StageBoundary, x: Any, stream: ResidualStream
) -> tuple[Any, ResidualStream, ResidualStream]:
    """Enters a branch's first stage from the input its source has prepared, forking the stream.

    Call it after `source.prepare()` and before the source's `finish()`. The source's compute
    input and the residual it wrote move onto the branch's rows as they are: the branch's first
    norm is never applied.

    Args:
      boundary: The branch's first stage (appended with `prepared_from=source`).
      source: The stage whose prepared input the branch starts from.
      x: The source's compute input, as `source.prepare` returned it.
      stream: The stream the source prepared.

    Returns:
      `(branch_input, stream, branch_stream)`: the first stage's compute input, the stream
      (recording the open branch: it cannot leave or enter another stage until the branch
      merges) and the branch's own stream, prepared for the first stage's exit.

    Raises:
      TypeError: `boundary` is not a branch's first stage, or `x` is a boundary handle.
      RuntimeError: The stream is not the one `source` prepared and has not finished.
      ValueError: The branch was appended from another source.
    """
    stream = require_stream(stream)
    path = _path(boundary, stream)
    if path.fork is None:
        raise TypeError(
            f"branch_input() enters a branch's first stage; the stage appended at "
            f"{boundary.call_site} is entered through "
            f"{boundary.plan.declaration.place.incoming.kind.value}"
        )
    if isinstance(x, OwedOutput):
        raise TypeError(
            "branch_input() takes the source's compute input, as source.prepare() returned it; "
            f"got a boundary handle {x!r}"
        )
    if boundary.plan.declaration.place.incoming.producer != source.declaration.facts():
        raise ValueError(
            f"the branch appended at {boundary.call_site} starts from another source than the "
            f"stage appended at {source.call_site}; pass the boundary named by its prepared_from"
        )
    if stream.state is not StreamState.WRITTEN or stream.prepared_by != source.call_site:
        raise RuntimeError(
            f"branch_input() takes the input the stage appended at {source.call_site} has "
            f"prepared: call it after that stage's prepare() and before its finish() ({stream!r})"
        )
    fork = path.fork
    token = StreamToken()
    branch = dataclasses.replace(
        stream,
        residual=ops.run(fork.residual_move, stream.residual),
        pending=None,
        read_state=None,
        token=token,
        rows=path.residual_rows,
        leave=None,
        prepared_by=boundary.call_site,
        branches=(),
        forked_from=ForkedFrom(stream.token, source.call_site),
    )
    stream = dataclasses.replace(
        stream, branches=stream.branches + (OpenBranch(token, boundary.call_site),)
    )
    return ops.move_rows(fork.input_move, x), stream, branch


def branch_output(
    boundary: StageBoundary, output: OwedOutput, stream: ResidualStream
) -> tuple[OwedOutput, ResidualStream]:
    """Readies a branch's output for its merge, after its last stage's `finish()`.

    Where the merge can take the branch's handoff unsummed (its source hands on the same owed
    work on the same rows), it stays pending and the merge's one completion completes both;
    otherwise the sum it owes completes here, onto the branch's residual rows, and folds into
    the branch's residual. It never completes twice.

    Args:
      boundary: The branch's last stage.
      output: The handle its `finish()` returned.
      stream: The branch's stream.

    Returns:
      `(output, stream)` to pass to `merge_branch`.

    Raises:
      TypeError: `stream` is not a branch's stream, or `boundary` not a branch's last stage.
      RuntimeError: The branch's last stage has not finished, or this ran twice.
    """
    stream = require_stream(stream)
    if stream.forked_from is None:
        raise TypeError(
            f"branch_output() takes a branch's stream (from branch_input()); got {stream!r}"
        )
    path = _path(boundary, stream)
    if path.merge is None:
        raise TypeError(
            f"branch_output() follows a branch's last stage; the stage appended at "
            f"{boundary.call_site} leaves by {boundary.plan.declaration.place.outgoing.kind.value}"
        )
    if stream.forked_from.output_taken:
        raise RuntimeError(f"branch_output() ran twice on the same branch ({stream!r})")
    stream.check_output(output)
    if stream.prepared_by is not None or stream.leave not in {o.leave for o in path.exits}:
        raise RuntimeError(
            f"branch_output() follows the finish() of the branch's last stage, appended at "
            f"{boundary.call_site} ({stream!r})"
        )
    pending = stream.pending
    if pending is not None and pending.placement not in path.merge.defers:
        output, stream = fold(output, stream)
    stream = dataclasses.replace(
        stream, forked_from=dataclasses.replace(stream.forked_from, merge=path.merge)
    )
    return stream.output, stream


def merge_branch(
    output: OwedOutput,
    stream: ResidualStream,
    branch_output: OwedOutput,
    branch: ResidualStream,
) -> tuple[OwedOutput, ResidualStream]:
    """Merges a branch back into the stream it forked from, after the source's `finish()`.

    The merged residual is the branch's (which holds the residual it forked from, with the
    branch's outputs added), moved onto the source's residual rows; the source's output stays
    pending, with the branch's deferred output added to it where `branch_output` left one.

    Args:
      output: The source's output handle (from its `finish()`).
      stream: The stream the branch forked from.
      branch_output: The handle `branch_output` returned.
      branch: The branch's stream, as `branch_output` returned it.

    Returns:
      `(output, stream)`: the merged output, for the source's consumer (or the final norm).

    Raises:
      ValueError: The branch forked from another stream.
      RuntimeError: `branch_output` has not run, or the source has not finished or its output
        was folded into the residual.
      TypeError: `branch` is not a branch's stream.
    """
    stream, branch = require_stream(stream), require_stream(branch)
    fork = branch.forked_from
    if fork is None:
        raise TypeError(
            f"merge_branch() takes a branch's stream (from branch_input()); got {branch!r}"
        )
    if fork.token is not stream.token or not any(b.token is branch.token for b in stream.branches):
        raise ValueError(
            f"{OTHER_STREAM}; this branch (from the source appended at {fork.source}) forked "
            f"from another stream ({branch!r} into {stream!r})"
        )
    if not fork.output_taken:
        raise RuntimeError(
            "merge_branch() takes the branch's output from branch_output(), which runs after the "
            f"branch's last stage's finish() ({branch!r})"
        )
    branch.check_output(branch_output)
    stream.check_output(output)
    pending = stream.pending
    if stream.prepared_by is not None or pending is None:
        raise RuntimeError(
            f"merge_branch() merges into the output of the branch's source (appended at "
            f"{fork.source}), pending after its finish() and not folded: the branch's residual "
            f"already holds the residual it forked from ({stream!r})"
        )
    merge = fork.merge
    if merge.into != stream.residual_layout:
        raise RuntimeError(
            f"the branch merges onto a residual on {merge.into}, but the stream's is on "
            f"{stream.residual_layout}; merge it into the stream its source prepared"
        )
    deferred = branch.pending
    if deferred is not None and not _adds(deferred, pending, merge.defers):
        branch_output, branch = fold(branch_output, branch)
        deferred = None
    residual, pending = _combine(
        stream.residual,
        ops.run(merge.residual_move(branch.residual_layout), branch.residual),
        pending,
        deferred,
    )
    merged = dataclasses.replace(
        stream,
        residual=residual,
        pending=pending,
        branches=tuple(b for b in stream.branches if b.token is not branch.token),
    )
    return merged.output, merged


def _adds(deferred: Contribution, pending: Contribution, defers) -> bool:
    """Whether the branch's deferred output adds unsummed to the source's pending output: the
    bound merge defers its placement and the source's output owes the same."""
    return (
        deferred.placement in defers
        and deferred.placement == pending.placement
        and isinstance(pending.value, jax.Array)
        and pending.transform is None
    )


def _combine(
    residual: jax.Array,
    branch_residual: jax.Array,
    pending: Contribution,
    deferred: Contribution | None,
) -> tuple[jax.Array, Contribution]:
    """The merged residual and pending output: the branch's residual (which holds the stream's
    `residual` it forked from, so it takes its place) and the source's output, plus the branch's
    deferred output owing the same work (completed once, with the source's)."""
    if branch_residual.shape != residual.shape:
        raise RuntimeError(
            f"the branch's residual {branch_residual.shape} is not on the stream's residual rows "
            f"{residual.shape}; this is a binding bug: report it with the stack's declarations"
        )
    if deferred is None:
        return branch_residual, pending
    return branch_residual, pending.moved(
        pending.work, pending.value + deferred.value, pending.transform
    )
