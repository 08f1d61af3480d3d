"""Reduction policies: which optional FFN output transports a stack may use."""

from __future__ import annotations

import enum


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
