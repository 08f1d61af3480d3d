"""The per-forward residual stream: the residual plus at most one unapplied contribution.

A stream is a registered pytree threaded functionally through every boundary call. Its state
(Initial, Written, Pending), the rows its residual is on and what its contribution still owes are
static tree structure, so a wrong transition fails while tracing, at no runtime cost.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from ..batch import BatchFacts
from ..contracts import Placement
from ..layout import Layout
from ..ops import ReduceScatter, Step
from .protocols import ResidualUpdate

START_FIRST = "start the layer stack before entering a stage"
NOT_THIS_STREAM = (
    "output does not belong to this residual stream; change layer outputs through boundary "
    "accessors"
)
WRITE_FIRST = "write the residual update before taking the final output"


class StreamState(enum.Enum):
    """Initial: nothing yet. Written: a residual, nothing pending. Pending: a contribution waits."""

    INITIAL = "Initial"
    WRITTEN = "Written"
    PENDING = "Pending"


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["state"], meta_fields=["apply_fn"]
)
@dataclasses.dataclass(frozen=True)
class CarriedTransform:
    """An output transform that travels with a contribution until its sum completes.

    A module transform travels split (`nnx.split`), so its parameters are this trace's values.

    Attributes:
      apply_fn: A static callable of the value, or the module's graph definition.
      state: The module's parameters; None for a plain callable.
    """

    apply_fn: Any
    state: Any = None

    @classmethod
    def of(cls, transform: Callable[[jax.Array], jax.Array]) -> CarriedTransform:
        if isinstance(transform, nnx.Module):
            graphdef, state = nnx.split(transform)
            return cls(graphdef, state)
        return cls(transform)

    def __call__(self, value: jax.Array) -> jax.Array:
        if self.state is None:
            return self.apply_fn(value)
        return nnx.merge(self.apply_fn, self.state)(value)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["value", "transform"],
    meta_fields=["placement", "update"],
)
@dataclasses.dataclass(frozen=True)
class Contribution:
    """A producer's output with the work it still owes.

    Attributes:
      value: [rows, hidden] on `placement.layout` rows.
      transform: Output transform to apply once the sum completes; None when applied or absent.
      placement: The rows the value is on and the partial sum it still owes.
      update: How the complete value joins the residual.
    """

    value: jax.Array
    transform: CarriedTransform | None
    placement: Placement
    update: ResidualUpdate

    def advance(
        self, steps: tuple[Step, ...], *, before_reduce_scatter: bool = False
    ) -> tuple[jax.Array, CarriedTransform | None]:
        """Runs `steps` on the value, applying the output transform once the sum completes.

        With `before_reduce_scatter`, the transform runs just before the first reduce-scatter
        instead (its declaration says it commutes with the sum).

        Returns:
          The moved value and the transform still to apply (None once applied).
        """
        value, transform, placement = self.value, self.transform, self.placement
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


class OwedOutput:
    """The opaque handle a boundary returns for a layer output.

    The value lives in the residual stream; the handle only names which stream holds it. Pass it
    to the next boundary call or a residual helper (`take_output`, `snapshot`, `final_norm`, ...).
    It has no array behaviour: no arithmetic, no slicing, no `.shape`.
    """

    __slots__ = ("stream_id",)

    def __init__(self, stream_id: int):
        object.__setattr__(self, "stream_id", stream_id)

    def __setattr__(self, name, value):
        raise AttributeError("OwedOutput is immutable")

    def __eq__(self, other) -> bool:
        return isinstance(other, OwedOutput) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(("OwedOutput", self.stream_id))

    def __repr__(self) -> str:
        return f"OwedOutput(stream={self.stream_id})"

    def _refuse(self, *args, **kwargs):
        raise TypeError(
            "an OwedOutput is not a tensor: pass it to the next boundary, or read it through "
            "take_output(), snapshot() or final_norm()"
        )

    __jax_array__ = __array__ = __getitem__ = __len__ = __iter__ = __bool__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __neg__ = __pow__ = _refuse


jax.tree_util.register_pytree_node(
    OwedOutput, lambda out: ((), out.stream_id), lambda stream_id, _: OwedOutput(stream_id)
)

_stream_ids = itertools.count()


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["residual", "pending", "batch"],
    meta_fields=["stream_id", "residual_layout"],
)
@dataclasses.dataclass(frozen=True)
class ResidualStream:
    """One microbatch's residual and the contribution waiting to join it.

    Attributes:
      residual: [rows, hidden] on `residual_layout` rows; None before the stack entry writes it.
      pending: The last producer's contribution; None when nothing is pending.
      batch: The batch facts this stream's boundaries select their paths by.
      stream_id: Identity shared with the `OwedOutput` handles this stream gives out.
      residual_layout: The rows `residual` is on; None in the Initial state.
    """

    residual: jax.Array | None
    pending: Contribution | None
    batch: BatchFacts
    stream_id: int
    residual_layout: Layout | None

    @classmethod
    def initial(cls, batch: BatchFacts) -> ResidualStream:
        return cls(None, None, batch, next(_stream_ids), None)

    @property
    def state(self) -> StreamState:
        if self.pending is not None:
            return StreamState.PENDING
        return StreamState.INITIAL if self.residual is None else StreamState.WRITTEN

    @property
    def output(self) -> OwedOutput:
        """The handle of this stream's current layer output."""
        return OwedOutput(self.stream_id)

    def check_output(self, output: Any) -> None:
        """Rejects anything but this stream's own handle (a trace-time identity check)."""
        if not isinstance(output, OwedOutput) or output.stream_id != self.stream_id:
            raise ValueError(f"{NOT_THIS_STREAM} (got {_describe(output)}, {self!r})")

    def with_pending(self, contribution: Contribution) -> tuple[OwedOutput, ResidualStream]:
        return self.output, dataclasses.replace(self, pending=contribution)

    def written(self, residual: jax.Array, layout: Layout) -> tuple[OwedOutput, ResidualStream]:
        stream = dataclasses.replace(self, residual=residual, pending=None, residual_layout=layout)
        return stream.output, stream

    def __repr__(self) -> str:
        rows = "" if self.residual_layout is None else f", residual rows {self.residual_layout}"
        owed = "" if self.pending is None else f", pending {self.pending.placement}"
        return f"ResidualStream({self.stream_id}, {self.state.value}{rows}{owed})"


def require_stream(stream: Any) -> ResidualStream:
    """`stream` if it is a started residual stream; otherwise the guide's start error."""
    if not isinstance(stream, ResidualStream):
        raise RuntimeError(f"{START_FIRST} (got stream={_describe(stream)})")
    return stream


def _describe(value: Any) -> str:
    if isinstance(value, OwedOutput):
        return repr(value)
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__}{list(shape) if shape is not None else ''}"
