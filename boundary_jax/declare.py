"""Model-facing stage declarations, and the typed edges that give a declaration its place.

A declaration holds no mesh, no array and no plan: what its compute does, and (for the read,
update and output transform) the objects a boundary runs, whose capabilities binding reads. When
its layer stack closes, each stage is given its place: the edge it is entered through and the edge
it leaves by.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Callable

from .designs.add_norm import AddNormRead, PlainAdd
from .designs.protocols import (
    DesignFacts,
    ResidualReadout,
    ResidualUpdate,
    read_facts,
    update_facts,
)
from .layout import SumGroup
from .ops import RowGather


class StageKind(enum.Enum):
    """What a stage computes: a token mixer (attention, SSM) or an FFN (dense or sparse)."""

    ATTN = "attention"
    FFN = "ffn"


class EdgeKind(enum.Enum):
    """How a stage is joined to what comes before or after it."""

    STACK_ENTRY = "stack entry"
    NEXT_STAGE = "next stage"
    STACK_EXIT = "stack exit into the final read"
    PIPELINE_SEND = "pipeline send"
    PIPELINE_RECEIVE = "pipeline receive"
    BRANCH_FORK = "branch fork from a source's prepared input"
    BRANCH_MERGE = "branch merge into the source's output"


class ProducerReduction(enum.Enum):
    """How a stage's compute cooperates with the sum its output owes.

    ALWAYS_PARTIAL: compute always returns an unreduced contribution; the next stage's input
      completes it. Attention only (the `declare_attn()` default).
    EXIT_SCOPED: the stage's exit decides, before compute, whether the sum completes at the exit,
      in a reduce-scatter on the way back, or at the next input. Every FFN, and every
      single-stage mixer (`declare_mixer()`).
    """

    ALWAYS_PARTIAL = "ALWAYS_PARTIAL"
    EXIT_SCOPED = "EXIT_SCOPED"


OutputTransform = Callable  # a pure function of the value, or an nnx.Module applied to it


class MoeDispatch(enum.Enum):
    """Where a sparse FFN's experts get their tokens.

    GATHER: the MoE runs on every attention-DP rank's rows, like a dense FFN over the full TP
      group; its output owes a sum over the MoE output group.
    ALL_TO_ALL: the MoE runs on this rank's own rows and moves tokens to the ranks holding their
      experts and back inside compute; its output owes no sum.
    """

    GATHER = "gather"
    ALL_TO_ALL = "all-to-all"


@dataclasses.dataclass(frozen=True)
class Replicated:
    """A part of a stage's output that every rank of a sum computes in full on the same rows (a
    shared expert with its own TP size 1, a bias on a row-parallel projection): the sum would
    count it once per rank, so only the first rank of the sum adds it.

    Compute asks the boundary whether this rank adds it (`StageBoundary.counts(name, stream)`)
    and adds it only where the answer is true; the plan shows on which ranks.

    Attributes:
      name: The part's name, as compute asks for it and the plan shows it.
      group: The group whose ranks hold the part whole and whose sum adds it, where that sum is
        not the one the stage's output owes at its exit (an expert's down bias is whole on the
        `SumGroup.MOE_TP` ranks that sum their width shares, inside compute under an expert
        all-to-all). None: the sum the output owes at its exit; a stage whose output owes none
        there (an FFN on its own rows) adds the part on every rank.
    """

    name: str
    group: SumGroup | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a replicated part needs a non-empty name; got name={self.name!r}")


@dataclasses.dataclass(frozen=True)
class StageDeclaration:
    """What one stage's compute does, as the boundary needs to know it.

    Attributes:
      kind: Attention/mixer or FFN.
      read: How this stage reads the residual into its input; in a bound declaration, its
        `DesignFacts` (the object runs on the boundary).
      update: How this stage's complete output joins the residual; likewise facts once bound.
      reduction: How compute cooperates with the sum its output owes.
      gathers_attn_tp_input: The boundary may gather this stage's input from attention-TP slices
        (needed for input-scattered batches and after an FFN on its own rows). Attention only.
      has_output_transform: An output transform runs on the complete output before the update.
      transform_before_reduce_scatter: The transform commutes with the sum and runs before a
        reduce-scatter, preserving an implementation's order.
      sparse: The FFN is a sparse (MoE) FFN; its output owes a sum over `SumGroup.MOE_OUTPUT`
        and may owe a finalize.
      moe_dispatch: For a sparse FFN, where its experts get their tokens.
      dense_tp_size: For a dense FFN, the ranks its weights are split over: None (the full TP
        group), the attention-TP size, or 1 (fully data-parallel on this rank's own rows).
      next_sparse: Declared sparsity of the next FFN (checked against the stack when bound).
      output_complete: Compute completes its own output sum (fused with a reduction it needs
        anyway); the exit owes no sum. FFN only.
      replicated: Parts of the output every rank of a sum computes in full, each added on the
        sum's first rank only (`Replicated`).
      attn_tp_gather: The stage's own gather over attention TP of the rows brought into it
        (`ops.RowGather`), tried on every batch before the built-in gather: at its entry, and at
        its producer's exit (an exit runs its consumer's gather), across a pipeline cut too.
        Attention and mixers only.
      place: Set when the stack binds this declaration; None for a fresh declaration.
      output_transform: The transform itself; moved onto the boundary by `append_stages`.
    """

    kind: StageKind
    read: ResidualReadout | DesignFacts
    update: ResidualUpdate | DesignFacts
    reduction: ProducerReduction
    gathers_attn_tp_input: bool = True
    has_output_transform: bool = False
    transform_before_reduce_scatter: bool = False
    sparse: bool = False
    moe_dispatch: MoeDispatch = MoeDispatch.GATHER
    dense_tp_size: int | None = None
    next_sparse: bool | None = None
    output_complete: bool = False
    replicated: tuple[Replicated, ...] = ()
    attn_tp_gather: RowGather | None = None
    place: StackPlace | None = None
    output_transform: OutputTransform | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self):
        if self.kind is StageKind.FFN and self.reduction is ProducerReduction.ALWAYS_PARTIAL:
            raise ValueError(
                "ALWAYS_PARTIAL is not supported for ffn stages: an FFN's exit decides where its "
                "sum completes. Use declare_ffn() (EXIT_SCOPED)."
            )
        if self.update.applied_at_exit and self.reduction is ProducerReduction.ALWAYS_PARTIAL:
            raise ValueError(
                "an update applied_at_exit runs at the producer's exit, but an ALWAYS_PARTIAL "
                "attention leaves its sum to the next input; declare the stage with "
                "declare_mixer() (its exit completes the sum) or apply the update at the next "
                "input"
            )
        if self.attn_tp_gather is not None and self.kind is not StageKind.ATTN:
            raise ValueError(
                "attn_tp_gather is an attention or mixer fact (the gather that brings rows into "
                "it); an FFN's rows move by its declaration (dense_tp_size, moe_dispatch)"
            )
        if self.kind is StageKind.ATTN and self.output_complete:
            raise ValueError("output_complete is an FFN fact; attention stages always owe a sum")
        if self.output_complete and self.reduction is not ProducerReduction.EXIT_SCOPED:
            raise ValueError(
                f"output_complete=True needs EXIT_SCOPED; got reduction={self.reduction!r}"
            )
        if self.transform_before_reduce_scatter and not self.has_output_transform:
            raise ValueError("transform_before_reduce_scatter=True needs an output_transform")
        if self.sparse and self.dense_tp_size is not None:
            raise ValueError(
                f"dense_tp_size is a dense FFN fact; a sparse FFN takes moe_dispatch ({self=})"
            )
        if self.dense_tp_size is not None and (
            not isinstance(self.dense_tp_size, int) or self.dense_tp_size < 1
        ):
            raise ValueError(
                "dense_tp_size must be a positive int or None; got "
                f"dense_tp_size={self.dense_tp_size!r}"
            )
        self._check_replicated()

    def _check_replicated(self) -> None:
        if not isinstance(self.replicated, tuple) or not all(
            isinstance(part, Replicated) for part in self.replicated
        ):
            raise TypeError(
                f"replicated takes a tuple of Replicated parts; got {self.replicated!r}"
            )
        names = [part.name for part in self.replicated]
        if len(set(names)) != len(names):
            raise ValueError(f"each replicated part needs its own name; got {names}")
        summed_by_compute = [p.name for p in self.replicated if p.group is None]
        if self.output_complete and summed_by_compute:
            raise ValueError(
                f"output_complete=True: compute sums the stage's output itself, so the exit owes "
                f"no sum to count {summed_by_compute} once in; name the group compute sums them "
                "over (Replicated(name, group=...))"
            )

    @property
    def sum_group(self) -> SumGroup:
        """The group over which compute leaves its output unreduced (before the topology says
        which of its axes have more than one rank)."""
        if self.kind is StageKind.ATTN:
            return SumGroup.ATTN_TP
        return SumGroup.MOE_OUTPUT if self.sparse else SumGroup.FULL_TP

    def facts(self) -> StageDeclaration:
        """What binding reads: capabilities, without the objects or the stack place."""
        return dataclasses.replace(
            self,
            read=self.read if isinstance(self.read, DesignFacts) else read_facts(self.read),
            update=self.update
            if isinstance(self.update, DesignFacts)
            else update_facts(self.update),
            output_transform=None,
            place=None,
        )


@dataclasses.dataclass(frozen=True)
class StackInput:
    """The producer at a stack entry: the raw stack input (e.g. an embedding).

    Attributes:
      sum_group: The sum the input still owes when it reaches the first stage (a
        vocab-parallel embedding owes `SumGroup.ATTN_TP`); None when it is complete.
    """

    sum_group: SumGroup | None = None


@dataclasses.dataclass(frozen=True)
class FinalRead:
    """The consumer at a stack exit: the read that turns the residual into the stack output.

    Attributes:
      read: The read's capabilities.
      attn_tp_gather: The final read's own gather over attention TP (`ops.RowGather`) of the
        rows the last stage leaves on this rank's slice, tried before the built-in gather.
      reads_attn_tp_slices: The final read reads this rank's attention-TP slice itself and
        gathers what it read; the last stage leaves its output there (no fold and gather of the
        residual at its exit).
    """

    read: DesignFacts
    attn_tp_gather: RowGather | None = None
    reads_attn_tp_slices: bool = False


@dataclasses.dataclass(frozen=True)
class Edge:
    """A typed edge between a producer and a consumer of the residual stream.

    Attributes:
      kind: What joins them.
      producer: The stack input at a stack entry; otherwise the producing stage's facts (across
        a pipeline receive, the previous rank's last stage, from `stage_facts`; at a branch
        fork, the source whose prepared input the branch starts from).
      consumer: The final read at a stack exit; otherwise the consuming stage's facts (across a
        pipeline send, the next rank's first stage, from `stage_facts`). At a branch merge, the
        consumer of the source's output the branch merges into (the final read where the source
        ends the stack).
    """

    kind: EdgeKind
    producer: StageDeclaration | StackInput
    consumer: StageDeclaration | FinalRead

    def __post_init__(self):
        entry = self.kind is EdgeKind.STACK_ENTRY
        if isinstance(self.producer, StackInput) != entry:
            raise TypeError(
                f"only a stack entry's producer is the StackInput; got a {self.kind.value} edge "
                f"from {type(self.producer).__name__}"
            )
        final = isinstance(self.consumer, FinalRead)
        if final != (self.kind is EdgeKind.STACK_EXIT) and self.kind is not EdgeKind.BRANCH_MERGE:
            raise TypeError(
                f"only a stack exit's (or a branch merge's) consumer is the FinalRead; got a "
                f"{self.kind.value} edge into {type(self.consumer).__name__}"
            )

    @property
    def leaves_stack(self) -> bool:
        """The edge's consumer is the stack's final read: whatever crosses it completes now."""
        return isinstance(self.consumer, FinalRead)


@dataclasses.dataclass(frozen=True)
class StackPlace:
    """Where a bound declaration sits in its layer stack.

    Attributes:
      incoming: The edge the stage is entered through.
      outgoing: The edge the stage leaves by.
    """

    incoming: Edge
    outgoing: Edge

    @property
    def previous(self) -> StageDeclaration | StackInput:
        """The producer: the stage before, or the stack input."""
        return self.incoming.producer

    @property
    def terminal(self) -> bool:
        """The stage ends the model's layer stack (its consumer is the final read)."""
        return self.outgoing.kind is EdgeKind.STACK_EXIT

    @property
    def forks(self) -> bool:
        """The stage opens a branch: it starts from its source's prepared input."""
        return self.incoming.kind is EdgeKind.BRANCH_FORK

    @property
    def merges(self) -> bool:
        """The stage closes a branch: its output merges into its source's output."""
        return self.outgoing.kind is EdgeKind.BRANCH_MERGE


def declare_attn(
    *,
    read: ResidualReadout = AddNormRead(),
    update: ResidualUpdate = PlainAdd(),
    reduction: ProducerReduction = ProducerReduction.ALWAYS_PARTIAL,
    gathers_attn_tp_input: bool = True,
    output_transform: OutputTransform | None = None,
    transform_before_reduce_scatter: bool = False,
    replicated: tuple[Replicated, ...] = (),
    attn_tp_gather: RowGather | None = None,
) -> StageDeclaration:
    """Declares an attention stage whose heads are split over attention TP.

    Compute returns its output projection unreduced (ALWAYS_PARTIAL), and the next stage's input
    completes the attention-TP sum. A token mixer whose exit decides where its sum completes (a
    Mamba2 block, or attention in a stack of one stage per layer) is `declare_mixer()`.

    Args:
      read: The residual read into this stage's input (a frozen design or an `nnx.Module`).
      update: How this stage's output joins the residual (a frozen design or an `nnx.Module`
        whose parameters become this stage's state).
      reduction: ALWAYS_PARTIAL. Deprecated: EXIT_SCOPED declares a single-stage mixer, which
        `declare_mixer()` now spells (it warns, and declares the same stage).
      gathers_attn_tp_input: Input may be gathered from attention-TP slices; False rules out
        input-scattered batches and FFNs on their own rows before this stage.
      output_transform: A function (or nnx.Module) applied to the complete output.
      transform_before_reduce_scatter: Apply the transform before a reduce-scatter.
      replicated: Parts of the output every rank of the sum computes in full (a bias on the
        output projection), each added by the sum's first rank only (`Replicated`).
      attn_tp_gather: The stage's own gather over attention TP (`ops.RowGather`), tried on
        every batch before the built-in one, at its entry and at its producer's exit.

    Returns:
      A fresh declaration for `append_stages`.
    """
    if reduction is ProducerReduction.EXIT_SCOPED:
        spelled = "" if not gathers_attn_tp_input else "gathers_attn_tp_input=True"
        warnings.warn(
            "declare_attn(reduction=ProducerReduction.EXIT_SCOPED) is deprecated: a mixer whose "
            f"exit decides where its sum completes is declare_mixer({spelled}) (the same "
            "declaration; its other arguments as for declare_attn)",
            DeprecationWarning,
            stacklevel=2,
        )
    return StageDeclaration(
        kind=StageKind.ATTN,
        read=read,
        update=update,
        reduction=reduction,
        gathers_attn_tp_input=gathers_attn_tp_input,
        has_output_transform=output_transform is not None,
        transform_before_reduce_scatter=transform_before_reduce_scatter,
        output_transform=output_transform,
        replicated=tuple(replicated),
        attn_tp_gather=attn_tp_gather,
    )


def declare_mixer(
    *,
    read: ResidualReadout = AddNormRead(),
    update: ResidualUpdate = PlainAdd(),
    gathers_attn_tp_input: bool = False,
    output_transform: OutputTransform | None = None,
    transform_before_reduce_scatter: bool = False,
    replicated: tuple[Replicated, ...] = (),
    attn_tp_gather: RowGather | None = None,
) -> StageDeclaration:
    """Declares a single-stage token mixer: a Mamba2 block, or attention in a hybrid stack whose
    layers hold one stage each (Nemotron-H).

    Like attention, compute runs on the attention's rows and returns its output unreduced over
    attention TP. Unlike attention (ALWAYS_PARTIAL), the mixer's exit decides before compute
    where that sum completes (EXIT_SCOPED), from the stage after it, which the stack knows when
    it binds: it leaves the sum to an FFN's input always, carries it to the next mixer's input
    without attention DP, and completes it itself otherwise.

    By default the mixer reads its own rows: the boundary never gathers its input from
    attention-TP slices, so a stack holding it binds no input-scattered path and rejects an FFN
    on its own rows before it.

    Args:
      read: The residual read into this stage's input (a frozen design or an `nnx.Module`).
      update: How this stage's output joins the residual (a frozen design or an `nnx.Module`
        whose parameters become this stage's state).
      gathers_attn_tp_input: The mixer's input may also be gathered from attention-TP slices,
        as attention's is (input-scattered batches, an FFN on its own rows before it).
      output_transform: A function (or nnx.Module) applied to the complete output.
      transform_before_reduce_scatter: Apply the transform before a reduce-scatter.
      replicated: Parts of the output every rank of the sum computes in full (a bias on the
        output projection), each added by the sum's first rank only (`Replicated`).
      attn_tp_gather: The stage's own gather over attention TP (`ops.RowGather`), tried on
        every batch before the built-in one, at its entry and at its producer's exit.

    Returns:
      A fresh declaration for `append_stages`.
    """
    return StageDeclaration(
        kind=StageKind.ATTN,
        read=read,
        update=update,
        reduction=ProducerReduction.EXIT_SCOPED,
        gathers_attn_tp_input=gathers_attn_tp_input,
        has_output_transform=output_transform is not None,
        transform_before_reduce_scatter=transform_before_reduce_scatter,
        output_transform=output_transform,
        replicated=tuple(replicated),
        attn_tp_gather=attn_tp_gather,
    )


def declare_ffn(
    *,
    read: ResidualReadout = AddNormRead(),
    update: ResidualUpdate = PlainAdd(),
    reduction: ProducerReduction = ProducerReduction.EXIT_SCOPED,
    output_transform: OutputTransform | None = None,
    transform_before_reduce_scatter: bool = False,
    sparse: bool = False,
    moe_dispatch: MoeDispatch = MoeDispatch.GATHER,
    dense_tp_size: int | None = None,
    next_sparse: bool | None = None,
    output_complete: bool = False,
    replicated: tuple[Replicated, ...] = (),
) -> StageDeclaration:
    """Declares an FFN stage: by default a dense FFN whose weights are split over the full TP
    group, run on every attention-DP rank's rows.

    Compute returns its output unreduced (unless `output_complete`), and the exit decides before
    compute where that sum completes. A sparse FFN may return a `DeferredFinalize` when its exit
    says `defer_moe_finalize`.

    Args:
      read: The residual read into this stage's input.
      update: How this stage's output joins the residual.
      reduction: Must be EXIT_SCOPED.
      output_transform: A function (or nnx.Module) applied to the complete output.
      transform_before_reduce_scatter: Apply the transform before a reduce-scatter.
      sparse: The FFN is a MoE.
      moe_dispatch: For a MoE: GATHER (gathered rows, output summed over the MoE output group)
        or ALL_TO_ALL (this rank's own rows; the residual follows onto them).
      dense_tp_size: For a dense FFN: None for the full TP group, the attention-TP size (on the
        attention's rows, summed over attention TP), or 1 (every weight on every rank, run on this
        rank's own rows; the residual follows onto them). Checked against the topology at binding.
      next_sparse: Whether the next FFN in the stack is sparse; checked when the stack binds.
      output_complete: Compute completes its own output sum; the exit owes none.
      replicated: Parts of the output every rank of a sum computes in full (a shared expert
        with its own TP size 1, a down-projection bias), each added by the sum's first rank only
        (`Replicated`). Such an FFN leaves its sum to the next input only under the deferral
        rule (`FusionProvider.can_defer_all_reduce`).

    Returns:
      A fresh declaration for `append_stages`.
    """
    return StageDeclaration(
        kind=StageKind.FFN,
        read=read,
        update=update,
        reduction=reduction,
        has_output_transform=output_transform is not None,
        transform_before_reduce_scatter=transform_before_reduce_scatter,
        sparse=sparse,
        moe_dispatch=moe_dispatch,
        dense_tp_size=dense_tp_size,
        next_sparse=next_sparse,
        output_complete=output_complete,
        output_transform=output_transform,
        replicated=tuple(replicated),
    )
