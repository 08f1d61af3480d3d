"""Router kinds beyond a plain softmax top-k: grouped selection, sigmoid scores, a correction bias
that only picks, scaled weights and zero-computation experts (`DeepseekRouting`, as DeepSeek-V2 /
V3 route and the families that adopted their router do)."""

from __future__ import annotations

import dataclasses
import enum


class ExpertScoring(enum.Enum):
    """How router logits become expert scores.

    SOFTMAX: over all experts (DeepSeek-V2).
    SIGMOID: each expert on its own (DeepSeek-V3).
    """

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class GroupScore(enum.Enum):
    """How a group of experts is scored for the grouped top-k.

    MAX: its best expert's choice score (DeepSeek-V2's `group_limited_greedy`).
    TOP2_SUM: the sum of its two best choice scores (DeepSeek-V3).
    """

    MAX = "max"
    TOP2_SUM = "top2-sum"


@dataclasses.dataclass(frozen=True)
class DeepseekRouting:
    """DeepSeek's routing rule: static and hashable.

    Attributes:
      num_experts: Routed experts (HF `n_routed_experts`).
      top_k: Experts per token (HF `num_experts_per_tok`).
      scoring: Softmax (V2) or sigmoid (V3) scores.
      num_groups: Equal groups the experts form (HF `n_group`); 1: no grouped selection.
      topk_groups: Groups whose experts a token may choose (HF `topk_group`).
      group_score: How a group is scored.
      correction_bias: The choice adds `e_score_correction_bias` to the scores (V3); the
        weights never do.
      renormalize: The k weights are divided by their sum (+ 1e-20) (V3's `norm_topk_prob`).
      scaling_factor: The weights' factor (HF `routed_scaling_factor`).
      zero_experts: Zero-computation (identity) experts after the routed ones (LongCat-Flash's
        `zero_expert_num`): the router scores `num_experts + zero_experts` experts, and a
        choice of an id >= `num_experts` returns its input times its weight, with no weights
        and no matmul. Not combined with grouped selection.
    """

    num_experts: int
    top_k: int
    scoring: ExpertScoring
    num_groups: int = 1
    topk_groups: int = 1
    group_score: GroupScore = GroupScore.MAX
    correction_bias: bool = False
    renormalize: bool = False
    scaling_factor: float = 1.0
    zero_experts: int = 0

    def __post_init__(self):
        for name in ("num_experts", "top_k", "num_groups", "topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DeepseekRouting.{name} must be a positive int; got {value!r}")
        if not isinstance(self.zero_experts, int) or self.zero_experts < 0:
            raise ValueError(
                "DeepseekRouting.zero_experts must be a non-negative int; got "
                f"{self.zero_experts!r}"
            )
        if self.zero_experts and self.num_groups > 1:
            raise NotImplementedError(
                "zero-computation experts with grouped selection are not supported (no model "
                f"has both); got {self.zero_experts=}, {self.num_groups=}"
            )
        if self.top_k > self.total_experts:
            raise ValueError(
                f"top_k ({self.top_k}) must not exceed the experts the router scores "
                f"({self.total_experts})"
            )
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(
                "the experts must form num_groups equal groups, of which topk_groups are kept; "
                f"got {self.num_experts=}, {self.num_groups=}, {self.topk_groups=}"
            )
        per_group = self.total_experts // self.num_groups
        if self.top_k > self.topk_groups * per_group:
            raise ValueError(
                f"top_k ({self.top_k}) must not exceed the experts of the kept groups "
                f"({self.topk_groups} x {per_group})"
            )
        if self.group_score is GroupScore.TOP2_SUM and self.num_groups > 1 and per_group < 2:
            raise ValueError(
                f"a group scored by its best two experts needs two; got {per_group} per group"
            )

    @property
    def total_experts(self) -> int:
        """The experts the router scores: the routed ones, then the zero-computation ones."""
        return self.num_experts + self.zero_experts
