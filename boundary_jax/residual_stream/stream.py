"""The per-forward residual stream: the residual plus at most one unapplied contribution.

A stream is a registered pytree threaded functionally through every boundary call. Its state
(Initial, Written, Pending), the rows its residual is on and what its contribution still owes are
static tree structure, so a wrong transition fails while tracing, at no runtime cost.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any

import jax
from flax import nnx

from ..batch import BatchFacts
from ..designs.protocols import ReadState
from ..finalize import DeferredFinalize
from ..layout import Layout
from ..ops import ReduceScatter, Step
from ..placement import Placement
from ..plan import BranchMerge, Leave, OwedWork, ResidualRows

START_FIRST = "start the layer stack before entering a stage"
NOT_THIS_STREAM = (
    "output does not belong to this residual stream; change layer outputs through boundary "
    "accessors"
)
WRITE_FIRST = "write the residual update before taking the final output"
NEVER_MERGED = "a branch was never merged"


class StreamState(enum.Enum):
    """Initial: nothing yet. Written: a residual, nothing pending. Pending: a contribution waits."""

    INITIAL = "Initial"
    WRITTEN = "Written"
    PENDING = "Pending"


@functools.partial(jax.tree_util.register_dataclass, data_fields=["state"], meta_fields=["fn"])
@dataclasses.dataclass(frozen=True)
class Carried:
    """A transform or residual update that travels with a contribution until it applies.

    A module travels split (`nnx.split`), so its parameters are this trace's values and take
    gradients; a stateless object travels as static structure.

    Attributes:
      fn: The static object, or the module's graph definition.
      state: The module's state; None for a stateless object.
    """

    fn: Any
    state: Any = None

    @classmethod
    def of(cls, obj: Any) -> Carried:
        if isinstance(obj, nnx.Module):
            graphdef, state = nnx.split(obj)
            return cls(graphdef, state)
        return cls(obj)

    def resolve(self) -> Any:
        """The object itself (a module merged from this trace's state)."""
        return self.fn if self.state is None else nnx.merge(self.fn, self.state)

    def __call__(self, value: jax.Array) -> jax.Array:
        return self.resolve()(value)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["value", "transform", "update", "update_state"],
    meta_fields=["work", "update_plain"],
)
@dataclasses.dataclass(frozen=True)
class Contribution:
    """A producer's output with the work it still owes and the update that will apply it.

    Attributes:
      value: [rows, hidden] on `owed.placement.layout` rows, or a `DeferredFinalize`.
      transform: Output transform to apply once the value is complete; None when applied or
        absent.
      update: The producer's residual update.
      update_state: What the producer's read handed to its update (on the residual's rows).
      work: The bound owed-work record: rows, owed finalize and sums, and their unfused steps.
      update_plain: The update is `residual + value`.
    """

    value: jax.Array | DeferredFinalize
    transform: Carried | None
    update: Carried
    update_state: ReadState
    work: OwedWork
    update_plain: bool

    @property
    def placement(self) -> Placement:
        return self.work.placement

    def apply(self, residual: jax.Array, value: jax.Array) -> jax.Array:
        """The producer's update of `residual` by the complete `value`."""
        return self.update.resolve().apply(residual, value, self.update_state)

    def advance(
        self,
        steps: tuple[Step, ...],
        *,
        start: Placement | None = None,
        before_reduce_scatter: bool = False,
    ) -> tuple[jax.Array, Carried | None]:
        """Runs `steps` on the value, applying the output transform once the value completes.

        With `before_reduce_scatter`, the transform runs just before the first reduce-scatter
        instead (its declaration says it commutes with the sum).

        Args:
          steps: Bound steps, starting where the value is.
          start: Where the value is, when not where `work` records (a compute output before
            its exit's steps run).
          before_reduce_scatter: Apply the transform just before the first reduce-scatter.

        Returns:
          The moved value and the transform still to apply (None once applied).
        """
        value, transform = self.value, self.transform
        placement = self.placement if start is None else start
        if transform is not None and placement.complete:
            value, transform = transform(value), None
        for step in steps:
            if transform is not None and before_reduce_scatter and isinstance(step, ReduceScatter):
                value, transform = transform(value), None
            value = step(value)
            placement = step.after(placement)
            if transform is not None and placement.complete:
                value, transform = transform(value), None
        return value, transform

    def moved(
        self, work: OwedWork, value: jax.Array | DeferredFinalize, transform: Carried | None
    ) -> Contribution:
        """The same contribution after completion steps: `value` now owes what `work` records."""
        return dataclasses.replace(self, value=value, transform=transform, work=work)

    def completed_on_residual_rows(self) -> jax.Array:
        """The value with every owed item complete, moved onto the residual's rows and its output
        transform applied: what the update adds (the bound `work.onto_residual` steps)."""
        value, transform = self.advance(self.work.onto_residual)
        return value if transform is None else transform(value)


class StreamToken:
    """The identity of one stream and the handles it gives out.

    Compared by `is` for the identity check; equal to every other token, so jit caches and scan
    carries see one structure for every stream (no per-stream retrace).
    """

    __slots__ = ()

    def __eq__(self, other) -> bool:
        return isinstance(other, StreamToken)

    def __hash__(self) -> int:
        return hash(StreamToken)

    def __repr__(self) -> str:
        return f"stream@{id(self) & 0xFFFFFF:06x}"


class OwedOutput:
    """The opaque handle a boundary returns for a layer output.

    The value lives in the residual stream; the handle only names which stream holds it. Pass it
    to the next boundary call or a residual helper (`take_output`, `snapshot`, `final_norm`, ...).
    It has no array behaviour: no arithmetic, no slicing, no `.shape`.
    """

    __slots__ = ("token",)

    def __init__(self, token: StreamToken):
        object.__setattr__(self, "token", token)

    def __setattr__(self, name, value):
        raise AttributeError("OwedOutput is immutable")

    def __eq__(self, other) -> bool:
        return isinstance(other, OwedOutput)

    def __hash__(self) -> int:
        return hash(OwedOutput)

    def __repr__(self) -> str:
        return f"OwedOutput({self.token!r})"

    def _refuse(self, *args, **kwargs):
        raise TypeError(
            "an OwedOutput is not a tensor: pass it to the next boundary, or read it through "
            "take_output(), snapshot() or final_norm()"
        )

    __jax_array__ = __array__ = __getitem__ = __len__ = __iter__ = __bool__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __neg__ = __pow__ = _refuse


jax.tree_util.register_pytree_node(
    OwedOutput, lambda out: ((), out.token), lambda token, _: OwedOutput(token)
)


@dataclasses.dataclass(frozen=True)
class OpenBranch:
    """A branch forked from a stream and not merged back yet.

    Attributes:
      token: The branch stream's identity (compared by `is`).
      entered_at: The `append_stages` call site of the branch's first stage.
    """

    token: StreamToken
    entered_at: str


@dataclasses.dataclass(frozen=True)
class ForkedFrom:
    """What a branch stream knows of the stream it forked from.

    Attributes:
      token: The parent stream's identity (compared by `is`).
      source: The `append_stages` call site of the source stage.
      merge: Set by `branch_output`: how the branch's output merges (its last stage's bound
        merge).
    """

    token: StreamToken
    source: str
    merge: BranchMerge | None = None

    @property
    def output_taken(self) -> bool:
        """`branch_output` has run: the branch's output is ready to merge."""
        return self.merge is not None


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["residual", "pending", "batch", "read_state"],
    meta_fields=["token", "rows", "leave", "prepared_by", "branches", "forked_from"],
)
@dataclasses.dataclass(frozen=True)
class ResidualStream:
    """One microbatch's residual and the contribution waiting to join it.

    Attributes:
      residual: [rows, hidden] on `residual_layout` rows; None before the stack entry writes it.
      pending: The last producer's contribution; None when nothing is pending.
      batch: The batch facts this stream's boundaries select their paths by.
      read_state: What the running stage's read hands to its update; None for most designs.
      token: Identity shared with the `OwedOutput` handles this stream gives out.
      rows: The rows `residual` is on, with the bound move onto them; None in the Initial state.
      leave: Set by every stage's exit: the bound paths the final read, `take_output` or
        `to_pp` run after it. None before the first exit.
      prepared_by: The `append_stages` call site of the stage whose `prepare` wrote this stream
        and whose compute and exit are still to run; None otherwise.
      branches: The branches forked from this stream and not merged back yet.
      forked_from: For a branch's stream, the stream it forked from; None otherwise.
    """

    residual: jax.Array | None
    pending: Contribution | None
    batch: BatchFacts
    read_state: ReadState
    token: StreamToken
    rows: ResidualRows | None
    leave: Leave | None = None
    prepared_by: str | None = None
    branches: tuple[OpenBranch, ...] = ()
    forked_from: ForkedFrom | None = None

    @classmethod
    def initial(cls, batch: BatchFacts) -> ResidualStream:
        return cls(None, None, batch, None, StreamToken(), None)

    @property
    def state(self) -> StreamState:
        if self.pending is not None:
            return StreamState.PENDING
        return StreamState.INITIAL if self.residual is None else StreamState.WRITTEN

    @property
    def residual_layout(self) -> Layout | None:
        """The rows `residual` is on; None in the Initial state."""
        return None if self.rows is None else self.rows.layout

    @property
    def output(self) -> OwedOutput:
        """The handle of this stream's current layer output."""
        return OwedOutput(self.token)

    def check_output(self, output: Any) -> None:
        """Rejects anything but this stream's own handle (a trace-time identity check)."""
        if not isinstance(output, OwedOutput) or output.token is not self.token:
            raise ValueError(f"{NOT_THIS_STREAM} (got {_describe(output)}, {self!r})")

    def require_merged(self, what: str) -> None:
        """Rejects a stream with a branch still open: `what` would leave the branch behind.

        Raises:
          RuntimeError: A branch forked from this stream has not merged back.
        """
        if self.branches:
            sites = ", ".join(branch.entered_at for branch in self.branches)
            raise RuntimeError(
                f"{NEVER_MERGED} before {what}: the branch entered at {sites} must merge back "
                "through branch_output() and merge_branch() after its source's finish()"
            )

    def with_pending(
        self, contribution: Contribution, leave: Leave | None = None
    ) -> tuple[OwedOutput, ResidualStream]:
        stream = dataclasses.replace(
            self, pending=contribution, read_state=None, leave=leave, prepared_by=None
        )
        return stream.output, stream

    def written(
        self,
        residual: jax.Array,
        rows: ResidualRows,
        read_state: ReadState = None,
        leave: Leave | None = None,
        prepared_by: str | None = None,
    ) -> tuple[OwedOutput, ResidualStream]:
        stream = dataclasses.replace(
            self,
            residual=residual,
            pending=None,
            rows=rows,
            read_state=read_state,
            leave=leave,
            prepared_by=prepared_by,
        )
        return stream.output, stream

    def __repr__(self) -> str:
        rows = "" if self.residual_layout is None else f", residual rows {self.residual_layout}"
        owed = "" if self.pending is None else f", pending {self.pending.placement}"
        return f"ResidualStream({self.token!r}, {self.state.value}{rows}{owed})"


def require_stream(stream: Any) -> ResidualStream:
    """`stream` if it is a started residual stream; otherwise the guide's start error."""
    if not isinstance(stream, ResidualStream):
        raise RuntimeError(f"{START_FIRST} (got stream={_describe(stream)})")
    return stream


def require_output_of(output: Any, stream: Any) -> ResidualStream:
    """`stream`, checked to be a started stream that gave out `output` (an Initial stream has
    given out nothing yet, so any `output` passes).

    Raises:
      RuntimeError: `stream` is not a started residual stream.
      ValueError: `output` is not this stream's own handle.
    """
    stream = require_stream(stream)
    if stream.state is not StreamState.INITIAL:
        stream.check_output(output)
    return stream


def _describe(value: Any) -> str:
    if isinstance(value, OwedOutput):
        return repr(value)
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__}{list(shape) if shape is not None else ''}"
