"""Runs one bound entry path: complete what the producer owes, update the residual, read it.

Shared by a stage's `prepare` and the stack's leaving read (`final_norm`), so both keep the same
order: the unfused completion steps, then the fused sum + update + read (a fusion candidate
first), then the row move of the read's result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from .. import ops
from ..designs.protocols import Norm, ReadState, ResidualReadout
from ..finalize import DeferredFinalize
from ..fusions import FusionRequest, InputFusion
from ..layout import TokenAxis, Topology
from ..plan import EntryPath
from .stream import Contribution

_NEEDS_EARLY_READ = (
    "a read that hands state to its stage's update must read before the rows move; declare it "
    "with reads_before_dp_gather=True"
)


def run_entry(
    entry: EntryPath,
    residual: jax.Array,
    pending: Contribution | None,
    read: ResidualReadout,
    norm: Norm | None,
    *,
    candidates: Sequence[InputFusion] = (),
    topology: Topology,
    fuse_sum: bool = True,
) -> tuple[jax.Array, jax.Array, ReadState]:
    """`(compute_input, residual, read_state)` after `entry`, from a residual on the entry's
    `residual_from` rows; `pending` is the producer's contribution or None.

    With `fuse_sum=False` the sum left for the update + read completes first, unfused (a
    capture of the updated residual needs it complete); an add + norm kernel may still run.
    """
    if not fuse_sum:
        entry = entry.unfused(topology)
    residual = ops.run(entry.residual_move, residual)
    if pending is not None and entry.residual_move:
        pending = _moved_state(pending, entry.residual_move)
    if entry.read_after_move:
        if pending is not None:
            residual = pending.apply(residual, _completed(entry, pending, topology))
        compute_input, _, state = read.read(ops.run(entry.move_input, residual), norm)
        if state is not None:
            raise NotImplementedError(_NEEDS_EARLY_READ)
        return compute_input, residual, None
    if read.gathering_reads and _gathers_attn_tp_only(entry.move_input):
        return _gathering_read(entry, residual, pending, read, norm, topology)
    if pending is None:
        compute_input, residual, state = read.read(residual, norm)
    else:
        fused = _fused_finalize(entry, pending, residual, read, norm, candidates, topology)
        if fused is not None:
            compute_input, residual = fused
            state = None
        else:
            value, transform = pending.advance(entry.complete)
            compute_input, residual, state = _update_and_read(
                entry, pending, value, transform, residual, read, norm, candidates, topology
            )
    return ops.move_rows(entry.move_input, compute_input), residual, state


def _gathers_attn_tp_only(steps) -> bool:
    """The input move is one gather over attention TP alone (a read on this rank's slice)."""
    return (
        len(steps) == 1
        and isinstance(steps[0], ops.AllGather)
        and steps[0].axes == (TokenAxis.ATTN_TP,)
    )


def _gathering_read(entry, residual, pending, read, norm, topology):
    """The read's own read + gathers, tried in order on the updated residual (the update runs
    unfused first); the read and the built-in gather where all decline."""
    if pending is not None:
        residual = pending.apply(residual, _completed(entry, pending, topology))
    for gather in read.gathering_reads:
        compute_input = gather(residual, norm, topology)
        if compute_input is not None:
            return compute_input, residual, None
    compute_input, residual, state = read.read(residual, norm)
    return ops.move_rows(entry.move_input, compute_input), residual, state


def _moved_state(pending: Contribution, steps) -> Contribution:
    """The producer's read state follows the residual onto this stage's rows."""
    state = ops.move_rows(steps, pending.update_state)
    return dataclasses.replace(pending, update_state=state)


def _fused_finalize(entry, pending, residual, read, norm, candidates, topology):
    """Offers the candidates a MoE finalize handoff itself, when only the finalize (then the
    fused sum) stands between it and the update; `(compute_input, residual)` or None."""
    if (
        not candidates
        or entry.complete != (ops.Finalize(),)
        or pending.transform is not None
        or pending.update_state is not None
    ):
        return None
    return _offer(entry, pending, pending.value, residual, read, norm, candidates, topology)


def _offer(entry, pending, value, residual, read, norm, candidates, topology):
    """The first candidate's `(compute_input, residual)` for `value`, or None if all decline."""
    request = FusionRequest(
        value,
        residual,
        norm,
        pending.update.resolve(),
        read,
        entry.fused_sum,
        topology,
    )
    return next((r for r in (c(request) for c in candidates) if r is not None), None)


def _offer_own(entry, pending, value, residual, read, norm, topology):
    """The read's own fused completions (`completing_fusions`), where a sum is left for the
    update + read: the first that accepts completes it with the residual add, and reads
    unless it read too; None where all decline."""
    if not entry.fused_sum or not read.completing_fusions or isinstance(value, DeferredFinalize):
        return None
    request = FusionRequest(
        value, residual, norm, pending.update.resolve(), read, entry.fused_sum, topology
    )
    for fusion in read.completing_fusions:
        fused = fusion(request)
        if fused is None:
            continue
        if fused.compute_input is None:
            return read.read(fused.residual, norm)
        return fused.compute_input, fused.residual, None
    return None


def _update_and_read(entry, pending, value, transform, residual, read, norm, candidates, topology):
    if transform is None and pending.update_state is None:
        own = _offer_own(entry, pending, value, residual, read, norm, topology)
        if own is not None:
            return own
        fused = _offer(entry, pending, value, residual, read, norm, candidates, topology)
        if fused is not None:
            return (*fused, None)
    value = ops.run(ops.all_reduce(entry.fused_sum, topology), value)
    if transform is not None:
        value = transform(value)
    return read.update_and_read(
        pending.update.resolve(), value, residual, norm, pending.update_state
    )


def _completed(entry, pending: Contribution, topology: Topology) -> jax.Array:
    value, transform = pending.advance(entry.complete + ops.all_reduce(entry.fused_sum, topology))
    return value if transform is None else transform(value)
