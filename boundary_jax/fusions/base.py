"""The fusion-provider contract between a stage's input and backend kernels."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax

from ..batch import BatchFacts
from ..designs.protocols import Norm, ResidualReadout, ResidualUpdate
from ..finalize import DeferredFinalize
from ..layout import TokenAxis, Topology


@dataclasses.dataclass(frozen=True)
class FusionRequest:
    """What a consumer input asks a fused candidate to do: `read(update(residual, sum(value)))`.

    Attributes:
      value: The producer's contribution on the residual's rows, still a partial sum over
        `sum_axes`; or, where a sparse FFN handed its finalize on and nothing but the sum stands
        between it and the update, its `DeferredFinalize` (`finalize` is True): the candidate
        then owes the finalize too, before the sum. A candidate that cannot finalize declines;
        the boundary then finalizes unfused and asks again with the array.
      residual: The residual on the same rows.
      norm: The consumer's norm.
      update: The producer's residual update.
      read: The consumer's residual read.
      sum_axes: Token axes the value still owes a sum over (empty: already complete).
      topology: The topology the stage is bound on: it names the mesh axes of `sum_axes`.
    """

    value: jax.Array | DeferredFinalize
    residual: jax.Array
    norm: Norm | None
    update: ResidualUpdate
    read: ResidualReadout
    sum_axes: tuple[TokenAxis, ...]
    topology: Topology

    @property
    def num_devices(self) -> int:
        """Ranks along `sum_axes`."""
        return self.topology.size(self.sum_axes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Mesh axis names of `sum_axes`, for a kernel's collective."""
        return self.topology.mesh_names(self.sum_axes)

    @property
    def finalize(self) -> bool:
        """The value is a `DeferredFinalize`: the candidate owes its finalize too."""
        return isinstance(self.value, DeferredFinalize)


@dataclasses.dataclass(frozen=True)
class FusedReadout:
    """What a read's own fused completion (`ReadoutFusion`) returns.

    Attributes:
      residual: The new residual: the sum completed and added (the update applied).
      compute_input: The read of it, where the candidate also read (the guide's `reads=True`);
        None: the read runs next, on `residual`.
    """

    residual: jax.Array
    compute_input: jax.Array | None = None


class ReadoutFusion(Protocol):
    """One of a residual read's own fused candidates (`ResidualReadout.completing_fusions`):
    completes the sum the producer's contribution owes together with the residual add, ahead
    of the read (or with it), tried before the fusion provider's candidates and the built-in
    collective."""

    def __call__(self, request: FusionRequest) -> FusedReadout | None:
        """The completed residual (and maybe the read), or None before touching anything or
        starting a collective if it does not apply."""
        ...


class GatheringRead(Protocol):
    """One of a residual read's own fused read + gathers (`ResidualReadout.gathering_reads`):
    where a stage reads its input on this rank's attention-TP slice and then gathers it over
    attention TP, both in one kernel."""

    def __call__(
        self, residual: jax.Array, norm: Norm | None, topology: Topology
    ) -> jax.Array | None:
        """The read of this rank's slice `residual`, gathered to the attention's rows (slices in
        attention-TP rank order), or None before starting a collective."""
        ...


class InputFusion(Protocol):
    """One fused candidate for a stage's input."""

    def __call__(self, request: FusionRequest) -> tuple[jax.Array, jax.Array] | None:
        """`(compute_input, new_residual)`, or None before touching anything if it does not
        apply (backend, size, dtype, sum group, update or read it cannot take)."""
        ...


@dataclasses.dataclass(frozen=True)
class FusionProvider:
    """Ordered fused candidates per consumer input, tried before the built-in path.

    Give one per stage as the `fusions` option, `(declaration, norm, {"fusions": provider})`, or
    to every stage of a stack as `layer_stack(..., fusions=provider)`. `FusionProvider()` turns
    fusion off.

    Attributes:
      attn_input: Candidates for an attention (or mixer) stage's input.
      ffn_input: Candidates for an FFN stage's input.
      final_input: Candidates for the stack's final read (`residual_stream.final_norm`): a sum left
        for it, or a terminal sparse FFN's finalize (with `terminal_finalize`).
      defer_finalize: A sparse FFN's exit may hand its finalize (and sum) to the next input,
        where an input candidate may fuse it; `can_defer_finalize` decides per batch.
      terminal_finalize: A terminal sparse FFN may hand its finalize to the final read
        (`final_norm(..., finalize_norm=...)`).
      defer_all_reduce: An FFN with replicated parts (`declare.Replicated`: a shared expert
        with its own TP size 1, a bias) may leave its all-reduce to the next input, where an
        input candidate may fuse it; `can_defer_all_reduce` decides per batch. Without it such
        an FFN completes its sum at its exit.
    """

    attn_input: tuple[InputFusion, ...] = ()
    ffn_input: tuple[InputFusion, ...] = ()
    final_input: tuple[InputFusion, ...] = ()
    defer_finalize: bool = False
    terminal_finalize: bool = False
    defer_all_reduce: bool = False

    def can_defer_finalize(self, batch: BatchFacts, rows: int) -> bool:
        """Whether a sparse FFN whose plan binds a finalize handoff may return a
        `DeferredFinalize` for `batch`, whose compute holds `rows` local rows.

        Called on every such exit; the default accepts every batch. A provider that fuses the
        finalize only for some shapes overrides it.
        """
        del batch, rows
        return True

    def can_defer_all_reduce(self, batch: BatchFacts, rows: int) -> bool:
        """Whether an FFN with replicated parts whose plan binds leaving its all-reduce to the
        next input (`defer_all_reduce`, a sum over the whole TP group, no expert all-to-all)
        may do so for `batch`, whose compute holds `rows` local rows; otherwise its exit
        completes the sum.

        Called on every such exit; the default accepts every batch. A provider that fuses the
        all-reduce only for some shapes overrides it.
        """
        del batch, rows
        return True


NO_FUSIONS = FusionProvider()
"""The default: no fused candidate, every input takes the built-in path."""
