"""DeepSeek's MoE router (V2 softmax / V3 sigmoid with a correction bias, grouped top-k) and the
sparse FFNs built on it: one rank's (`DeepseekMoe`) and one on a topology (`DeepseekMoeFfn`).

The router returns a `models.layers.moe.routing.Routing`, so the expert compute
(`models.layers.moe.experts`), the finalize and the expert-parallel dispatch serve DeepSeek
unchanged. The math, as transformers 5 computes it (`DeepseekV2TopkRouter`,
`DeepseekV3TopkRouter`), in float32 whatever the model's dtype (the router's weight stays float32
in transformers):

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

LongCat-Flash (`LongcatFlashTopkRouter`) is the softmax rule with the correction bias, no
renormalization, and `zero_experts` zero-computation experts scored after the routed ones
(`rule.total_experts` router columns): a choice of one of them is the identity times its weight
(`models.layers.moe.routing.zero_expert_output`), with no weights and no matmul.

Nemotron-H's MoE (transformers' `NemotronHTopkRouter`) is the V3 rule with relu^2 experts and a
relu^2 shared expert of its own width (`ExpertActivation.RELU2`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import boundary_jax as bj
from boundary_jax.initializers import Normal, param

from ...config import DeepseekRouting as DeepseekRouting
from ...config import ExpertScoring as ExpertScoring
from ...config import GroupScore as GroupScore
from ...config import MoeConfig
from ..activations import ExpertActivation
from ..buffer import Buffer
from .ffn import MoeFfn
from .routing import Routing
from .sparse import GroupedMatmulImpl, PartitionEntry, SparseMoe


def deepseek_route(
    x: jax.Array, router: jax.Array, bias: jax.Array | None, rule: DeepseekRouting
) -> Routing:
    """DeepSeek's top-k choice of experts for every token.

    Args:
      x: [T, hidden] complete token rows.
      router: [hidden, total_experts] the router's kernel, whole on every rank (the routed
        experts, then the rule's zero-computation experts).
      bias: [total_experts] `e_score_correction_bias` where `rule.correction_bias`, else None.
      rule: The routing rule.

    Returns:
      The `Routing`: float32 weights (float64 for float64 `x`) taken from the unbiased scores,
      ordered by descending choice score (with a correction bias, not necessarily descending
      weight), and int32 expert ids (>= `rule.num_experts` for a zero-computation expert),
      [T, top_k] each.

    Raises:
      ValueError: Shapes that do not fit, or a bias given or missing against the rule.
    """
    experts = rule.total_experts
    if x.ndim != 2 or router.shape != (x.shape[1], experts):
        raise ValueError(
            f"router must be [hidden, total_experts={experts}] for x [T, hidden]; got "
            f"{router.shape=}, {x.shape=}"
        )
    if (bias is not None) != rule.correction_bias or (
        bias is not None and bias.shape != (experts,)
    ):
        raise ValueError(
            f"a [total_experts={experts}] correction bias is needed exactly when the rule has one "
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


class DeepseekMoe(SparseMoe):
    """DeepSeek's router + routed experts + shared experts of one rank; returns an unfinalized
    output, as `SparseMoe` does (the same experts and layout, DeepSeek's router).

    Attributes (besides `SparseMoe`'s, whose `shared_expert` is the shared experts: a
    `SharedExpert` of width `shared_width` (DeepSeek: `n_shared_experts * expert_width`),
    ungated, its width split over `shared_width_entry`, or None):
      router: [hidden, num_experts] float32 (transformers keeps it so), replicated; HF
        `mlp.gate.weight` transposed.
      e_score_correction_bias: A `Buffer` [num_experts] float32, replicated (HF
        `mlp.gate.e_score_correction_bias`); None without a correction bias. It only picks
        experts, so it gets no gradient and training leaves it as it is.
      rule: The routing rule.
    """

    def __init__(
        self,
        hidden_size: int,
        expert_width: int,
        rule: DeepseekRouting,
        *,
        shared_width: int | None,
        expert_entry: PartitionEntry = None,
        width_entry: PartitionEntry = None,
        shared_width_entry: PartitionEntry = None,
        impl: GroupedMatmulImpl = GroupedMatmulImpl.RAGGED_DOT,
        activation: ExpertActivation = ExpertActivation.SWIGLU,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        super().__init__(
            hidden_size,
            rule.num_experts,
            expert_width,
            top_k=rule.top_k,
            renormalize=rule.renormalize,
            shared_width=shared_width or None,
            expert_entry=expert_entry,
            width_entry=width_entry,
            shared_width_entry=shared_width_entry,
            impl=impl,
            activation=activation,
            dtype=dtype,
            rngs=rngs,
        )
        self.router, self.e_score_correction_bias = deepseek_router(hidden_size, rule, rngs=rngs)
        self.rule = rule

    def route(self, x: jax.Array) -> Routing:
        """[T, hidden] complete rows -> their DeepSeek `Routing` (alike on every rank)."""
        return deepseek_route(x, self.router[...], _value(self.e_score_correction_bias), self.rule)


class DeepseekMoeFfn(MoeFfn):
    """DeepSeek's sparse FFN on a topology: `MoeFfn`'s experts, shared experts and dispatch
    (gathered rows or all-to-all, experts over EP, their width over the rest), routed by
    DeepSeek's router (`moe.routing`).

    Attributes (besides `MoeFfn`'s): `router`, `e_score_correction_bias` and `rule`, as
    `DeepseekMoe`'s.
    """

    def __init__(
        self,
        hidden_size: int,
        moe: MoeConfig,
        topology: bj.Topology,
        *,
        dispatch: bj.MoeDispatch = bj.MoeDispatch.GATHER,
        capacity: int | None = None,
        impl: GroupedMatmulImpl = GroupedMatmulImpl.RAGGED_DOT,
        activation: ExpertActivation = ExpertActivation.SWIGLU,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if moe.routing is None:
            raise ValueError(
                "DeepseekMoeFfn routes by DeepSeek's rule; got a MoeConfig without routing. "
                "Use MoeFfn for a softmax top-k router"
            )
        super().__init__(
            hidden_size,
            moe,
            topology,
            dispatch=dispatch,
            capacity=capacity,
            impl=impl,
            activation=activation,
            dtype=dtype,
            rngs=rngs,
        )
        self.router, self.e_score_correction_bias = deepseek_router(
            hidden_size, moe.routing, rngs=rngs
        )
        self.rule = moe.routing

    def route(self, x: jax.Array) -> Routing:
        """[T, hidden] complete rows -> their DeepSeek `Routing` (alike on every rank)."""
        return deepseek_route(x, self.router[...], _value(self.e_score_correction_bias), self.rule)


def deepseek_router(
    hidden_size: int, rule: DeepseekRouting, *, rngs: nnx.Rngs
) -> tuple[nnx.Param, Buffer | None]:
    """A DeepSeek router's replicated float32 parameters: the kernel [hidden, total_experts],
    N(0, 1/hidden), and where the rule has one the correction bias [total_experts], N(0, 0.01)
    (transformers starts it at zero; random values make a bias used wrongly visible)."""
    experts = rule.total_experts
    router = param(
        Normal(1 / np.sqrt(hidden_size)),
        (hidden_size, experts),
        jnp.float32,
        rngs=rngs,
        sharding=(None, None),
    )
    if not rule.correction_bias:
        return router, None
    init = Normal(0.1)
    bias = init(rngs.params(), (experts,), jnp.float32)
    return router, Buffer(bias, initializer=init, out_sharding=(None,), eager_sharding=False)


def _value(variable: nnx.Variable | None) -> jax.Array | None:
    return None if variable is None else variable[...]
