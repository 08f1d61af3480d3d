"""DeepSeek's MoE router (V2 softmax / V3 sigmoid with a correction bias, grouped top-k) and the
sparse FFN of one rank built on it.

The router returns a `models.moe.Routing`, so the expert compute, the finalize and the
expert-parallel dispatch of `models.moe` serve DeepSeek unchanged. The math, as transformers 5
computes it (`DeepseekV2TopkRouter`, `DeepseekV3TopkRouter`), in float32 whatever the model's
dtype (the router's weight stays float32 in transformers):

    logits = float32(x) @ float32(router)                         # [T, E]
    scores = softmax(logits)  (V2)  |  sigmoid(logits)  (V3)
    choice = scores + e_score_correction_bias                     # V3; V2: scores
    groups: E experts in n_group equal groups, scored by their best choice (V2
      group_limited_greedy) or the sum of their best two (V3); experts outside the topk_group
      best groups are excluded
    experts = top_k(choice)                                       # the bias only picks
    weights = scores[experts]                                     # ... never weighs
    weights /= sum(weights) + 1e-20    where norm_topk_prob (V3; transformers' V2 never does)
    weights *= routed_scaling_factor
    y = sum_j weights_j expert_{experts_j}(x) + shared_experts(x)

The shared experts are one dense SwiGLU of width `n_shared_experts * moe_intermediate_size`,
every token through it, ungated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from ..config import DeepseekRouting as DeepseekRouting
from ..config import ExpertScoring as ExpertScoring
from ..config import GroupScore as GroupScore
from .moe import (
    GroupedMatmulImpl,
    MoeOutput,
    PartitionEntry,
    Routing,
    SharedExpert,
    expert_outputs,
    finalized_expert_outputs,
)


def deepseek_route(
    x: jax.Array, router: jax.Array, bias: jax.Array | None, rule: DeepseekRouting
) -> Routing:
    """DeepSeek's top-k choice of experts for every token.

    Args:
      x: [T, hidden] complete token rows.
      router: [hidden, num_experts] the router's kernel, whole on every rank.
      bias: [num_experts] `e_score_correction_bias` where `rule.correction_bias`, else None.
      rule: The routing rule.

    Returns:
      The `Routing`: float32 weights (float64 for float64 `x`) taken from the unbiased scores,
      ordered by descending choice score (with a correction bias, not necessarily descending
      weight), and int32 expert ids, [T, top_k] each.

    Raises:
      ValueError: Shapes that do not fit, or a bias given or missing against the rule.
    """
    if x.ndim != 2 or router.shape != (x.shape[1], rule.num_experts):
        raise ValueError(
            f"router must be [hidden, num_experts={rule.num_experts}] for x [T, hidden]; got "
            f"{router.shape=}, {x.shape=}"
        )
    if (bias is not None) != rule.correction_bias or (
        bias is not None and bias.shape != (rule.num_experts,)
    ):
        raise ValueError(
            f"a [num_experts] correction bias is needed exactly when the rule has one "
            f"({rule.correction_bias=}); got {None if bias is None else bias.shape}"
        )
    acc = jnp.promote_types(x.dtype, jnp.float32)
    logits = jnp.dot(x.astype(acc), router.astype(acc), precision=jax.lax.Precision.HIGHEST)
    if rule.scoring is ExpertScoring.SOFTMAX:
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(acc)[None, :]
    if rule.num_groups > 1:
        choice = _keep_best_groups(choice, rule)
    _, experts = jax.lax.top_k(choice, rule.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if rule.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return Routing(weights=weights * rule.scaling_factor, experts=experts.astype(jnp.int32))


def _keep_best_groups(choice: jax.Array, rule: DeepseekRouting) -> jax.Array:
    """`choice` [T, E] with the experts outside each token's `topk_groups` best groups at -inf
    (transformers' V2 writes 0 there; softmax scores are positive, so the choice is the same)."""
    tokens = choice.shape[0]
    grouped = choice.reshape(tokens, rule.num_groups, -1)
    if rule.group_score is GroupScore.MAX:
        group_scores = jnp.max(grouped, axis=-1)
    else:
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, kept = jax.lax.top_k(group_scores, rule.topk_groups)  # [T, topk_groups]
    groups = jnp.arange(rule.num_groups, dtype=kept.dtype)
    allowed = jnp.any(kept[:, :, None] == groups[None, None, :], axis=1)  # [T, groups]
    return jnp.where(allowed[:, :, None], grouped, -jnp.inf).reshape(choice.shape)


class DeepseekMoe(nnx.Module):
    """DeepSeek's router + routed experts + shared experts of one rank; returns an unfinalized
    output, as `models.moe.SparseMoe` does (same expert parameters and layout).

    Attributes:
      router: [hidden, num_experts] float32 (transformers keeps it so), replicated; HF
        `mlp.gate.weight` transposed.
      e_score_correction_bias: [num_experts] float32, replicated (HF
        `mlp.gate.e_score_correction_bias`); None without a correction bias. It only picks
        experts, so it gets no gradient; a trainer must leave it out of weight decay.
      gate_up_proj: [num_experts, hidden, 2, width] each expert's gate and up projections,
        split over `expert_entry` (axis 0) and `width_entry` (axis 3).
      down_proj: [num_experts, width, hidden], split over `expert_entry` and `width_entry`.
      shared_experts: A `SharedExpert` of width `n_shared_experts * width`, ungated, its width
        split over `shared_width_entry`; None without shared experts.
      rule: The routing rule.
      impl: The grouped matmul implementation.
    """

    def __init__(
        self,
        hidden_size: int,
        expert_width: int,
        rule: DeepseekRouting,
        *,
        num_shared_experts: int,
        expert_entry: PartitionEntry = None,
        width_entry: PartitionEntry = None,
        shared_width_entry: PartitionEntry = None,
        impl: GroupedMatmulImpl = GroupedMatmulImpl.RAGGED_DOT,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        experts = rule.num_experts
        self.router = _param(rngs, (hidden_size, experts), (None, None), jnp.float32, hidden_size)
        self.e_score_correction_bias = (
            nnx.Param(
                0.1 * jax.random.normal(rngs.params(), (experts,), jnp.float32),
                out_sharding=PartitionSpec(None),
                eager_sharding=False,
            )
            if rule.correction_bias
            else None
        )
        self.gate_up_proj = _param(
            rngs,
            (experts, hidden_size, 2, expert_width),
            (expert_entry, None, None, width_entry),
            dtype,
            hidden_size,
        )
        self.down_proj = _param(
            rngs,
            (experts, expert_width, hidden_size),
            (expert_entry, width_entry, None),
            dtype,
            expert_width,
        )
        self.shared_experts = (
            SharedExpert(
                hidden_size,
                num_shared_experts * expert_width,
                gated=False,
                width_entry=shared_width_entry,
                dtype=dtype,
                rngs=rngs,
            )
            if num_shared_experts
            else None
        )
        self.rule = rule
        self.impl = impl

    def route(self, x: jax.Array) -> Routing:
        """[T, hidden] complete rows -> their `Routing` (alike on every rank)."""
        bias = self.e_score_correction_bias
        return deepseek_route(x, self.router[...], None if bias is None else bias[...], self.rule)

    def __call__(
        self,
        x: jax.Array,
        *,
        expert_offset: int | jax.Array = 0,
        count_shared: bool | jax.Array = True,
    ) -> MoeOutput:
        """[T, hidden] complete rows -> this rank's `MoeOutput` (unfinalized, owing the sum).

        Args:
          x: [T, hidden] token rows, the same on every rank that splits these experts.
          expert_offset: Global id of this rank's first local expert (0 when the experts are
            not split), computed by the caller.
          count_shared: Whether this rank adds its shared-experts output (a traced bool where
            the rank decides it, e.g. the first rank of a group that holds them whole).
        """
        routing = self.route(x)
        outputs = expert_outputs(
            x,
            routing,
            self.gate_up_proj[...],
            self.down_proj[...],
            **self._settings(x, expert_offset),
        )
        return MoeOutput(outputs, routing, self._shared(x, count_shared))

    def finalized(
        self,
        x: jax.Array,
        *,
        expert_offset: int | jax.Array = 0,
        count_shared: bool | jax.Array = True,
    ) -> jax.Array:
        """[T, hidden] complete rows -> this rank's finalized share, owing the sum (the
        combine made inside the expert computation, `finalized_expert_outputs`)."""
        return finalized_expert_outputs(
            x,
            self.route(x),
            self.gate_up_proj[...],
            self.down_proj[...],
            shared=self._shared(x, count_shared),
            **self._settings(x, expert_offset),
        )

    def _shared(self, x: jax.Array, count_shared: bool | jax.Array) -> jax.Array | None:
        if self.shared_experts is None:
            return None
        shared = self.shared_experts(x)
        return jnp.where(count_shared, shared, jnp.zeros_like(shared))

    def _settings(self, x: jax.Array, expert_offset: int | jax.Array) -> dict:
        return {
            "expert_offset": expert_offset,
            "impl": self.impl,
            "even_share": x.shape[0] * self.rule.top_k / self.rule.num_experts,
        }


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], spec: tuple, dtype, fan_in: int) -> nnx.Param:
    """N(0, 1/fan_in) weights, split as `spec` says."""
    value = jax.random.normal(rngs.params(), shape, jnp.float32) / np.sqrt(fan_in)
    return nnx.Param(value.astype(dtype), out_sharding=PartitionSpec(*spec), eager_sharding=False)
