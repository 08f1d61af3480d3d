"""The model-facing boundary of one stage: `prepare` before compute, `exit`/`finish` after.

A `StageBoundary` runs the plan its stack bound; it decides nothing that binding did not
already decide, except choosing among the bound exit options by the batch's row count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import ops
from .bind import EntryPath, ExitKind, ExitOption, StagePath, StagePlan, rows_fit
from .contracts import Placement
from .declare import OutputTransform, StageDeclaration
from .fusions import FusionProvider, FusionRequest
from .residual.protocols import Norm
from .residual.stream import (
    CarriedTransform,
    Contribution,
    OwedOutput,
    ResidualStream,
    StreamState,
    require_stream,
)


class StageBoundary(nnx.Module):
    """The boundary in front of and behind one stage's compute.

    Built by `append_stages` inside an open `layer_stack()`; bound when the stack closes. Each
    call takes the residual stream and returns the new one.

    Attributes:
      declaration: The stage's declaration; after binding it carries its place in the stack.
      norm: The norm this stage's input read applies (None: read without a norm).
      output_transform: Applied to the complete output before the residual update.
      plan: The bound plan; None until the stack closes.
      call_site: The `append_stages` call that built this boundary, for error notes.
      fusions: This stage's own fusion provider (the `fusions` option); None takes the stack's.
    """

    def __init__(
        self,
        declaration: StageDeclaration,
        norm: Norm | None,
        output_transform: OutputTransform | None,
        call_site: str,
        fusions: FusionProvider | None = None,
    ):
        self.declaration = declaration
        self.norm = norm
        self.output_transform = output_transform
        self.plan: StagePlan | None = None
        self.call_site = call_site
        self.fusions = fusions

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
        stream = require_stream(stream)
        path = self._path(stream)
        state = stream.state
        if state is StreamState.INITIAL:
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
        residual = ops.run(entry.residual_move, stream.residual)
        if pending is None:
            return self._read(entry, path, None, residual, stream)
        value, transform = pending.advance(entry.complete)
        return self._read(entry, path, (pending, value, transform), residual, stream)

    def _enter_stack(self, x, stream, entry: EntryPath, path: StagePath):
        if isinstance(x, OwedOutput):
            stream.check_output(x)
        x = jnp.asarray(x)
        mask = stream.batch.valid_rows(x.shape[0])
        if mask is not None:
            x = jnp.where(mask[:, None], x, jnp.zeros((), x.dtype))
        value = ops.run(entry.complete, x)
        read = self.declaration.read
        if entry.read_after_move:
            compute_input, _ = read.init_residual(ops.run(entry.move_input, value), self.norm)
            residual = value
        else:
            compute_input, residual = read.init_residual(value, self.norm)
            compute_input = ops.run(entry.move_input, compute_input)
        _, stream = stream.written(residual, path.residual_layout)
        return compute_input, stream

    def _read(self, entry: EntryPath, path: StagePath, pending, residual, stream):
        read = self.declaration.read
        if entry.read_after_move:
            if pending is not None:
                residual = self._updated(entry, pending, residual)
            compute_input, _ = read.read(ops.run(entry.move_input, residual), self.norm)
        else:
            if pending is None:
                compute_input, residual = read.read(residual, self.norm)
            else:
                compute_input, residual = self._update_and_read(entry, pending, residual)
            compute_input = ops.run(entry.move_input, compute_input)
        _, stream = stream.written(residual, path.residual_layout)
        return compute_input, stream

    def _update_and_read(self, entry: EntryPath, pending, residual):
        """Completes `entry.fused_sum`, applies the update and reads: a fused candidate first."""
        contribution, value, transform = pending
        if transform is None:
            request = FusionRequest(
                value,
                residual,
                self.norm,
                contribution.update,
                self.declaration.read,
                entry.fused_sum,
                self.plan.topology.size(entry.fused_sum),
            )
            for candidate in self.plan.input_fusions:
                result = candidate(request)
                if result is not None:
                    return result
        return self.declaration.read.update_and_read(
            contribution.update, _completed(entry, pending), residual, self.norm
        )

    def _updated(self, entry: EntryPath, pending, residual):
        return pending[0].update.apply(residual, _completed(entry, pending))

    def exit(self, stream: ResidualStream) -> StageExit:
        """Decides, before compute runs, how this stage's output will be handed on.

        The decision depends on the bound exit options and this batch's row count; the returned
        object's `finish` runs the matching completion.
        """
        stream = require_stream(stream)
        path = self._path(stream)
        if stream.state is not StreamState.WRITTEN:
            raise RuntimeError(
                f"the stage appended at {self.call_site} exits a stream in the "
                f"{stream.state.value} state; call prepare() before its compute and exit"
            )
        topology = self.plan.topology
        global_rows = stream.residual.shape[0] * topology.size(path.residual_layout.sharded)
        rows = global_rows // topology.size(path.compute_layout.sharded)
        option = next(o for o in path.exits if rows_fit(o.steps, rows, topology))
        return StageExit(self, path, option, rows)

    def finish(self, y: jax.Array, stream: ResidualStream) -> tuple[OwedOutput, ResidualStream]:
        """Hands this stage's compute output `y` on: `exit(stream).finish(y, stream)`."""
        return self.exit(stream).finish(y, stream)


@dataclasses.dataclass(frozen=True)
class StageExit:
    """One exit decision, made before compute; `finish` runs its completion once.

    Attributes:
      kind: What the exit does with the owed sum.
      completes_now: The output's sum completes at this exit (nothing owed to the next input).
      leaves_sum_to_next_input: The next stage's input completes (some of) the sum.
      defer_moe_finalize: Whether a MoE may hand its finalize to the next input (never, here).
    """

    boundary: StageBoundary
    path: StagePath
    option: ExitOption
    rows: int

    @property
    def kind(self) -> ExitKind:
        return self.option.kind

    @property
    def completes_now(self) -> bool:
        return self.option.completes_now

    @property
    def leaves_sum_to_next_input(self) -> bool:
        return not self.option.completes_now

    @property
    def defer_moe_finalize(self) -> bool:
        return False

    def finish(self, y: jax.Array, stream: ResidualStream) -> tuple[OwedOutput, ResidualStream]:
        """Runs the decided completion on compute output `y` and records it in the stream."""
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
        declaration = boundary.declaration
        expected_rows = self.rows
        if y.ndim != 2 or y.shape[0] != expected_rows:
            raise ValueError(
                f"the stage appended at {boundary.call_site} must return [rows, hidden] on its "
                f"compute rows ({expected_rows} rows here); got shape {y.shape}"
            )
        owed = (
            ()
            if declaration.output_complete
            else boundary.plan.topology.sum_axes(declaration.sum_group)
        )
        transform = None
        if boundary.output_transform is not None:
            transform = CarriedTransform.of(boundary.output_transform)
        contribution = Contribution(
            y, transform, Placement(self.path.compute_layout, owed), declaration.update
        )
        value, transform = contribution.advance(
            self.option.steps,
            before_reduce_scatter=declaration.transform_before_reduce_scatter,
        )
        contribution = Contribution(value, transform, self.option.handoff, declaration.update)
        if self.option.fold_to is None:
            return stream.with_pending(contribution)
        if transform is not None:
            value = transform(value)
        residual = declaration.update.apply(stream.residual, value)
        topology = boundary.plan.topology
        residual = ops.run(
            ops.relayout(self.path.residual_layout, self.option.fold_to, topology), residual
        )
        return stream.written(residual, self.option.fold_to)


def _completed(entry: EntryPath, pending) -> jax.Array:
    """The pending value after the entry's fused sum and any output transform still owed."""
    _, value, transform = pending
    value = ops.run(ops.all_reduce(entry.fused_sum), value)
    return value if transform is None else transform(value)
