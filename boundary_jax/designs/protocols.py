"""What a producer's residual update and a consumer's residual read must provide.

A design is either a frozen, stateless object or an `nnx.Module` whose parameters are trainable
state of the stage that owns it. A boundary selects its ordering from the capabilities declared
here (binding reads them through `update_facts` / `read_facts`), so declare only what the
implementation really supports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax

from .quantized import Fp8TokenGroups

Norm = Callable[[jax.Array], jax.Array]
ReadState = Any  # a pytree of [rows, ...] arrays a read hands to the same stage's update, or None


class ResidualUpdate(Protocol):
    """How a producer's complete contribution joins the residual.

    Attributes:
      plain: The update is `residual + value`. Only a plain update may be fused into an add + norm
        kernel, snapshotted, or added before a sum completes.
      applied_at_exit: The update runs at the producer's exit: the exit completes the output's
        sum and folds it into the residual, and the next stage reads a written stream. Otherwise
        the update travels with the contribution and runs at the next input, so its parameters
        (and its read's state) must outlive the producer's compute.
    """

    plain: bool
    applied_at_exit: bool

    def apply(self, residual: jax.Array, value: jax.Array, state: ReadState) -> jax.Array:
        """The new residual, in `residual.dtype`; `state` is what this stage's read handed on."""
        ...


class ResidualReadout(Protocol):
    """How a consumer turns the residual into its compute input.

    Each call returns `(compute_input, residual, state)`: `state` is handed to the same stage's
    update when its output joins the residual (None when the design keeps none). The compute
    input is an array in the residual's dtype, or a `Quantized` where the read declares an
    `input_format`.

    Attributes:
      reads_before_dp_gather: The read runs on the source rows, before an attention-DP gather
        moves its result; otherwise the residual is gathered and read on the gathered rows.
      reads_after_attn_tp_gather: The read needs every row of the attention's (it adds a
        contribution computed for every row, as Qwen4-exp's per-layer embedding read does): a
        producer that would leave its output on this rank's attention-TP slice (an FFN on its
        own rows, an input-scattered batch) returns it, with the residual, to the attention's
        rows, where this read runs.
      input_format: The quantized format of the compute input, or None for the residual's
        dtype.
      completing_fusions: The read's own fused candidates (`fusions.ReadoutFusion`), each
        completing the sum its producer's contribution owes with the residual add (and maybe
        the read), tried in order before the fusion provider's and the built-in collective.
      gathering_reads: The read's own read + gather over attention TP (`fusions.GatheringRead`),
        tried in order where the stage reads on this rank's attention-TP slice and then gathers
        its input; the producer's update then runs unfused before them.
    """

    reads_before_dp_gather: bool
    reads_after_attn_tp_gather: bool
    input_format: Fp8TokenGroups | None
    completing_fusions: tuple[Any, ...]
    gathering_reads: tuple[Any, ...]

    def init_residual(
        self, x: jax.Array, norm: Norm | None
    ) -> tuple[jax.Array, jax.Array, ReadState]:
        """At the stack entry: the complete input becomes the residual."""
        ...

    def read(
        self, residual: jax.Array, norm: Norm | None
    ) -> tuple[jax.Array, jax.Array, ReadState]:
        """Reads a written residual."""
        ...

    def update_and_read(
        self,
        update: ResidualUpdate,
        value: jax.Array,
        residual: jax.Array,
        norm: Norm | None,
        state: ReadState,
    ) -> tuple[jax.Array, jax.Array, ReadState]:
        """Applies the producer's `update` of `value` (with its read `state`), then reads; may
        fuse the two."""
        ...


@dataclasses.dataclass(frozen=True)
class DesignFacts:
    """What binding and fusion read of a residual update or read: its capabilities, not the
    object (whose parameters are module state).

    Attributes:
      design: The design's class name, for plans and messages.
      plain: For an update: it is `residual + value`.
      applied_at_exit: For an update: it runs at its producer's exit.
      reads_before_dp_gather: For a read: it runs on the source rows before a DP gather.
      reads_after_attn_tp_gather: For a read: it runs on the attention's rows, never on an
        attention-TP slice.
      input_format: For a read: the quantized format it hands its stage, or None.
    """

    design: str
    plain: bool = False
    applied_at_exit: bool = False
    reads_before_dp_gather: bool = True
    reads_after_attn_tp_gather: bool = False
    input_format: Fp8TokenGroups | None = None


def update_facts(update: ResidualUpdate) -> DesignFacts:
    """The capabilities a residual update declares."""
    return DesignFacts(
        type(update).__name__,
        plain=bool(update.plain),
        applied_at_exit=bool(update.applied_at_exit),
    )


def read_facts(read: ResidualReadout) -> DesignFacts:
    """The capabilities a residual read declares."""
    return DesignFacts(
        type(read).__name__,
        reads_before_dp_gather=bool(read.reads_before_dp_gather),
        reads_after_attn_tp_gather=bool(read.reads_after_attn_tp_gather),
        input_format=read.input_format,
    )
