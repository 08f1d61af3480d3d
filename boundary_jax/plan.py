"""What binding decided: frozen plan types, from one owed-work record up to a stage's whole plan.

Nothing here decides anything; `bind` fills these records in and `check` simulates them. A
boundary, a residual helper or a fusion request at run time only selects among them by the batch
(its variant, its rows) and the stream's static state (what it has pending, where its residual
is). `Placement` (a value's rows and owed work, defined in `placement.py` below the operations
that use it) is re-exported here beside the plan types that hold it.
"""

from __future__ import annotations

import dataclasses
import enum

from .declare import EdgeKind, StageDeclaration
from .designs.protocols import ResidualReadout
from .fusions import FusionProvider, InputFusion
from .layout import BatchVariant, Layout, TokenAxis, Topology
from .ops import AllGather, ReduceScatter, Step, TakeBlock, all_reduce
from .placement import Placement as Placement
from .policy import ReductionPolicy


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
      final_read: The read the stack leaves through (`residual_stream.final_norm` applies it).
      rejected: Batch variants the topology would support but the stack does not bind, each
        with the reason (named when such a batch runs).
    """

    topology: Topology
    policy: ReductionPolicy
    variants: tuple[BatchVariant, ...]
    fusions: FusionProvider
    final_read: ResidualReadout
    rejected: tuple[tuple[BatchVariant, str], ...] = ()

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
class ResidualRows:
    """The rows a stream's residual is on, with the bound move of a value from the attention's
    rows onto them (local slices only: the residual's rows refine the attention's).

    Attributes:
      layout: The residual's rows.
      from_attention: The steps `residual_stream.onto_residual_rows` runs; empty on the
        attention's rows.
    """

    layout: Layout
    from_attention: tuple[Step, ...] = ()

    @classmethod
    def attention(cls, topology: Topology) -> ResidualRows:
        """The attention's rows: nothing moves onto them."""
        return cls(topology.attention_rows())


@dataclasses.dataclass(frozen=True)
class OwedWork:
    """What a contribution still owes, with the unfused steps that complete it.

    Bound with the exit that hands it on (or with the entry that rebuilds it), so a residual
    helper runs only decided steps.

    Attributes:
      placement: The value's rows and owed work (finalize, then sums).
      in_place: Completes every owed item on the value's own rows (`complete_output`).
      onto_residual: Completes it and moves it onto the residual's rows (`fold`, `snapshot`,
        `add_to_output`, `to_pp`).
      then: The record after `in_place` ran; None when nothing is owed.
    """

    placement: Placement
    in_place: tuple[Step, ...]
    onto_residual: tuple[Step, ...]
    then: OwedWork | None

    @classmethod
    def nothing(cls, residual: Layout) -> OwedWork:
        """The record of a complete value already on the residual's rows: nothing to run."""
        return cls(Placement(residual), (), (), None)


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

    def unfused(self, topology: Topology) -> EntryPath:
        """This path with the fused sum completed among the unfused steps (for a capture of the
        updated residual, which needs the sum complete before the update)."""
        if not self.fused_sum:
            return self
        return dataclasses.replace(
            self, complete=self.complete + all_reduce(self.fused_sum, topology), fused_sum=()
        )


@dataclasses.dataclass(frozen=True)
class Leave:
    """How a stream leaves the stack after the stage that exited it.

    Bound with the exit option, for every form the stream may have when it leaves: what the
    option handed on, that value completed in place (`complete_output`), a complete value on the
    residual's rows (`add_to_output`), or the residual alone (`fold`, a folding exit).

    Attributes:
      kind: The edge the stage leaves by: STACK_EXIT (the final read), PIPELINE_SEND (`to_pp`)
        or NEXT_STAGE (only `take_output` may leave there).
      entries: One leaving path per form, each completing what is owed, applying the update
        and moving the residual onto the attention's rows.
      final_read: At a stack exit, the read `final_norm` applies.
      sends_written: For a pipeline send: fold and send the residual alone.
      final_fusions: At a stack exit, fused candidates for the final read.
    """

    kind: EdgeKind
    entries: tuple[EntryPath, ...]
    final_read: ResidualReadout | None = None
    sends_written: bool = False
    final_fusions: tuple[InputFusion, ...] = ()

    def entry(self, handoff: Placement | None) -> EntryPath:
        """The leaving path for a stream whose pending contribution is on `handoff` (None:
        written).

        Raises:
          RuntimeError: No leaving path is bound for that form (a binding bug).
        """
        for entry in self.entries:
            if entry.handoff == handoff:
                return entry
        bound = ", ".join(str(e.handoff or "written") for e in self.entries)
        raise RuntimeError(
            f"no leaving path is bound for a stream pending {handoff or 'nothing'} (bound: "
            f"{bound}); this is a binding bug: report it with the stack's declarations"
        )


@dataclasses.dataclass(frozen=True)
class ExitOption:
    """One way a stage's exit may hand its output on.

    Attributes:
      kind: What the exit does with the owed work.
      output: The compute output's record before the exit runs (a finalize owed when the option
        hands the finalize on).
      steps: Movements run at the exit, on the compute output.
      handoff: Rows and owed work of what the next input receives.
      work: The handed-on contribution's owed-work record.
      fold_to: At a stack exit whose residual is on finer rows than the stack's output: fold the
        complete output into the residual, then move the residual to these rows (the
        attention's).
      fold_steps: The residual's move onto `fold_to`.
      leave: How the stream leaves after this option: the final read at a stack exit, `to_pp`
        at a pipeline send, `take_output` anywhere.
    """

    kind: ExitKind
    output: Placement
    steps: tuple[Step, ...]
    handoff: Placement
    work: OwedWork
    fold_to: ResidualRows | None
    fold_steps: tuple[Step, ...]
    leave: Leave

    @property
    def completes_now(self) -> bool:
        return self.handoff.complete

    @property
    def defers_finalize(self) -> bool:
        return self.handoff.finalize


@dataclasses.dataclass(frozen=True)
class BranchFork:
    """How a branch's first stage starts from its source's prepared input (`branch_input`).

    The source's read has run: its compute input and the residual it wrote are taken as they
    are (the branch's first norm is never applied), and moved onto the branch's rows.

    Attributes:
      source_residual: Rows of the residual the source wrote.
      residual_move: Its move onto the branch's residual rows (the fork of the stream).
      source_compute: Rows of the source's compute input.
      input_move: Its move onto the branch's first compute rows.
    """

    source_residual: Layout
    residual_move: tuple[Step, ...]
    source_compute: Layout
    input_move: tuple[Step, ...]


@dataclasses.dataclass(frozen=True)
class BranchMerge:
    """How a branch's last output joins its source's output (`branch_output`, `merge_branch`).

    The branch's residual already holds the residual it forked from, so the merged stream's
    residual is the branch's (with the branch's output folded in), and the source's output stays
    pending on it: the next input completes and adds it as if no branch had run.

    Attributes:
      into: Rows of the source's residual, where the merged residual is.
      residual_moves: For each rows the branch's residual may leave on, its move onto `into`.
      defers: The branch's handoffs that the merge adds, unsummed, to a source output owing the
        same work on the same rows: its one completion completes both. Any other handoff
        completes onto the branch's residual rows at `branch_output`.
    """

    into: Layout
    residual_moves: tuple[tuple[Layout, tuple[Step, ...]], ...]
    defers: tuple[Placement, ...] = ()

    def residual_move(self, rows: Layout) -> tuple[Step, ...]:
        """The bound move of a branch residual on `rows` onto `into`.

        Raises:
          RuntimeError: No move is bound from those rows (a binding bug).
        """
        for source, steps in self.residual_moves:
            if source == rows:
                return steps
        raise RuntimeError(
            f"no merge move is bound for a branch residual on {rows}; this is a binding bug: "
            "report it with the stack's declarations"
        )


@dataclasses.dataclass(frozen=True)
class StagePath:
    """Everything one batch variant of one stage runs.

    Attributes:
      variant: The batch variant.
      residual_rows: Rows of the residual while this stage runs, with the bound move onto them.
      compute_layout: Rows of the compute input and output.
      owed: Token axes over which compute leaves its output unreduced.
      entries: One entry path per stream kind this stage may receive (none for a branch's
        first stage, entered through `fork`).
      exits: Exit options in preference order; the last always applies.
      fork: For a branch's first stage, how it starts from its source's prepared input.
      merge: For a branch's last stage, how its output merges into its source's.
    """

    variant: BatchVariant
    residual_rows: ResidualRows
    compute_layout: Layout
    owed: tuple[TokenAxis, ...]
    entries: tuple[EntryPath, ...]
    exits: tuple[ExitOption, ...]
    fork: BranchFork | None = None
    merge: BranchMerge | None = None

    @property
    def residual_layout(self) -> Layout:
        return self.residual_rows.layout

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

    @property
    def transport_entry(self) -> EntryPath | None:
        """The entry a pipeline receive takes; None unless this stage is entered through one."""
        return next((path for path in self.entries if path.transport), None)


@dataclasses.dataclass(frozen=True)
class CountedOnce:
    """Where one replicated part of a stage's output is added (`declare.Replicated`).

    Attributes:
      name: The part's name.
      ranks: Mesh axes of the sum that counts the part: only their first rank adds it. Empty:
        no sum runs over ranks that hold it alike, so every rank adds it.
    """

    name: str
    ranks: tuple[str, ...]

    def describe(self) -> str:
        """Where the part is added, in words."""
        if not self.ranks:
            return "added on every rank (no sum over ranks holding it alike)"
        return f"added on the first rank of {' x '.join(self.ranks)} only"


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
      rejected: Batch variants its stack does not bind, each with the reason.
      counted_once: Where each replicated part the declaration names is added.
    """

    declaration: StageDeclaration
    topology: Topology
    policy: ReductionPolicy
    paths: tuple[StagePath, ...]
    input_fusions: tuple[InputFusion, ...] = ()
    fusions: FusionProvider = dataclasses.field(default=FusionProvider(), compare=False)
    rejected: tuple[tuple[BatchVariant, str], ...] = ()
    counted_once: tuple[CountedOnce, ...] = ()

    def path(self, variant: BatchVariant) -> StagePath:
        """The path bound for `variant`.

        Raises:
          NotImplementedError: No path is bound for the variant.
        """
        for path in self.paths:
            if path.variant is variant:
                return path
        supported = ", ".join(p.variant.value for p in self.paths)
        reason = dict(self.rejected).get(variant)
        raise NotImplementedError(
            f"no stage boundary path for the active {variant.value} batch (this "
            f"{self.declaration.kind.value} stage supports: {supported}"
            + (f"; {reason}" if reason else "")
            + "); reject the configuration before building the model"
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
