"""Where a contribution's rows are and the work it still owes: the record every step states its
effect on."""

from __future__ import annotations

import dataclasses

from .layout import Layout, TokenAxis, canonical


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a contribution's rows are and the work it still owes, in order.

    Owed work runs in a fixed order: first the finalize (a sparse FFN's weighted combine of its
    top-k expert outputs), then the sums. A sum never runs on an unfinalized value.

    Attributes:
      layout: The token rows the value is on.
      owed: Token axes over which the value is still a partial sum (empty: no sum owed).
      finalize: The value is a `DeferredFinalize` whose combine has not run yet.
    """

    layout: Layout
    owed: tuple[TokenAxis, ...] = ()
    finalize: bool = False

    def __post_init__(self):
        if tuple(self.owed) != canonical(self.owed):
            raise ValueError(
                f"owed axes must be distinct, in canonical order; got owed={self.owed!r}"
            )

    @property
    def complete(self) -> bool:
        return not self.owed and not self.finalize

    def completed(self) -> Placement:
        return Placement(self.layout)

    def __str__(self) -> str:
        work = (["finalize"] if self.finalize else []) + (
            ["+".join(axis.name for axis in self.owed)] if self.owed else []
        )
        return f"rows {self.layout}, owing {', then '.join(work) or 'nothing'}"
