"""Binding: every decision about rows, sums and their order, made once when a stack closes.

`bind_stage` turns a declaration and its neighbours into a `StagePlan`: for each supported batch
variant, the entry paths that complete whatever the producer hands on and read the residual into
the compute input, and the ordered exit options the reduction policy permits. Both sides of a
boundary are derived by the same function (`exit_options`), so they always agree; every path is
checked by simulating its steps, so an owed sum is completed exactly once on the right rows.
"""

from __future__ import annotations

import dataclasses
import enum

from . import ops
from .contracts import Placement, ProducerReduction, ReductionPolicy, StageKind
from .declare import StageDeclaration
from .fusions import FusionProvider, InputFusion
from .layout import BatchVariant, Layout, TokenAxis, Topology
from .ops import AllGather, AllReduce, ReduceScatter, Step, TakeBlock


class ExitKind(enum.Enum):
    """What a stage's exit does with the sum its output owes."""

    RECORD_PARTIAL = "hands the partial sum to the next input"
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
      input_owed: Axes over which the stack input (e.g. a vocab-parallel embedding) still owes
        a sum when it reaches the first stage.
      variants: The batch variants every stage of this stack supports.
    """

    topology: Topology
    policy: ReductionPolicy
    input_owed: tuple[TokenAxis, ...]
    variants: tuple[BatchVariant, ...]

    def __post_init__(self):
        if self.policy is ReductionPolicy.AUTO:
            raise ValueError("StackFacts needs a resolved reduction policy, not AUTO")


@dataclasses.dataclass(frozen=True)
class ExitOption:
    """One way a stage's exit may hand its output on.

    Attributes:
      kind: What the exit does with the owed sum.
      steps: Movements run at the exit, on the compute output.
      handoff: Rows and owed sum of what the next input receives.
      fold_to: At the end of a stack whose residual is on finer rows than the stack's output:
        fold the complete output into the residual, then move the residual to these rows.
    """

    kind: ExitKind
    steps: tuple[Step, ...]
    handoff: Placement
    fold_to: Layout | None = None

    @property
    def completes_now(self) -> bool:
        return self.handoff.complete


@dataclasses.dataclass(frozen=True)
class EntryPath:
    """How a stage's input is prepared from one kind of stream.

    Attributes:
      handoff: The pending contribution this path takes (for `initial`, the raw stack input's
        rows and owed sum); None for a written stream.
      initial: The path starts the residual from the stack input.
      residual_from: Rows the stream's residual arrives on.
      residual_move: Movements of an arriving written residual onto this stage's residual rows.
      complete: Movements that complete the contribution onto the residual's rows, except
        `fused_sum`.
      fused_sum: An all-reduce on the residual's rows left for the update + read (where a fused
        sum + add + norm can take it).
      move_input: Movements from the residual's rows to the compute rows.
      read_after_move: The read runs on the moved rows (the read does not read before a DP
        gather).
      primary: The entry the producer's preferred exit option (or the stack input) leads to.
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


@dataclasses.dataclass(frozen=True)
class StagePath:
    """Everything one batch variant of one stage runs.

    Attributes:
      variant: The batch variant.
      residual_layout: Rows of the residual while this stage runs.
      compute_layout: Rows of the compute input and output.
      entries: One entry path per stream kind this stage may receive.
      exits: Exit options in preference order; the last always applies.
    """

    variant: BatchVariant
    residual_layout: Layout
    compute_layout: Layout
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
    """

    declaration: StageDeclaration
    topology: Topology
    policy: ReductionPolicy
    paths: tuple[StagePath, ...]
    input_fusions: tuple[InputFusion, ...] = ()

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


def residual_layout(topology: Topology, variant: BatchVariant) -> Layout:
    if variant is BatchVariant.INPUT_SCATTERED:
        return topology.layout(TokenAxis.ATTN_DP, TokenAxis.ATTN_TP)
    return topology.attention_rows()


def compute_layout(declaration: StageDeclaration, topology: Topology) -> Layout:
    if declaration.kind is StageKind.ATTN:
        return topology.attention_rows()
    return topology.layout()


def supported_variants(
    declarations: tuple[StageDeclaration, ...], topology: Topology
) -> tuple[BatchVariant, ...]:
    """The batch variants a stack of `declarations` can run on `topology`."""
    variants = [BatchVariant.ORDINARY]
    if topology.attn_tp > 1 and all(
        d.gathers_attn_tp_input for d in declarations if d.kind is StageKind.ATTN
    ):
        variants.append(BatchVariant.INPUT_SCATTERED)
    return tuple(variants)


def exit_options(
    declaration: StageDeclaration,
    consumer: StageDeclaration | None,
    variant: BatchVariant,
    stack: StackFacts,
) -> tuple[ExitOption, ...]:
    """The exit options of `declaration` before `consumer` (None: the stack ends), best first."""
    topology = stack.topology
    owed = () if declaration.output_complete else topology.sum_axes(declaration.sum_group)
    compute = compute_layout(declaration, topology)
    residual = residual_layout(topology, variant)
    value = Placement(compute, owed)
    terminal = consumer is None
    fold_to = (
        topology.attention_rows() if terminal and residual != topology.attention_rows() else None
    )

    if declaration.reduction is ProducerReduction.ALWAYS_PARTIAL:
        return (ExitOption(ExitKind.RECORD_PARTIAL, (), value),)

    def completed(kind: ExitKind, steps: tuple[Step, ...]) -> ExitOption:
        return ExitOption(kind, steps, Placement(residual), fold_to)

    if not owed:
        return (completed(ExitKind.MOVE_COMPLETE, ops.relayout(compute, residual, topology)),)

    if declaration.kind is StageKind.ATTN:
        carries = not terminal and (consumer.kind is StageKind.FFN or topology.attn_dp == 1)
        complete = completed(ExitKind.ALL_REDUCE, ops.complete_onto(value, residual, topology))
        if carries:
            return (ExitOption(ExitKind.LEAVE_TO_NEXT_INPUT, (), value), complete)
        return (complete,)

    options = []
    dp = topology.active((TokenAxis.ATTN_DP,))
    returns_to_dp_rows = bool(dp) and Layout(compute.sharded + dp) == residual
    if stack.policy.allows_rsv and returns_to_dp_rows and set(dp) <= set(owed):
        rest = tuple(a for a in owed if a not in dp)
        steps = ops.reduce_scatter(dp, topology)
        if rest and not terminal:
            options.append(ExitOption(ExitKind.DP_REDUCE_SCATTER, steps, Placement(residual, rest)))
        else:
            options.append(completed(ExitKind.DP_REDUCE_SCATTER, steps + ops.all_reduce(rest)))
    if stack.policy.allows_rs and residual != compute and not compute.sharded:
        scattered = Layout(owed)
        if scattered.sharded[: len(residual.sharded)] == residual.sharded:
            steps = ops.reduce_scatter(owed, topology) + ops.relayout(scattered, residual, topology)
            options.append(completed(ExitKind.REDUCE_SCATTER, steps))
    if compute == residual and not terminal:
        options.append(ExitOption(ExitKind.LEAVE_TO_NEXT_INPUT, (), value))
    else:
        steps = ops.all_reduce(owed) + ops.relayout(compute, residual, topology)
        options.append(completed(ExitKind.ALL_REDUCE, steps))
    return tuple(options)


def _entry(
    handoff: Placement | None,
    *,
    initial: bool,
    residual_from: Layout,
    residual: Layout,
    compute: Layout,
    reads_before_dp_gather: bool,
    topology: Topology,
) -> EntryPath:
    complete: tuple[Step, ...] = ()
    fused: tuple[TokenAxis, ...] = ()
    if handoff is not None:
        complete = ops.complete_onto(handoff, residual, topology)
        if not initial and complete and isinstance(complete[-1], AllReduce):
            fused = complete[-1].axes
            complete = complete[:-1]
    move = ops.relayout(residual, compute, topology)
    gathers_dp = any(
        isinstance(step, AllGather) and TokenAxis.ATTN_DP in step.axes for step in move
    )
    return EntryPath(
        handoff,
        initial,
        residual_from,
        ops.relayout(residual_from, residual, topology),
        complete,
        fused,
        move,
        gathers_dp and not reads_before_dp_gather,
    )


def bind_stage(
    declaration: StageDeclaration,
    producer: StageDeclaration | None,
    consumer: StageDeclaration | None,
    stack: StackFacts,
    fusions: FusionProvider | None = None,
) -> StagePlan:
    """Binds one stage between its producer (None: the stack input) and consumer (None: the end).

    `fusions` supplies the ordered fused candidates of this stage's input.

    Raises:
      NotImplementedError: The stage needs a path boundary-jax does not implement.
      ValueError: The declaration contradicts its neighbours.
    """
    topology = stack.topology
    if declaration.sparse:
        raise NotImplementedError(
            "sparse (MoE) FFN stages have no bound path yet; declare the FFN dense"
        )
    paths = []
    for variant in stack.variants:
        residual = residual_layout(topology, variant)
        compute = compute_layout(declaration, topology)

        def entry(
            handoff, initial=False, residual_from=residual, residual=residual, compute=compute
        ):
            return _entry(
                handoff,
                initial=initial,
                residual_from=residual_from,
                residual=residual,
                compute=compute,
                reads_before_dp_gather=declaration.read.reads_before_dp_gather,
                topology=topology,
            )

        handoffs = {Placement(residual)}
        primary = None
        if producer is not None:
            options = exit_options(producer, declaration, variant, stack)
            primary = options[0].handoff
            for option in options:
                handoffs |= {option.handoff, option.handoff.completed()}
        entries = [entry(None)] + [entry(h) for h in sorted(handoffs, key=str)]
        if producer is None:
            rows = topology.attention_rows()
            entries.append(entry(Placement(rows, stack.input_owed), True, rows))
            if rows != residual:
                entries.append(entry(None, residual_from=rows))
        entries = [
            dataclasses.replace(
                e, primary=e.initial or (primary is not None and e.handoff == primary)
            )
            for e in entries
        ]
        path = StagePath(
            variant,
            residual,
            compute,
            tuple(entries),
            exit_options(declaration, consumer, variant, stack),
        )
        _check_path(path, declaration, topology)
        paths.append(path)
    plan = StagePlan(declaration, topology, stack.policy, tuple(paths))
    if fusions is None:
        return plan
    if declaration.kind is StageKind.ATTN:
        candidates = fusions.attn_input_fusions(plan)
    else:
        candidates = fusions.ffn_input_fusions(plan)
    return dataclasses.replace(plan, input_fusions=tuple(candidates))


def _check_path(path: StagePath, declaration: StageDeclaration, topology: Topology) -> None:
    """Simulates every step of `path`: each sum completes once, on the rows that read it."""
    residual = Placement(path.residual_layout)
    for entry in path.entries:
        if not entry.initial:
            moved = ops.simulate(entry.residual_move, Placement(entry.residual_from))
            assert moved == residual, (entry, moved)
        if entry.handoff is not None:
            landed = ops.simulate(entry.complete + ops.all_reduce(entry.fused_sum), entry.handoff)
            assert landed == residual, (entry, landed)
        moved = ops.simulate(entry.move_input, residual)
        assert moved == Placement(path.compute_layout), (entry, moved)
    owed = () if declaration.output_complete else topology.sum_axes(declaration.sum_group)
    for option in path.exits:
        landed = ops.simulate(option.steps, Placement(path.compute_layout, owed))
        assert landed == option.handoff, (option, landed)
        if option.fold_to is not None:
            assert option.handoff == residual, option
            ops.simulate(ops.relayout(path.residual_layout, option.fold_to, topology), residual)


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
