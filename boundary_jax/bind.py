"""Binding: every decision about rows, owed work and their order, made once when a stack closes.

`bind_stage` turns a declaration and the two typed edges it sits between into a `StagePlan`: for
each supported batch variant, the entry paths that complete whatever the producer hands on and
read the residual into the compute input, and the ordered exit options the reduction policy and
fusion provider permit. Both sides of an edge are derived by the same function (`exit_options`),
from the same declarations (across a pipeline cut, from the model's shared `stage_facts`), so
they always agree; every path is checked by simulating its steps, so each owed finalize and sum
completes exactly once, in order, on the rows that read it.
"""

from __future__ import annotations

import dataclasses
import enum

from . import ops
from .contracts import Placement, ProducerReduction, ReductionPolicy, StageKind
from .declare import Edge, EdgeKind, MoeDispatch, StageDeclaration
from .fusions import FusionProvider, InputFusion
from .layout import BatchVariant, Layout, SumGroup, TokenAxis, Topology
from .ops import (
    AllGather,
    AllReduce,
    OwedWork,
    PlanError,
    ReduceScatter,
    Step,
    TakeBlock,
    owed_work,
)
from .residual.protocols import ResidualReadout


class ExitKind(enum.Enum):
    """What a stage's exit does with the work its output owes."""

    RECORD_PARTIAL = "hands the partial sum to the next input"
    HAND_FINALIZE = "hands its finalize (and any sum) to the next input"
    LEAVE_TO_NEXT_INPUT = "leaves the sum to the next input"
    ALL_REDUCE = "completes it by all-reduce"
    DP_REDUCE_SCATTER = "reduce-scatters it back to each attention-DP rank's rows (rsv)"
    REDUCE_SCATTER = "reduce-scatters it over the full TP group (rs)"
    MOVE_COMPLETE = "moves its already complete output back to the residual's rows"


@dataclasses.dataclass(frozen=True)
class StackFacts:
    """Facts every stage of one stack binds against.

    Attributes:
      topology: The parallel topology.
      policy: The resolved (concrete) reduction policy.
      variants: The batch variants every stage of the model supports.
      fusions: The provider of stages without their own, also assumed for neighbours that another
        pipeline rank builds.
    """

    topology: Topology
    policy: ReductionPolicy
    variants: tuple[BatchVariant, ...]
    fusions: FusionProvider

    def __post_init__(self):
        if self.policy is ReductionPolicy.AUTO:
            raise ValueError("StackFacts needs a resolved reduction policy, not AUTO")


@dataclasses.dataclass(frozen=True)
class StageRows:
    """The rows one stage runs on, for one batch variant.

    Attributes:
      incoming: Rows the residual arrives on from the producer (the attention's rows at a stack
        entry; across a pipeline receive, the rows the remote producer keeps it on).
      residual: Rows of the residual while this stage runs (its read and its update).
      compute: Rows of the compute input and output.
    """

    incoming: Layout
    residual: Layout
    compute: Layout


@dataclasses.dataclass(frozen=True)
class EntryPath:
    """How a stage's input (or the stack's leaving read) is prepared from one kind of stream.

    Attributes:
      handoff: The pending contribution this path takes (for `initial`, the raw stack input's
        rows and owed sum); None for a written stream.
      initial: The path starts the residual from the stack input.
      residual_from: Rows the stream's residual arrives on.
      residual_move: Movements of the arriving residual (and the read state the producer's
        update takes) onto this stage's residual rows.
      complete: Movements that complete the contribution onto the residual's rows, except
        `fused_sum`.
      fused_sum: An all-reduce on the residual's rows left for the update + read (where a fused
        sum + add + norm can take it).
      move_input: Movements from the residual's rows to the compute rows.
      read_after_move: The update runs on the residual's rows, then the residual moves and is
        read on the moved rows (the read does not read before a DP gather, or the stack's
        leaving read needs rows the residual is not on).
      primary: The entry the producer's preferred exit option (or the stack input) leads to.
      transport: The entry a pipeline receive takes: what `from_pp` rebuilds.
      capture_move: Moves the updated residual from the residual's rows onto the attention's
        rows, for a gathered capture.
    """

    handoff: Placement | None
    initial: bool
    residual_from: Layout
    residual_move: tuple[Step, ...]
    complete: tuple[Step, ...]
    fused_sum: tuple[TokenAxis, ...]
    move_input: tuple[Step, ...]
    read_after_move: bool
    primary: bool = False
    transport: bool = False
    capture_move: tuple[Step, ...] = ()


@dataclasses.dataclass(frozen=True)
class ExitOption:
    """One way a stage's exit may hand its output on.

    Attributes:
      kind: What the exit does with the owed work.
      steps: Movements run at the exit, on the compute output.
      handoff: Rows and owed work of what the next input receives.
      owed: The handed-on contribution's owed-work record.
      fold_to: At a stack exit whose residual is on finer rows than the stack's output: fold the
        complete output into the residual, then move the residual to these rows.
      fold_steps: The residual's move onto `fold_to`.
      leave: How what this option hands on is completed and moved onto the attention's rows when
        the stream leaves after this stage: the final read at a stack exit, `to_pp` at a pipeline
        send, `take_output` anywhere.
    """

    kind: ExitKind
    steps: tuple[Step, ...]
    handoff: Placement
    owed: OwedWork
    fold_to: Layout | None = None
    fold_steps: tuple[Step, ...] = ()
    leave: EntryPath | None = None

    @property
    def completes_now(self) -> bool:
        return self.handoff.complete

    @property
    def defers_finalize(self) -> bool:
        return self.handoff.finalize


@dataclasses.dataclass(frozen=True)
class StagePath:
    """Everything one batch variant of one stage runs.

    Attributes:
      variant: The batch variant.
      residual_layout: Rows of the residual while this stage runs.
      compute_layout: Rows of the compute input and output.
      owed: Token axes over which compute leaves its output unreduced.
      entries: One entry path per stream kind this stage may receive.
      exits: Exit options in preference order; the last always applies.
    """

    variant: BatchVariant
    residual_layout: Layout
    compute_layout: Layout
    owed: tuple[TokenAxis, ...]
    entries: tuple[EntryPath, ...]
    exits: tuple[ExitOption, ...]

    def entry(self, handoff: Placement | None, residual_from: Layout | None) -> EntryPath | None:
        """The entry for a stream whose pending contribution is on `handoff` (None: written)
        and whose residual is on `residual_from` rows; None if this stage binds no such entry."""
        for path in self.entries:
            if not path.initial and path.handoff == handoff and path.residual_from == residual_from:
                return path
        return None

    @property
    def initial_entry(self) -> EntryPath | None:
        """The entry from the raw stack input; None unless this stage enters the stack."""
        return next((path for path in self.entries if path.initial), None)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """A bound stage: its declaration with its place, and a path per supported batch variant.

    Attributes:
      declaration: The declaration, with its place in the stack.
      topology: The topology it is bound on.
      policy: The resolved reduction policy.
      paths: One path per supported batch variant.
      input_fusions: Fused candidates for this stage's input, tried in order before the
        built-in path.
      fusions: The provider this stage binds with (asked per batch whether the exit may defer a
        finalize).
      final_read: At a stack exit, the read `final_norm` applies.
      final_fusions: At a stack exit, fused candidates for the final read.
    """

    declaration: StageDeclaration
    topology: Topology
    policy: ReductionPolicy
    paths: tuple[StagePath, ...]
    input_fusions: tuple[InputFusion, ...] = ()
    fusions: FusionProvider | None = dataclasses.field(default=None, compare=False)
    final_read: ResidualReadout | None = None
    final_fusions: tuple[InputFusion, ...] = ()

    def path(self, variant: BatchVariant) -> StagePath:
        """The path bound for `variant`.

        Raises:
          NotImplementedError: No path is bound for the variant.
        """
        for path in self.paths:
            if path.variant is variant:
                return path
        supported = ", ".join(p.variant.value for p in self.paths)
        raise NotImplementedError(
            f"no stage boundary path for the active {variant.value} batch (this "
            f"{self.declaration.kind.value} stage supports: {supported}); reject the "
            "configuration before building the model"
        )


def own_rows(topology: Topology) -> Layout:
    """This rank's own rows: its attention-TP slice of its attention-DP rank's tokens."""
    return topology.layout(TokenAxis.ATTN_DP, TokenAxis.ATTN_TP)


def _runs_on_own_rows(declaration: StageDeclaration, topology: Topology) -> bool:
    if declaration.kind is not StageKind.FFN:
        return False
    if declaration.sparse:
        return declaration.moe_dispatch is MoeDispatch.ALL_TO_ALL
    size = declaration.dense_tp_size
    if size is None or size == topology.tp_size:
        return False
    if size == 1:
        return True
    if size == topology.attn_tp:
        return False
    raise ValueError(
        f"dense_tp_size must be 1, attention TP ({topology.attn_tp}) or TP "
        f"({topology.tp_size}); got {size=}. Pass None to use the mesh's TP size."
    )


def compute_layout(
    declaration: StageDeclaration, topology: Topology, variant: BatchVariant
) -> Layout:
    """The rows a stage computes on, from its declaration.

    Attention and mixers, and a dense FFN over attention TP, run on the attention's rows; an FFN
    over the full TP group on every DP rank's rows; an FFN on its own rows on this rank's slice,
    except in an unpadded batch, whose rows do not divide over attention TP.
    """
    if _runs_on_own_rows(declaration, topology):
        if variant is BatchVariant.UNPADDED:
            return topology.attention_rows()
        return own_rows(topology)
    if declaration.kind is StageKind.ATTN or declaration.dense_tp_size == topology.attn_tp:
        return topology.attention_rows()
    return topology.layout()


def compute_owed(declaration: StageDeclaration, topology: Topology) -> tuple[TokenAxis, ...]:
    """Token axes over which a stage's compute leaves its output unreduced."""
    if declaration.output_complete or _runs_on_own_rows(declaration, topology):
        return ()
    if declaration.kind is StageKind.FFN and declaration.dense_tp_size == topology.attn_tp:
        return topology.sum_axes(SumGroup.ATTN_TP)
    return topology.sum_axes(declaration.sum_group)


def supported_variants(
    declarations: tuple[StageDeclaration, ...], topology: Topology
) -> tuple[BatchVariant, ...]:
    """The batch variants a model whose stages are `declarations` can run on `topology`."""
    variants = [BatchVariant.ORDINARY]
    if topology.attn_tp > 1 and all(
        d.gathers_attn_tp_input for d in declarations if d.kind is StageKind.ATTN
    ):
        variants.append(BatchVariant.INPUT_SCATTERED)
    if topology.attn_tp > 1 and topology.attn_dp == 1:
        variants.append(BatchVariant.UNPADDED)
    return tuple(variants)


def stage_rows(
    declarations: tuple[StageDeclaration, ...], variant: BatchVariant, topology: Topology
) -> tuple[StageRows, ...]:
    """The rows of every stage of a model, in order.

    The residual starts on the attention's rows (each rank's slice of them for an
    input-scattered batch). It follows an FFN on its own rows onto that slice and stays there;
    the stack's leaving read or a pipeline send returns it to the attention's rows.

    Raises:
      NotImplementedError: An attention that cannot gather its input would read a residual on
        attention-TP slices.
    """
    attention = topology.attention_rows()
    current = own_rows(topology) if variant is BatchVariant.INPUT_SCATTERED else attention
    rows = []
    for index, declaration in enumerate(declarations):
        compute = compute_layout(declaration, topology, variant)
        incoming = current
        if compute == own_rows(topology):
            current = compute
        if (
            declaration.kind is StageKind.ATTN
            and current != attention
            and not declaration.gathers_attn_tp_input
        ):
            raise NotImplementedError(
                f"stage {index} is attention that does not gather its input "
                "(gathers_attn_tp_input=False), but an FFN on its own rows before it leaves the "
                "residual on attention-TP slices; declare the FFN over attention TP or more"
            )
        rows.append(StageRows(incoming, current, compute))
    return tuple(rows)


def _defers_finalize(
    declaration: StageDeclaration, outgoing: Edge, fusions: FusionProvider | None
) -> bool:
    if not declaration.sparse or fusions is None:
        return False
    if outgoing.kind is EdgeKind.STACK_EXIT:
        return fusions.terminal_finalize
    return fusions.defer_finalize


def exit_options(
    declaration: StageDeclaration,
    outgoing: Edge,
    variant: BatchVariant,
    stack: StackFacts,
    rows: StageRows,
    fusions: FusionProvider | None,
) -> tuple[ExitOption, ...]:
    """The exit options of `declaration` leaving by `outgoing`, best first.

    A pipeline send binds exactly as the uncut stack (its consumer is the next rank's first
    stage); `to_pp` then completes what the chosen option leaves. A stack exit completes the
    sum now, except an attention's partial sum and a finalize its provider defers to the final
    read.
    """
    topology = stack.topology
    owed = compute_owed(declaration, topology)
    compute, residual = rows.compute, rows.residual
    value = Placement(compute, owed)
    leaving = outgoing.kind is EdgeKind.STACK_EXIT
    attention = topology.attention_rows()
    fold_to = attention if leaving and residual != attention else None
    consumer = outgoing.consumer

    def option(kind, steps, handoff, fold=None) -> ExitOption:
        fold_steps = () if fold is None else ops.relayout(residual, fold, topology)
        leave = (
            leave_entry(handoff, residual, topology)
            if fold is None
            else leave_entry(None, fold, topology)
        )
        return ExitOption(
            kind, steps, handoff, owed_work(handoff, residual, topology), fold, fold_steps, leave
        )

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
        carries = not leaving and (consumer.kind is StageKind.FFN or topology.attn_dp == 1)
        complete = completed(ExitKind.ALL_REDUCE, ops.complete_onto(value, residual, topology))
        if carries:
            return (option(ExitKind.LEAVE_TO_NEXT_INPUT, (), value), complete)
        return (complete,)

    options = list(deferred)
    dp = topology.active((TokenAxis.ATTN_DP,))
    returns_to_dp_rows = bool(dp) and Layout(compute.sharded + dp) == residual
    if stack.policy.allows_rsv and returns_to_dp_rows and set(dp) <= set(owed):
        rest = tuple(a for a in owed if a not in dp)
        steps = ops.reduce_scatter(dp, topology)
        if rest and not leaving:
            options.append(option(ExitKind.DP_REDUCE_SCATTER, steps, Placement(residual, rest)))
        else:
            options.append(completed(ExitKind.DP_REDUCE_SCATTER, steps + ops.all_reduce(rest)))
    if stack.policy.allows_rs and residual != compute and not compute.sharded:
        scattered = Layout(owed)
        if scattered.sharded[: len(residual.sharded)] == residual.sharded:
            steps = ops.reduce_scatter(owed, topology) + ops.relayout(scattered, residual, topology)
            options.append(completed(ExitKind.REDUCE_SCATTER, steps))
    if compute == residual and not leaving:
        options.append(option(ExitKind.LEAVE_TO_NEXT_INPUT, (), value))
    else:
        steps = ops.all_reduce(owed) + ops.relayout(compute, residual, topology)
        options.append(completed(ExitKind.ALL_REDUCE, steps))
    return tuple(options)


def sends_written(producer: StageDeclaration, residual: Layout, topology: Topology) -> bool:
    """Whether `to_pp` after `producer` folds its output and sends the residual alone.

    It does when the residual is not on the attention's rows (an FFN on its own rows, an
    input-scattered batch) or the update is not plain (its parameters stay on the sending
    rank); otherwise it sends the completed output and the residual, and the receiver's fused
    update + read applies them. Both ranks decide it from the producer's declaration.
    """
    return residual != topology.attention_rows() or not producer.update.plain


def leave_entry(handoff: Placement | None, residual: Layout, topology: Topology) -> EntryPath:
    """How the stack's leaving read (or `to_pp`) takes `handoff` (None: a written stream) with
    the residual on `residual` rows: complete onto those rows, update, then move the residual to
    the attention's rows and read it there."""
    attention = topology.attention_rows()
    move = ops.relayout(residual, attention, topology)
    return _entry(
        handoff,
        initial=False,
        residual_from=residual,
        residual=residual,
        compute=attention,
        read_after_move=bool(move),
        topology=topology,
    )


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


def bind_stage(
    declaration: StageDeclaration,
    incoming: Edge,
    outgoing: Edge,
    stack: StackFacts,
    rows: dict[BatchVariant, tuple[StageRows | None, StageRows]],
    fusions: FusionProvider | None = None,
    producer_fusions: FusionProvider | None = None,
    *,
    final_read: ResidualReadout | None = None,
) -> StagePlan:
    """Binds one stage between the edge it is entered through and the edge it leaves by.

    Args:
      declaration: The stage, with its place set.
      incoming: The edge from its producer (or the stack input).
      outgoing: The edge to its consumer (or the final read).
      stack: The stack's facts.
      rows: Per variant, the rows of (the producer, this stage); None for the stack input.
      fusions: This stage's provider (None: the stack's).
      producer_fusions: The producer's provider (None: the stack's).
      final_read: At a stack exit, the read the stack leaves through.

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
            return _entry(
                handoff,
                initial=initial,
                residual_from=residual_from,
                residual=residual,
                compute=compute,
                reads_before_dp_gather=declaration.read.reads_before_dp_gather,
                topology=topology,
                transport=transport,
            )

        entries: list[EntryPath] = []
        primary = None
        handoffs = {Placement(residual)}
        if incoming.kind is EdgeKind.STACK_ENTRY:
            owed = incoming.producer.owed
            owed_axes = () if owed is None else topology.sum_axes(owed)
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
        path = StagePath(
            variant,
            residual,
            compute,
            compute_owed(declaration, topology),
            tuple(entries),
            exit_options(declaration, outgoing, variant, stack, own, fusions),
        )
        _check_path(path, topology)
        paths.append(path)
    plan = StagePlan(
        declaration, topology, stack.policy, tuple(paths), fusions=fusions, final_read=final_read
    )
    if declaration.kind is StageKind.ATTN:
        candidates = fusions.attn_input_fusions(plan)
    else:
        candidates = fusions.ffn_input_fusions(plan)
    final = () if final_read is None else tuple(fusions.final_input_fusions(plan))
    return dataclasses.replace(plan, input_fusions=tuple(candidates), final_fusions=final)


def _check_path(path: StagePath, topology: Topology) -> None:
    """Simulates every step of `path`: each owed item completes once, in order, on the rows that
    read it.

    Raises:
      PlanError: A bound path does not land where its stage reads (a binding bug); the message
        names the path and where it landed.
    """
    residual = Placement(path.residual_layout)

    def expect(landed: Placement, want: Placement, what: str) -> None:
        if landed != want:
            raise PlanError(
                f"{what} of the {path.variant.value} path lands on {landed}, but the stage reads "
                f"{want}; this is a binding bug: report it with the stack's declarations"
            )

    for entry in path.entries:
        if not entry.initial:
            expect(
                ops.simulate(entry.residual_move, Placement(entry.residual_from)),
                residual,
                f"the residual move of the entry from {entry.residual_from}",
            )
        if entry.handoff is not None:
            expect(
                ops.simulate(entry.complete + ops.all_reduce(entry.fused_sum), entry.handoff),
                residual,
                f"the completion of {entry.handoff}",
            )
        expect(
            ops.simulate(entry.move_input, residual),
            Placement(path.compute_layout),
            "the input move",
        )
    for option in path.exits:
        expect(
            ops.simulate(option.steps, Placement(path.compute_layout, path.owed)),
            Placement(option.handoff.layout, option.handoff.owed),
            f"the {option.kind.name} exit",
        )
        work = option.owed
        expect(
            ops.simulate(work.in_place, work.placement),
            work.placement.completed(),
            "in-place completion",
        )
        expect(
            ops.simulate(work.onto_residual, work.placement),
            residual,
            "completion onto the residual",
        )
        if option.fold_to is not None:
            if option.handoff != residual:
                raise PlanError(
                    f"a folding exit must hand on a complete value on {residual}; got {option}"
                )
            ops.simulate(ops.relayout(path.residual_layout, option.fold_to, topology), residual)
        if option.leave is not None:
            leave = option.leave
            rows = Placement(leave.residual_from)
            if leave.handoff is not None:
                expect(
                    ops.simulate(leave.complete + ops.all_reduce(leave.fused_sum), leave.handoff),
                    rows,
                    "the leaving completion",
                )
            expect(
                ops.simulate(leave.move_input, rows),
                Placement(topology.attention_rows()),
                "the leaving move",
            )


def rows_fit(steps: tuple[Step, ...], rows: int, topology: Topology) -> bool:
    """Whether `rows` local rows divide evenly through every scatter and slice of `steps`."""
    for step in steps:
        if isinstance(step, (ReduceScatter, TakeBlock)):
            if rows % step.parts:
                return False
            rows //= step.parts
        elif isinstance(step, AllGather):
            rows *= topology.size(step.axes)
    return True


def describe_steps(steps: tuple[Step, ...]) -> str:
    """`steps` in words, e.g. "reduce-scatter over attn_dp x attn_tp, all-gather over attn_tp"."""

    def over(axes):
        return " x ".join(axis.mesh_name for axis in axes)

    words = {
        AllReduce: "all-reduce",
        ReduceScatter: "reduce-scatter",
        AllGather: "all-gather",
        TakeBlock: "local slice",
    }
    return ", ".join(f"{words[type(step)]} over {over(step.axes)}" for step in steps) or "nothing"


def describe_path(path: StagePath) -> dict[str, object]:
    """A JSON-friendly account of one bound path: what each entry and exit option runs."""
    entries = []
    for entry in path.entries:
        if entry.initial:
            source = f"stack input ({entry.handoff})"
        elif entry.handoff is None:
            source = f"written residual on rows {entry.residual_from}"
        else:
            source = f"pending contribution ({entry.handoff})"
        completion = entry.residual_move + entry.complete
        entries.append(
            {
                "primary": entry.primary,
                "from": source,
                "completes": describe_steps(completion),
                "fused_with_add_norm": describe_steps(ops.all_reduce(entry.fused_sum)),
                "reads_on_rows": str(path.residual_layout),
                "moves_input": describe_steps(entry.move_input),
            }
        )
    exits = [
        {
            "exit": option.kind.value,
            "runs": describe_steps(option.steps),
            "hands_on": str(option.handoff),
            **({"then_folds_and_moves_residual_to": str(option.fold_to)} if option.fold_to else {}),
        }
        for option in path.exits
    ]
    return {
        "variant": path.variant.value,
        "residual_rows": str(path.residual_layout),
        "compute_rows": str(path.compute_layout),
        "entries": entries,
        "exit_options": exits,
    }
