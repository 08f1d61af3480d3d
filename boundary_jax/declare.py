"""Model-facing stage declarations: what a stage's compute does, never how it is executed.

A declaration holds no mesh, no array and no plan. `append_stages` gives it its place in a layer
stack; binding turns it into a `StagePlan` when the stack closes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .contracts import ProducerReduction, StageKind
from .layout import SumGroup
from .residual.add_norm import AddNormRead, PlainAdd
from .residual.protocols import ResidualReadout, ResidualUpdate

OutputTransform = Callable  # a pure function of the value, or an nnx.Module applied to it


@dataclasses.dataclass(frozen=True)
class StackPlace:
    """Where a bound declaration sits in its layer stack.

    Attributes:
      previous: Facts of the stage before it; None at the stack entry.
      terminal: The stage ends the stack: it leaves no work for a following layer.
    """

    previous: StageDeclaration | None
    terminal: bool


@dataclasses.dataclass(frozen=True)
class StageDeclaration:
    """What one stage's compute does, as the boundary needs to know it.

    Attributes:
      kind: Attention/mixer or FFN.
      read: How this stage reads the residual into its input (with its norm).
      update: How this stage's complete output joins the residual.
      reduction: How compute cooperates with the sum its output owes.
      sum_group: The group over which compute leaves its output unreduced.
      gathers_attn_tp_input: The boundary may gather this stage's input from attention-TP slices
        (needed for input-scattered batches). Attention only.
      has_output_transform: An output transform runs on the complete output before the update.
      transform_before_reduce_scatter: The transform commutes with the sum and runs before a
        reduce-scatter, preserving an implementation's order.
      sparse: The FFN is a sparse (MoE) FFN.
      next_sparse: Declared sparsity of the next FFN (checked against the stack when bound).
      output_complete: Compute completes its own output sum (fused with a reduction it needs
        anyway); the exit owes no sum. FFN only.
      place: Set when the stack binds this declaration; None for a fresh declaration.
      output_transform: The transform itself; moved onto the boundary by `append_stages`.
    """

    kind: StageKind
    read: ResidualReadout
    update: ResidualUpdate
    reduction: ProducerReduction
    sum_group: SumGroup
    gathers_attn_tp_input: bool = True
    has_output_transform: bool = False
    transform_before_reduce_scatter: bool = False
    sparse: bool = False
    next_sparse: bool | None = None
    output_complete: bool = False
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
        if self.kind is StageKind.ATTN and self.output_complete:
            raise ValueError("output_complete is an FFN fact; attention stages always owe a sum")
        if self.output_complete and self.reduction is not ProducerReduction.EXIT_SCOPED:
            raise ValueError(f"output_complete=True needs EXIT_SCOPED; got {self.reduction=}")
        if self.transform_before_reduce_scatter and not self.has_output_transform:
            raise ValueError("transform_before_reduce_scatter=True needs an output_transform")

    def facts(self) -> StageDeclaration:
        """The capabilities binding reads, without the transform object or the stack place."""
        return dataclasses.replace(self, output_transform=None, place=None)


def declare_attn(
    *,
    read: ResidualReadout = AddNormRead(),
    update: ResidualUpdate = PlainAdd(),
    reduction: ProducerReduction = ProducerReduction.ALWAYS_PARTIAL,
    gathers_attn_tp_input: bool = True,
    output_transform: OutputTransform | None = None,
    transform_before_reduce_scatter: bool = False,
) -> StageDeclaration:
    """Declares a token-mixing stage (attention, or an SSM mixer).

    By default the stage is attention whose heads are split over attention TP: compute returns
    its output projection unreduced (ALWAYS_PARTIAL), and the next stage's input completes the
    attention-TP sum. A single-stage mixer passes `reduction=ProducerReduction.EXIT_SCOPED`.

    Args:
      read: The residual read into this stage's input.
      update: How this stage's output joins the residual.
      reduction: ALWAYS_PARTIAL (attention) or EXIT_SCOPED (a mixer whose exit decides).
      gathers_attn_tp_input: Input may be gathered from attention-TP slices; False rules out
        input-scattered batches for stacks containing this stage.
      output_transform: A function (or nnx.Module) applied to the complete output.
      transform_before_reduce_scatter: Apply the transform before a reduce-scatter.

    Returns:
      A fresh declaration for `append_stages`.
    """
    return StageDeclaration(
        kind=StageKind.ATTN,
        read=read,
        update=update,
        reduction=reduction,
        sum_group=SumGroup.ATTN_TP,
        gathers_attn_tp_input=gathers_attn_tp_input,
        has_output_transform=output_transform is not None,
        transform_before_reduce_scatter=transform_before_reduce_scatter,
        output_transform=output_transform,
    )


def declare_ffn(
    *,
    read: ResidualReadout = AddNormRead(),
    update: ResidualUpdate = PlainAdd(),
    reduction: ProducerReduction = ProducerReduction.EXIT_SCOPED,
    output_transform: OutputTransform | None = None,
    transform_before_reduce_scatter: bool = False,
    sparse: bool = False,
    next_sparse: bool | None = None,
    output_complete: bool = False,
) -> StageDeclaration:
    """Declares an FFN stage: a dense FFN whose weights are split over the full TP group.

    Compute returns its output unreduced over the full TP group (unless `output_complete`), and
    the exit decides before compute where that sum completes.

    Args:
      read: The residual read into this stage's input.
      update: How this stage's output joins the residual.
      reduction: Must be EXIT_SCOPED.
      output_transform: A function (or nnx.Module) applied to the complete output.
      transform_before_reduce_scatter: Apply the transform before a reduce-scatter.
      sparse: The FFN is a MoE.
      next_sparse: Whether the next FFN in the stack is sparse; checked when the stack binds.
      output_complete: Compute completes its own output sum; the exit owes none.

    Returns:
      A fresh declaration for `append_stages`.
    """
    return StageDeclaration(
        kind=StageKind.FFN,
        read=read,
        update=update,
        reduction=reduction,
        sum_group=SumGroup.MOE_OUTPUT if sparse else SumGroup.TP,
        has_output_transform=output_transform is not None,
        transform_before_reduce_scatter=transform_before_reduce_scatter,
        sparse=sparse,
        next_sparse=next_sparse,
        output_complete=output_complete,
        output_transform=output_transform,
    )
