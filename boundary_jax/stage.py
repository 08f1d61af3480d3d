"""The model-facing boundary of one stage: `prepare` before compute, `exit`/`finish` after.

A `StageBoundary` runs the plan its stack bound; it decides nothing that binding did not
already decide, except choosing among the bound exit options by the batch (its row count, and
whether the fusion provider takes a MoE finalize).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import ops
from .batch import BatchFacts
from .declare import OutputTransform, StageDeclaration, StageKind
from .designs.add_norm import PlainAdd
from .designs.protocols import Norm, ResidualReadout, ResidualUpdate
from .finalize import DeferredFinalize
from .fusions import FusionProvider
from .plan import (
    EntryPath,
    ExitKind,
    ExitOption,
    OwedWork,
    ResidualRows,
    StagePath,
    StagePlan,
    rows_fit,
)
from .residual_stream.begin import start as start_stream
from .residual_stream.entry import run_entry
from .residual_stream.stream import (
    Carried,
    Contribution,
    OwedOutput,
    ResidualStream,
    StreamState,
    require_stream,
)

PREPARED_BRANCH = "a prepared branch must enter through branch_input, not prepare"


@dataclasses.dataclass(frozen=True)
class Owned:
    """A residual design (norm, read, update or output transform) that is a module of the layer
    owning the boundary: the boundary reaches it as `getattr(owner, attribute)`, so its
    parameters live under the layer's own name (`layers.3.input_norm`), not the boundary's.

    Attributes:
      attribute: The layer attribute holding the module.
    """

    attribute: str


Design = object  # a frozen stateless design, a function, an `Owned` module of the layer, or None


class StageBoundary(nnx.Module):
    """The boundary in front of and behind one stage's compute.

    Built by `append_stages` inside an open `layer_stack()`; bound when the stack closes. Each
    call takes the residual stream and returns the new one. Its residual read, update, norm and
    output transform are either frozen stateless objects or modules of the layer that appended
    it (its `owner`), reached through that layer, so their parameters are the layer's state.

    Attributes:
      declaration: The stage's declaration facts; after binding they carry its place.
      owner: The layer that appended the stage, where one of its designs is a module; None
        otherwise.
      plan: The bound plan; None until the stack closes.
      call_site: The `append_stages` call that built this boundary, for error notes.
      fusions: This stage's own fusion provider (the `fusions` option); None takes the stack's.
    """

    def __init__(
        self,
        declaration: StageDeclaration,
        designs: tuple[Design, Design, Design, Design],
        call_site: str,
        fusions: FusionProvider | None = None,
        owner: nnx.Module | None = None,
    ):
        self.declaration = declaration
        self._designs = designs
        self.owner = owner
        self.plan: StagePlan | None = None
        self.call_site = call_site
        self.fusions = fusions

    def _design(self, index: int) -> Any:
        design = self._designs[index]
        return getattr(self.owner, design.attribute) if isinstance(design, Owned) else design

    @property
    def norm(self) -> Norm | None:
        """The norm this stage's input read applies (None: read without a norm)."""
        return self._design(0)

    @property
    def read(self) -> ResidualReadout:
        """How this stage reads the residual."""
        return self._design(1)

    @property
    def update(self) -> ResidualUpdate:
        """How this stage's output joins the residual."""
        return self._design(2)

    @property
    def output_transform(self) -> OutputTransform | None:
        """Applied to the complete output before the residual update; None without one."""
        return self._design(3)

    def bind(self, plan: StagePlan) -> None:
        """Installs the plan its stack bound (called once, when the stack closes)."""
        if self.plan is not None:
            raise RuntimeError(f"the stage appended at {self.call_site} is already bound")
        self.plan = plan
        self.declaration = plan.declaration

    def _path(self, stream: ResidualStream) -> StagePath:
        if self.plan is None:
            raise RuntimeError(
                f"the stage appended at {self.call_site} is not bound yet: close its "
                "layer_stack() before running the model"
            )
        if stream.batch.topology != self.plan.topology:
            raise ValueError(
                f"the batch is laid out on {stream.batch.topology}, but the stage appended at "
                f"{self.call_site} was bound on {self.plan.topology}"
            )
        return self.plan.path(stream.batch.variant)

    def counts(self, name: str, stream: ResidualStream) -> bool | jax.Array:
        """Whether this rank adds the replicated part `name` of this stage's output: on the
        first rank of the sum that counts it, on every rank where no sum runs over ranks that
        hold it alike (as bound: `StagePlan.counted_once`). Compute adds the part only where
        this is true (`jnp.where(counts, part, 0)`), so the one sum counts it once.

        Returns:
          A traced bool inside `shard_map`, or True where every rank adds it.

        Raises:
          ValueError: The declaration names no replicated part `name`.
        """
        self._path(stream)
        return self._counts(name)

    def _counts(self, name: str) -> bool | jax.Array:
        for part in self.plan.counted_once:
            if part.name == name:
                return ops.is_first_rank(part.ranks)
        declared = [part.name for part in self.plan.counted_once]
        raise ValueError(
            f"the stage appended at {self.call_site} declares no replicated part {name!r} "
            f"(it declares {declared}); name it in the stage's declaration, e.g. "
            f"declare_ffn(replicated=(Replicated({name!r}),))"
        )

    def prepare(self, x: Any, stream: ResidualStream) -> tuple[jax.Array, ResidualStream]:
        """Completes what the producer owes, updates and reads the residual, moves the rows.

        Args:
          x: The previous boundary's output handle, or at the stack entry the raw stack input
            [rows, hidden] on attention rows.
          stream: The residual stream.

        Returns:
          `(compute_input, stream)`: the input on this stage's compute rows and the stream, now
          written.
        """
        compute_input, stream, _ = self._prepare(x, stream, capture=False)
        return compute_input, stream

    def prepare_captured(
        self, x: Any, stream: ResidualStream, *, gathered: bool = False
    ) -> tuple[jax.Array, ResidualStream, jax.Array]:
        """`prepare`, also returning the updated residual this read produces (an auxiliary
        hidden state, e.g. for EAGLE-3 drafting). Attention and mixer stages only.

        The sum the producer owes completes unfused first (an add + norm kernel still runs);
        at the stack entry the capture is the complete stack input before `init_residual`. The
        captured value is a new array (JAX values are never aliased), so it is always owned.

        Args:
          x: As for `prepare`.
          stream: As for `prepare`.
          gathered: Return the capture on the attention's rows (gathered from attention-TP
            slices where the residual is on them); otherwise on the residual's rows.

        Returns:
          `(compute_input, stream, captured)`.

        Raises:
          TypeError: The stage is an FFN (its prepare does not capture).
        """
        if self.declaration.kind is not StageKind.ATTN:
            raise TypeError(
                f"the stage appended at {self.call_site} is an FFN; only an attention or mixer "
                "input captures the residual"
            )
        compute_input, stream, (residual, entry) = self._prepare(x, stream, capture=True)
        return (
            compute_input,
            stream,
            ops.run(entry.capture_move, residual) if gathered else residual,
        )

    def _prepare(self, x: Any, stream: ResidualStream, *, capture: bool):
        stream = require_stream(stream)
        if self.plan is not None and self.plan.declaration.place.forks:
            raise RuntimeError(
                f"{PREPARED_BRANCH} (the stage appended at {self.call_site} starts from its "
                "source's prepared input: adapters.branch_input(stage, source, input, stream))"
            )
        stream.require_merged(f"prepare() of the stage appended at {self.call_site}")
        if stream.prepared_by is not None:
            raise RuntimeError(
                f"prepare() of the stage appended at {self.call_site} on a stream that the stage "
                f"appended at {stream.prepared_by} prepared and has not finished: each stage "
                "runs prepare(), its compute and finish() once, in stack order"
            )
        path = self._path(stream)
        if stream.state is StreamState.INITIAL:
            entry = path.initial_entry
            if entry is None:
                raise RuntimeError(
                    f"the stage appended at {self.call_site} is not the stack entry but got an "
                    f"Initial stream; run the stages in stack order ({stream!r})"
                )
            return self._enter_stack(x, stream, entry, path)
        stream.check_output(x)
        pending = stream.pending
        entry = path.entry(None if pending is None else pending.placement, stream.residual_layout)
        if entry is None:
            raise ValueError(
                f"the stage appended at {self.call_site} has no entry for {stream!r}: it is "
                "not what this stage's producer hands on; run the stages in stack order"
            )
        compute_input, residual, state = run_entry(
            entry,
            stream.residual,
            pending,
            self.read,
            self.norm,
            candidates=self.plan.input_fusions,
            topology=self.plan.topology,
            fuse_sum=not capture,
        )
        _, stream = stream.written(residual, path.residual_rows, state, prepared_by=self.call_site)
        return compute_input, stream, (residual, entry)

    def _enter_stack(self, x, stream, entry: EntryPath, path: StagePath):
        if isinstance(x, OwedOutput):
            stream.check_output(x)
        x = jnp.asarray(x)
        mask = stream.batch.valid_rows(x.shape[0])
        if mask is not None:
            x = jnp.where(mask[:, None], x, jnp.zeros((), x.dtype))
        value = ops.run(entry.complete, x)
        if entry.read_after_move:
            compute_input, _, _ = self.read.init_residual(
                ops.run(entry.move_input, value), self.norm
            )
            residual, state = value, None
        else:
            compute_input, residual, state = self.read.init_residual(value, self.norm)
            compute_input = ops.move_rows(entry.move_input, compute_input)
        _, stream = stream.written(residual, path.residual_rows, state, prepared_by=self.call_site)
        return compute_input, stream, (value, entry)

    def from_pp(
        self, tensors: dict[str, jax.Array], batch: BatchFacts
    ) -> tuple[OwedOutput, ResidualStream]:
        """Rebuilds the stream a previous pipeline rank's `to_pp` sent, on this receiving stage.

        What arrives is decided by the producer's declaration, as this stage's transport entry
        binds it: the residual alone (a written stream), or a completed output with the residual
        (a pending stream that owes nothing). Both are on the attention's rows.

        Returns:
          `(handle, stream)` to pass to this stage's `prepare`.

        Raises:
          RuntimeError: This stage is not entered through a pipeline receive.
          ValueError: The tensors are not what the producer's declaration sends.
        """
        stream = start_stream(batch)
        path = self._path(stream)
        entry = path.transport_entry
        if entry is None:
            raise RuntimeError(
                f"from_pp() rebuilds the stream on the stage a pipeline receive enters; the stage "
                f"appended at {self.call_site} is entered through "
                f"{self.plan.declaration.place.incoming.kind.value}"
            )
        expected = {"hidden_states"} if entry.handoff is None else {"hidden_states", "residual"}
        if set(tensors) != expected:
            raise ValueError(
                f"the previous rank's last stage sends {sorted(expected)}; got {sorted(tensors)}"
            )
        rows = ResidualRows.attention(self.plan.topology)
        if entry.handoff is None:
            return stream.written(tensors["hidden_states"], rows)
        _, stream = stream.written(tensors["residual"], rows)
        done = OwedWork.nothing(rows.layout)
        value = tensors["hidden_states"]
        return stream.with_pending(Contribution(value, None, Carried(PlainAdd()), None, done, True))

    def exit(self, stream: ResidualStream) -> StageExit:
        """Decides, before compute runs, how this stage's output will be handed on.

        The decision depends on the bound exit options, this batch's row count and, for a
        sparse FFN whose plan binds a finalize handoff, whether its provider takes the finalize
        for this batch (`can_defer_finalize`), for an FFN with replicated parts whose plan binds
        leaving its all-reduce to the next input, whether its provider accepts the batch
        (`can_defer_all_reduce`); the returned object's `finish` runs the matching
        completion, and `defer_moe_finalize` tells compute whether it may return a
        `DeferredFinalize`.
        """
        stream = require_stream(stream)
        path = self._path(stream)
        if stream.state is not StreamState.WRITTEN:
            raise RuntimeError(
                f"the stage appended at {self.call_site} exits a stream in the "
                f"{stream.state.value} state; call prepare() before its compute and exit"
            )
        if stream.prepared_by != self.call_site:
            raise RuntimeError(
                f"exit() or finish() of the stage appended at {self.call_site} on a stream "
                + (
                    "no stage prepared"
                    if stream.prepared_by is None
                    else f"that the stage appended at {stream.prepared_by} prepared"
                )
                + ": each stage runs prepare(), its compute and finish() once, in stack order"
            )
        topology = self.plan.topology
        global_rows = stream.residual.shape[0] * topology.size(path.residual_layout.sharded)
        rows = global_rows // topology.size(path.compute_layout.sharded)
        fitting = [o for o in path.exits if rows_fit(o.steps, rows, topology)]
        if any(o.defers_finalize for o in fitting) and not self.plan.fusions.can_defer_finalize(
            stream.batch, rows
        ):
            fitting = [o for o in fitting if not o.defers_finalize]
        if (
            self.declaration.replicated
            and any(o.kind is ExitKind.LEAVE_TO_NEXT_INPUT for o in fitting)
            and not self.plan.fusions.can_defer_all_reduce(stream.batch, rows)
        ):
            fitting = [o for o in fitting if o.kind is not ExitKind.LEAVE_TO_NEXT_INPUT]
        return StageExit(self, path, tuple(fitting), rows)

    def finish(self, y: jax.Array, stream: ResidualStream) -> tuple[OwedOutput, ResidualStream]:
        """Hands this stage's compute output `y` on: `exit(stream).finish(y, stream)`."""
        return self.exit(stream).finish(y, stream)


@dataclasses.dataclass(frozen=True)
class StageExit:
    """One exit decision, made before compute; `finish` runs its completion once.

    Attributes:
      kind: What the exit does with the owed work.
      completes_now: The output's sum completes at this exit (nothing owed to the next input).
      defer_moe_finalize: Compute may return a `DeferredFinalize`: the finalize is handed to the
        next input (or the final read).
    """

    boundary: StageBoundary
    path: StagePath
    options: tuple[ExitOption, ...]
    rows: int

    @property
    def option(self) -> ExitOption:
        return self.options[0]

    @property
    def kind(self) -> ExitKind:
        return self.option.kind

    @property
    def completes_now(self) -> bool:
        return self.option.completes_now

    @property
    def defer_moe_finalize(self) -> bool:
        return self.option.defers_finalize

    def counts(self, name: str) -> bool | jax.Array:
        """`StageBoundary.counts` of this exit's stage: whether this rank adds the replicated
        part `name` (for compute run under this exit)."""
        return self.boundary._counts(name)

    def finish(self, y: Any, stream: ResidualStream) -> tuple[OwedOutput, ResidualStream]:
        """Runs the decided completion on compute output `y` and records it in the stream.

        `y` is [rows, hidden] on the compute rows, or a `DeferredFinalize` where
        `defer_moe_finalize` allowed it (a MoE that combined its experts itself may still return
        the array).
        """
        boundary = self.boundary
        stream = require_stream(stream)
        if stream.state is not StreamState.WRITTEN:
            raise RuntimeError(
                f"the stage appended at {boundary.call_site} finishes a stream in the "
                f"{stream.state.value} state; each stage runs prepare(), compute, finish() once"
            )
        if isinstance(y, OwedOutput):
            raise TypeError(
                f"finish() takes the stage's compute output, not a boundary handle ({y!r})"
            )
        handoff = isinstance(y, DeferredFinalize)
        if handoff and not self.defer_moe_finalize:
            raise TypeError(
                f"the stage appended at {boundary.call_site} returned a DeferredFinalize while "
                "defer_moe_finalize is False; finalize inside compute when the exit says so"
            )
        option = next(o for o in self.options if o.defers_finalize == handoff)
        rows = y.rows if handoff else (y.shape[0] if y.ndim == 2 else None)
        if rows != self.rows:
            raise ValueError(
                f"the stage appended at {boundary.call_site} must return [rows, hidden] on its "
                f"compute rows ({self.rows} rows here); got {_shape(y)}"
            )
        width = (y.expert_outputs if handoff else y).shape[-1]
        if width != stream.residual.shape[-1]:
            raise ValueError(
                f"the stage appended at {boundary.call_site} returned outputs of width {width}, "
                f"but the residual stream is {stream.residual.shape[-1]} wide; its output "
                "projection must map back to the residual's hidden size"
            )
        transform = None
        if boundary.output_transform is not None:
            transform = Carried.of(boundary.output_transform)
        contribution = Contribution(
            y,
            transform,
            Carried.of(boundary.update),
            stream.read_state,
            option.work,
            boundary.declaration.update.plain,
        )
        value, transform = contribution.advance(
            option.steps,
            start=option.output,
            before_reduce_scatter=boundary.declaration.transform_before_reduce_scatter,
        )
        contribution = contribution.moved(option.work, value, transform)
        if option.fold_to is None:
            return stream.with_pending(contribution, option.leave)
        if transform is not None:
            value = transform(value)
        residual = ops.run(option.fold_steps, contribution.apply(stream.residual, value))
        return stream.written(residual, option.fold_to, leave=option.leave)


def _shape(y: Any) -> str:
    if isinstance(y, DeferredFinalize):
        return f"a DeferredFinalize of {y.rows} rows"
    return f"shape {y.shape}"
