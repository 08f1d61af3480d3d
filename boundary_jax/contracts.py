"""Frozen facts that declarations, bound plans and the residual stream share."""

from __future__ import annotations

import dataclasses
import enum

from .layout import Layout, TokenAxis, canonical


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


class ProducerReduction(enum.Enum):
    """How a stage's compute cooperates with the sum its output owes.

    ALWAYS_PARTIAL: compute always returns an unreduced contribution; the next stage's input
      completes it. Attention only (the `declare_attn()` default).
    EXIT_SCOPED: the stage's exit decides, before compute, whether the sum completes at the exit,
      in a reduce-scatter on the way back, or at the next input. Every FFN; a mixer with
      `declare_attn(reduction=EXIT_SCOPED)`.
    """

    ALWAYS_PARTIAL = "ALWAYS_PARTIAL"
    EXIT_SCOPED = "EXIT_SCOPED"


class ReductionPolicy(enum.Enum):
    """Which optional FFN output transports a stack may use (permissions, not commands).

    AR: the all-reduce path only.
    RS: a fixed-size reduce-scatter over the full TP group where eligible.
    RSV: the attention-DP reduce-scatter back to each DP rank's own rows where eligible.
    RS_RSV: both, RSV tried first.
    AUTO: the architecture's default, resolved when the stack is built.
    An ineligible choice falls back to the all-reduce path.
    """

    AR = "ar"
    RS = "rs"
    RSV = "rsv"
    RS_RSV = "rs+rsv"
    AUTO = "auto"

    @classmethod
    def parse(cls, text: str) -> ReductionPolicy:
        """The policy spelled `text` (`ar`, `rs`, `rsv`, `rs+rsv` or `auto`)."""
        for policy in cls:
            if policy.value == text:
                return policy
        choices = ", ".join(policy.value for policy in cls)
        raise ValueError(f"reduction policy must be one of {choices}; got {text!r}")

    @property
    def allows_rs(self) -> bool:
        return self in (ReductionPolicy.RS, ReductionPolicy.RS_RSV)

    @property
    def allows_rsv(self) -> bool:
        return self in (ReductionPolicy.RSV, ReductionPolicy.RS_RSV)


_ARCHITECTURE_POLICIES: dict[str, ReductionPolicy] = {}
DEFAULT_POLICY = ReductionPolicy.RS_RSV


def register_reduction_default(architecture: str, policy: ReductionPolicy) -> None:
    """Sets what `AUTO` resolves to for `architecture` (call at import time of a model module)."""
    if policy is ReductionPolicy.AUTO:
        raise ValueError(f"an architecture default must be a concrete policy; got {policy=}")
    _ARCHITECTURE_POLICIES[architecture] = policy


def resolve_reduction_policy(
    policy: ReductionPolicy, architecture: str | None = None
) -> ReductionPolicy:
    """A concrete policy: `policy` itself, or for `AUTO` the architecture's registered default.

    The built-in default is RS_RSV: each scatter it permits moves no more bytes than the
    all-reduce it replaces, every ineligible case falls back to the all-reduce, and under
    attention DP rsv ran 1-6% faster than ar end to end (benchmarks/RESULTS.md, run 5).
    """
    if policy is not ReductionPolicy.AUTO:
        return policy
    return _ARCHITECTURE_POLICIES.get(architecture or "", DEFAULT_POLICY)


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
            raise ValueError(f"owed axes must be distinct, in canonical order; got {self.owed=}")

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
