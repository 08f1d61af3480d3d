"""Binding: every decision about rows, owed work and their order, made once when a stack closes.

`bind_stage` turns a declaration and the two typed edges it sits between into a `StagePlan`: for
each supported batch variant, the entry paths that complete whatever the producer hands on and
read the residual into the compute input, and the ordered exit options the reduction policy and
fusion provider permit, each with the leaving paths the stream may take after it. Both sides of
an edge are derived by the same function (`exit_options`), from the same declarations (across a
pipeline cut, from the model's shared `stage_facts`), so they always agree; `check.check_plan`
then simulates every bound step.
"""

from __future__ import annotations

import dataclasses

from . import ops
from .declare import (
    Edge,
    EdgeKind,
    FinalRead,
    MoeDispatch,
    ProducerReduction,
    StageDeclaration,
    StageKind,
)
from .fusions import FusionProvider
from .layout import BatchVariant, Layout, SumGroup, TokenAxis, Topology
from .ops import AllGather, AllReduce, Finalize, PlanError, Step
from .placement import Placement
from .plan import (
    BranchFork,
    BranchMerge,
    CountedOnce,
    EntryPath,
    ExitKind,
    ExitOption,
    Leave,
    OwedWork,
    ResidualRows,
    StackFacts,
    StagePath,
    StagePlan,
    StageRows,
)
from .rows import compute_owed


def owed_work(placement: Placement, residual: Layout, topology: Topology) -> OwedWork:
    """The owed-work record of a value on `placement` whose residual is on `residual` rows."""
    in_place = ((Finalize(),) if placement.finalize else ()) + ops.all_reduce(
        placement.owed, topology
    )
    then = None if placement.complete else owed_work(placement.completed(), residual, topology)
    return OwedWork(placement, in_place, ops.complete_onto(placement, residual, topology), then)


def residual_rows(layout: Layout, topology: Topology) -> ResidualRows:
    """The residual's rows with the bound move of a value from the attention's rows onto them."""
    return ResidualRows(layout, ops.relayout(topology.attention_rows(), layout, topology))


def _defers_finalize(
    declaration: StageDeclaration, outgoing: Edge, fusions: FusionProvider | None
) -> bool:
    if not declaration.sparse or fusions is None:
        return False
    if outgoing.leaves_stack:
        return fusions.terminal_finalize
    return fusions.defer_finalize


def counted_once(declaration: StageDeclaration, topology: Topology) -> tuple[CountedOnce, ...]:
    """Where each replicated part of `declaration` is added: on the first rank of the sum its
    output owes at the exit (or of the group the part names), on every rank where no such sum
    runs."""
    owed = topology.mesh_names(compute_owed(declaration, topology))
    return tuple(
        CountedOnce(part.name, owed if part.group is None else topology.group_names(part.group))
        for part in declaration.replicated
    )


def may_defer_all_reduce(
    declaration: StageDeclaration,
    owed: tuple[TokenAxis, ...],
    topology: Topology,
    fusions: FusionProvider | None,
) -> bool:
    """The guide's deferral rule for an FFN with replicated parts: it may leave its all-reduce
    to the next input only without an expert all-to-all, when its sum is over the whole TP
    group, and when its fusion provider defers all-reduces (`defer_all_reduce`; the provider's
    `can_defer_all_reduce` then decides per batch). Any other FFN may, as before."""
    if not declaration.replicated:
        return True
    return (
        declaration.moe_dispatch is not MoeDispatch.ALL_TO_ALL
        and set(owed) == set(topology.sum_axes(SumGroup.FULL_TP))
        and fusions is not None
        and fusions.defer_all_reduce
    )


def exit_options(
    declaration: StageDeclaration,
    outgoing: Edge,
    variant: BatchVariant,
    stack: StackFacts,
    rows: StageRows,
    fusions: FusionProvider | None,
    *,
    fold: bool = True,
) -> tuple[ExitOption, ...]:
    """The exit options of `declaration` leaving by `outgoing`, best first.

    At a stack exit whose residual is not on the attention's rows, a completing option folds
    the output into the residual and moves it there, unless `fold` is False (a branch's source,
    whose output must stay pending for the merge; the final read then completes, updates and
    moves it). A branch merging into the final read never folds: `branch_output` does. An
    update `applied_at_exit` keeps only the options that complete the sum at the exit, each
    folding the output into the residual there.

    A pipeline send binds exactly as the uncut stack (its consumer is the next rank's first
    stage); `to_pp` then completes what the chosen option leaves. A stack exit completes the
    sum now, except an attention's partial sum and a finalize its provider defers to the final
    read.
    """
    options = _exit_options(declaration, outgoing, variant, stack, rows, fusions, fold=fold)
    if not declaration.update.applied_at_exit:
        return options
    return tuple(option for option in options if option.fold_to is not None)


def _exit_options(
    declaration: StageDeclaration,
    outgoing: Edge,
    variant: BatchVariant,
    stack: StackFacts,
    rows: StageRows,
    fusions: FusionProvider | None,
    *,
    fold: bool = True,
) -> tuple[ExitOption, ...]:
    """`exit_options` before an update applied at the exit drops the options that leave work."""
    topology = stack.topology
    owed = compute_owed(declaration, topology)
    compute, residual = rows.compute, rows.residual
    value = Placement(compute, owed)
    leaving = outgoing.leaves_stack
    attention = topology.attention_rows()
    stack_exit = outgoing.kind is EdgeKind.STACK_EXIT
    consumer = outgoing.consumer
    # The guide's reads_attn_tp_slices: the final read takes the output on this rank's slice.
    slices_read = stack_exit and isinstance(consumer, FinalRead) and consumer.reads_attn_tp_slices
    fold_to = attention if fold and stack_exit and residual != attention else None
    if slices_read and not declaration.update.applied_at_exit:
        fold_to = None
    at_exit = declaration.update.applied_at_exit
    if at_exit and not fold:
        raise NotImplementedError(
            "a branch's source leaves its output pending for the merge, so its update cannot "
            "be applied_at_exit; apply it at the next input"
        )
    if at_exit and fold_to is None:
        fold_to = residual  # the guide's applied_at_exit: complete, then update, at the exit
    # An exit runs its consumer's gather (across a pipeline cut, from its stage_facts; at the
    # stack exit, the final read's).
    consumer_gather = consumer.attn_tp_gather

    def option(kind, steps, handoff, fold=None) -> ExitOption:
        steps = ops.with_gather(steps, consumer_gather)
        fold_steps = () if fold is None else ops.relayout(residual, fold, topology)
        fold_steps = ops.with_gather(fold_steps, consumer_gather)
        output = Placement(compute, owed, finalize=handoff.finalize)
        leave = _leave(declaration, outgoing, stack, fusions, handoff, residual, fold)
        work = owed_work(handoff, residual, topology)
        fold_rows = None if fold is None else residual_rows(fold, topology)
        return ExitOption(kind, output, steps, handoff, work, fold_rows, fold_steps, leave)

    def completed(kind: ExitKind, steps: tuple[Step, ...]) -> ExitOption:
        return option(kind, steps, Placement(residual), fold_to)

    deferred = []
    if _defers_finalize(declaration, outgoing, fusions) and compute == residual and not fold_to:
        deferred.append(option(ExitKind.HAND_FINALIZE, (), Placement(compute, owed, finalize=True)))

    if declaration.reduction is ProducerReduction.ALWAYS_PARTIAL:
        return (option(ExitKind.RECORD_PARTIAL, (), value),)

    if not owed:
        move = completed(ExitKind.MOVE_COMPLETE, ops.relayout(compute, residual, topology))
        return (*deferred, move)

    if declaration.kind is StageKind.ATTN:
        # The guide's MixerExit: before an FFN the sum goes to the FFN's input (under attention
        # DP too); before another mixer only without attention DP; at the stack's end the exit
        # completes it.
        carries = not leaving and (consumer.kind is StageKind.FFN or topology.attn_dp == 1)
        complete = completed(ExitKind.ALL_REDUCE, ops.complete_onto(value, residual, topology))
        if carries:
            return (option(ExitKind.LEAVE_TO_NEXT_INPUT, (), value), complete)
        return (complete,)

    options = list(deferred)
    dp = topology.active((TokenAxis.ATTN_DP,))
    # A compute on DP-sharded rows already (a dense FFN over attention TP) has none to return.
    returns_to_dp_rows = (
        bool(dp) and not set(dp) & set(compute.sharded) and Layout(compute.sharded + dp) == residual
    )
    if stack.policy.allows_rsv and returns_to_dp_rows and set(dp) <= set(owed):
        rest = tuple(a for a in owed if a not in dp)
        steps = ops.reduce_scatter(dp, topology)
        if rest and not leaving:
            options.append(option(ExitKind.DP_REDUCE_SCATTER, steps, Placement(residual, rest)))
        else:
            options.append(
                completed(ExitKind.DP_REDUCE_SCATTER, steps + ops.all_reduce(rest, topology))
            )
    if stack.policy.allows_rs and residual != compute and not compute.sharded:
        scattered = Layout(owed)
        if scattered.sharded[: len(residual.sharded)] == residual.sharded:
            steps = ops.reduce_scatter(owed, topology) + ops.relayout(scattered, residual, topology)
            options.append(completed(ExitKind.REDUCE_SCATTER, steps))
    all_reduced = completed(
        ExitKind.ALL_REDUCE,
        ops.all_reduce(owed, topology) + ops.relayout(compute, residual, topology),
    )
    if compute == residual and not leaving and not at_exit:
        if not declaration.replicated:
            options.append(option(ExitKind.LEAVE_TO_NEXT_INPUT, (), value))
            return tuple(options)
        if may_defer_all_reduce(declaration, owed, topology, fusions):
            # The provider decides per batch (`can_defer_all_reduce`); the exit's all-reduce
            # follows as the fallback.
            options.append(option(ExitKind.LEAVE_TO_NEXT_INPUT, (), value))
    options.append(all_reduced)
    return tuple(options)


def sends_written(producer: StageDeclaration, residual: Layout, topology: Topology) -> bool:
    """Whether `to_pp` after `producer` folds its output and sends the residual alone.

    It does when the residual is not on the attention's rows (an FFN on its own rows, an
    input-scattered batch), the update is not plain (its parameters stay on the sending
    rank) or runs at the exit (the stream is already written); otherwise it sends the
    completed output and the residual, and the receiver's fused update + read applies them.
    Both ranks decide it from the producer's declaration.
    """
    return (
        residual != topology.attention_rows()
        or not producer.update.plain
        or producer.update.applied_at_exit
    )


def _leave(
    declaration: StageDeclaration,
    outgoing: Edge,
    stack: StackFacts,
    fusions: FusionProvider | None,
    handoff: Placement,
    residual: Layout,
    fold_to: Layout | None,
) -> Leave:
    """How the stream leaves after an option handing on `handoff`: for every form it may take
    (the handoff, completed in place, complete on the residual's rows, written), complete onto
    the residual's rows, update, then move the residual to the attention's rows and read it
    there. A folding option leaves a written stream on `fold_to` rows."""
    topology = stack.topology
    rows = residual if fold_to is None else fold_to
    forms = {Placement(rows)}
    if fold_to is None:
        forms |= {handoff, handoff.completed()}
    final = outgoing.kind is EdgeKind.STACK_EXIT
    consumer = outgoing.consumer
    reading = consumer if final and isinstance(consumer, FinalRead) else None
    entries = tuple(
        leave_entry(form, rows, topology, reading) for form in (None, *sorted(forms, key=str))
    )
    return Leave(
        outgoing.kind,
        entries,
        final_read=stack.final_read if final else None,
        sends_written=outgoing.kind is EdgeKind.PIPELINE_SEND
        and sends_written(declaration, rows, topology),
        final_fusions=(fusions or stack.fusions).final_input if final else (),
    )


def leave_entry(
    handoff: Placement | None,
    residual: Layout,
    topology: Topology,
    final_read: FinalRead | None = None,
) -> EntryPath:
    """How the stack's leaving read (or `to_pp`) takes `handoff` (None: a written stream) with
    the residual on `residual` rows: complete onto those rows, update, then move the residual to
    the attention's rows and read it there; or, where the final read reads this rank's
    attention-TP slice (`FinalRead.reads_attn_tp_slices`), read on the residual's rows and move
    what it read. The final read's own gather is tried first in each gather."""
    attention = topology.attention_rows()
    move = ops.relayout(residual, attention, topology)
    slices = final_read is not None and final_read.reads_attn_tp_slices
    entry = _entry(
        handoff,
        initial=False,
        residual_from=residual,
        residual=residual,
        compute=attention,
        read_after_move=bool(move) and not slices,
        topology=topology,
    )
    return _own_gather(entry, None if final_read is None else final_read.attn_tp_gather)


def _entry(
    handoff: Placement | None,
    *,
    initial: bool,
    residual_from: Layout,
    residual: Layout,
    compute: Layout,
    read_after_move: bool | None = None,
    reads_before_dp_gather: bool = True,
    topology: Topology,
    transport: bool = False,
) -> EntryPath:
    complete: tuple[Step, ...] = ()
    fused: tuple[TokenAxis, ...] = ()
    if handoff is not None:
        complete = ops.complete_onto(handoff, residual, topology)
        if not initial and complete and isinstance(complete[-1], AllReduce):
            fused = complete[-1].axes
            complete = complete[:-1]
    move = ops.relayout(residual, compute, topology)
    if read_after_move is None:
        gathers_dp = any(
            isinstance(step, AllGather) and TokenAxis.ATTN_DP in step.axes for step in move
        )
        read_after_move = gathers_dp and not reads_before_dp_gather
    return EntryPath(
        handoff,
        initial,
        residual_from,
        ops.relayout(residual_from, residual, topology),
        complete,
        fused,
        move,
        read_after_move,
        transport=transport,
        capture_move=ops.relayout(residual, topology.attention_rows(), topology),
    )


def _own_gather(entry: EntryPath, gather: ops.RowGather | None) -> EntryPath:
    """`entry` with the stage's own gather over attention TP tried first wherever it brings
    rows into the stage."""
    if gather is None:
        return entry
    return dataclasses.replace(
        entry,
        residual_move=ops.with_gather(entry.residual_move, gather),
        complete=ops.with_gather(entry.complete, gather),
        move_input=ops.with_gather(entry.move_input, gather),
    )


def bind_fork(source: StageRows, own: StageRows, topology: Topology) -> BranchFork:
    """How a branch's first stage (on `own` rows) starts from its source's prepared input (the
    source on `source` rows): the residual and the compute input move as they are, complete."""
    return BranchFork(
        source.residual,
        ops.relayout(source.residual, own.residual, topology),
        source.compute,
        ops.relayout(source.compute, own.compute, topology),
    )


def bind_merge(
    declaration: StageDeclaration,
    exits: tuple[ExitOption, ...],
    residual: Layout,
    source: StageDeclaration,
    into: StagePath,
    topology: Topology,
) -> BranchMerge:
    """How a branch's last stage (`declaration`, exiting by `exits` with its residual on
    `residual` rows) merges into its source's output (`source`, bound as `into`).

    A handoff defers to the merge where the source hands on the same placement, neither owes a
    finalize and both are plain adds without an output transform: the values add unsummed and
    the source's one completion completes both. Every other handoff completes at
    `branch_output`, onto the branch's residual rows.

    Raises:
      NotImplementedError: The source's update is not a plain add.
      PlanError: The source's exit folds its output into the residual (a binding bug).
    """
    if not source.update.plain:
        raise NotImplementedError(
            f"a branch merges by taking its residual (which holds the one it forked from) in "
            f"place of its source's, so the source's update must be a plain add; got "
            f"{source.update.design}"
        )
    if any(option.fold_to is not None for option in into.exits):
        raise PlanError(
            "a branch's source folds its output into the residual at its exit, but the merge "
            "needs it pending; this is a binding bug: report it with the stack's declarations"
        )
    plain = declaration.update.plain and not declaration.has_output_transform
    targets = {o.handoff for o in into.exits} if not source.has_output_transform and plain else ()
    defers = tuple(
        sorted(
            {o.handoff for o in exits if o.fold_to is None and not o.handoff.finalize}
            & set(targets),
            key=str,
        )
    )
    leaving = {residual} | {o.fold_to.layout for o in exits if o.fold_to is not None}
    moves = tuple(
        (rows, ops.relayout(rows, into.residual_layout, topology))
        for rows in sorted(leaving, key=str)
    )
    return BranchMerge(into.residual_layout, moves, defers)


def bind_stage(
    declaration: StageDeclaration,
    incoming: Edge,
    outgoing: Edge,
    stack: StackFacts,
    rows: dict[BatchVariant, tuple[StageRows | None, StageRows]],
    fusions: FusionProvider | None = None,
    producer_fusions: FusionProvider | None = None,
    merge_into: StagePlan | None = None,
    branch_source: bool = False,
) -> StagePlan:
    """Binds one stage between the edge it is entered through and the edge it leaves by.

    Args:
      declaration: The stage, with its place set.
      incoming: The edge from its producer (or the stack input); at a branch fork, from the
        source whose prepared input the stage starts from.
      outgoing: The edge to its consumer (or the final read).
      stack: The stack's facts.
      rows: Per variant, the rows of (the producer, this stage); None for the stack input. At a
        branch fork, the producer is the source.
      fusions: This stage's provider (None: the stack's).
      producer_fusions: The producer's provider (None: the stack's).
      merge_into: For a branch's last stage, its source's bound plan.
      branch_source: The stage is a branch's source: its output stays pending at a stack exit.

    Raises:
      NotImplementedError: The stage needs a path boundary-jax does not implement.
      ValueError: The declaration contradicts its neighbours or the topology.
    """
    topology = stack.topology
    fusions = fusions or stack.fusions
    producer_fusions = producer_fusions or stack.fusions
    attention = topology.attention_rows()
    paths = []
    for variant in stack.variants:
        producer_rows, own = rows[variant]
        residual, compute = own.residual, own.compute

        def entry(
            handoff,
            residual_from,
            initial=False,
            transport=False,
            residual=residual,
            compute=compute,
        ):
            path = _entry(
                handoff,
                initial=initial,
                residual_from=residual_from,
                residual=residual,
                compute=compute,
                reads_before_dp_gather=declaration.read.reads_before_dp_gather,
                topology=topology,
                transport=transport,
            )
            return _own_gather(path, declaration.attn_tp_gather)

        entries: list[EntryPath] = []
        primary = None
        handoffs = {Placement(residual)}
        fork = None
        if incoming.kind is EdgeKind.BRANCH_FORK:
            fork = bind_fork(producer_rows, own, topology)
            handoffs, sources = set(), ()
        elif incoming.kind is EdgeKind.STACK_ENTRY:
            group = incoming.producer.sum_group
            owed_axes = () if group is None else topology.sum_axes(group)
            entries.append(entry(Placement(attention, owed_axes), attention, initial=True))
            sources = (attention, residual)
        else:
            options = exit_options(
                incoming.producer,
                dataclasses.replace(incoming, kind=EdgeKind.NEXT_STAGE),
                variant,
                stack,
                producer_rows,
                producer_fusions,
            )
            primary = options[0].handoff
            for option in options:
                handoffs |= {option.handoff, option.handoff.completed()}
            sources = (own.incoming,)
        for source in sorted(set(sources), key=str):
            entries.append(entry(None, source))
        entries.extend(entry(h, own.incoming) for h in sorted(handoffs, key=str))
        if incoming.kind is EdgeKind.PIPELINE_RECEIVE:
            writes = sends_written(incoming.producer, producer_rows.residual, topology)
            handoff = None if writes else Placement(attention)
            entries = [e for e in entries if e.handoff != handoff or e.residual_from != attention]
            entries.append(entry(handoff, attention, transport=True))
        entries = [
            dataclasses.replace(
                e,
                primary=e.initial
                if primary is None
                else e.handoff == primary and e.residual_from == own.incoming,
            )
            for e in entries
        ]
        exits = exit_options(
            declaration, outgoing, variant, stack, own, fusions, fold=not branch_source
        )
        merge = None
        if outgoing.kind is EdgeKind.BRANCH_MERGE:
            source = merge_into.declaration
            into = merge_into.path(variant)
            merge = bind_merge(declaration, exits, residual, source, into, topology)
        path = StagePath(
            variant,
            residual_rows(residual, topology),
            compute,
            compute_owed(declaration, topology),
            tuple(entries),
            exits,
            fork,
            merge,
        )
        paths.append(path)
    candidates = fusions.attn_input if declaration.kind is StageKind.ATTN else fusions.ffn_input
    return StagePlan(
        declaration,
        topology,
        stack.policy,
        tuple(paths),
        input_fusions=tuple(candidates),
        fusions=fusions,
        rejected=stack.rejected,
        counted_once=counted_once(declaration, topology),
    )
