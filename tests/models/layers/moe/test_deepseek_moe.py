"""DeepSeek routing (V2 softmax / V3 sigmoid + correction bias, grouped top-k) and its MoE
against transformers' modules and a float64 NumPy reference."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
from models.families.deepseek import read_routing
from models.layers.moe import routing as moe_routing
from models.layers.moe.deepseek_router import (
    DeepseekMoe,
    DeepseekRouting,
    ExpertScoring,
    GroupScore,
    deepseek_route,
)
from models.layers.moe.sparse import PartsCounted
from tests.models import make_mesh, run_sharded
from tests.models.layers.attention.test_mla import golden

V2_GROUPED = DeepseekRouting(12, 3, ExpertScoring.SOFTMAX, 4, 2, scaling_factor=2.0)
V3 = DeepseekRouting(
    12, 3, ExpertScoring.SIGMOID, 4, 2, GroupScore.TOP2_SUM, True, True, scaling_factor=2.5
)
RULES = {
    "v2-greedy": DeepseekRouting(12, 3, ExpertScoring.SOFTMAX),
    "v2-grouped": V2_GROUPED,
    "v3": V3,
    "v3-one-group-unnormalized": DeepseekRouting(
        12, 2, ExpertScoring.SIGMOID, group_score=GroupScore.TOP2_SUM, correction_bias=True
    ),
}


def routing_reference(x, router, bias, rule: DeepseekRouting):
    """Float64, one token at a time: (experts sorted by id, their weights)."""
    logits = x @ router
    if rule.scoring is ExpertScoring.SOFTMAX:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choice = scores + (0 if bias is None else bias)
    experts, weights = [], []
    for t in range(len(x)):
        groups = choice[t].reshape(rule.num_groups, -1)
        if rule.group_score is GroupScore.MAX:
            group_scores = groups.max(-1)
        else:
            group_scores = np.sort(groups, -1)[:, -2:].sum(-1)
        kept = np.argsort(-group_scores, kind="stable")[: rule.topk_groups]
        allowed = np.repeat(np.isin(np.arange(rule.num_groups), kept), groups.shape[1])
        chosen = np.sort(np.argsort(-np.where(allowed, choice[t], -np.inf))[: rule.top_k])
        weight = scores[t, chosen]
        if rule.renormalize:
            weight = weight / weight.sum()
        experts.append(chosen)
        weights.append(weight * rule.scaling_factor)
    return np.array(experts), np.array(weights)


def by_expert(routing: moe_routing.Routing) -> tuple[np.ndarray, np.ndarray]:
    """(experts, weights) of every token with its choices sorted by expert id."""
    experts, weights = np.asarray(routing.experts), np.asarray(routing.weights)
    order = np.argsort(experts, axis=-1)
    return np.take_along_axis(experts, order, -1), np.take_along_axis(weights, order, -1)


jit_route = jax.jit(deepseek_route, static_argnums=3)


@pytest.mark.parametrize("name", sorted(RULES))
def test_route_matches_float64_reference(name):
    """Each rule picks the reference's experts, weighs them by the unbiased scores, and keeps
    every choice inside the token's kept groups."""
    rule = RULES[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 16))
    router = 2 * rng.standard_normal((16, 12)) / 4
    bias = 0.3 * rng.standard_normal(12) if rule.correction_bias else None
    got = jit_route(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(router, jnp.float32),
        None if bias is None else jnp.asarray(bias, jnp.float32),
        rule,
    )
    assert got.experts.dtype == jnp.int32 and got.weights.dtype == jnp.float32
    experts, weights = by_expert(got)
    want_experts, want_weights = routing_reference(x, router, bias, rule)
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-5)
    per_group = 12 // rule.num_groups
    assert all(len(set(row // per_group)) <= rule.topk_groups for row in experts)


def test_correction_bias_picks_but_never_weighs():
    """A large bias on expert 5 puts it in every token's choice, with its unbiased sigmoid
    score as the weight."""
    rule = dataclasses.replace(V3, renormalize=False, scaling_factor=1.0)
    rng = np.random.default_rng(1)
    x, router = rng.standard_normal((32, 16)), rng.standard_normal((16, 12)) / 4
    bias = np.zeros(12)
    bias[5] = 10.0
    routing = jit_route(*(jnp.asarray(a, jnp.float32) for a in (x, router, bias)), rule)
    chosen = np.asarray(routing.experts) == 5
    assert chosen.any(axis=1).all()
    scores = 1 / (1 + np.exp(-(x @ router)[:, 5]))
    np.testing.assert_allclose(np.asarray(routing.weights)[chosen], scores, rtol=1e-5)
    assert np.asarray(routing.weights).max() < 1.0


def test_rule_rejects_bad_settings():
    """Groups that do not divide the experts, too few allowed experts, or a missing bias fail
    early; a V2 config asking for norm_topk_prob is refused rather than guessed."""
    with pytest.raises(ValueError, match="equal groups"):
        DeepseekRouting(12, 2, ExpertScoring.SOFTMAX, num_groups=5)
    with pytest.raises(ValueError, match="must not exceed"):
        DeepseekRouting(12, 7, ExpertScoring.SOFTMAX, num_groups=4, topk_groups=2)
    with pytest.raises(ValueError, match="correction bias"):
        deepseek_route(jnp.zeros((2, 16)), jnp.zeros((16, 12)), None, V3)
    config = golden("deepseek_v2")[0]
    with pytest.raises(ValueError, match="norm_topk_prob"):
        read_routing(config | {"norm_topk_prob": True})


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_routing_from_hf_config_matches_transformers(name):
    """The golden config's rule with its layer-1 router (and bias) chooses transformers'
    experts with transformers' weights."""
    config, weights, modules = golden(name)
    rule = read_routing(config)
    assert rule == (V2_GROUPED if name == "deepseek_v2" else V3)
    prefix = "model.layers.1.mlp.gate."
    bias = weights.get(prefix + "e_score_correction_bias")
    got = jit_route(
        jnp.asarray(modules["moe_in_1"]),
        jnp.asarray(weights[prefix + "weight"].T),
        None if bias is None else jnp.asarray(bias),
        rule,
    )
    experts, routed = by_expert(got)
    np.testing.assert_array_equal(experts, modules["router_experts_1"])
    np.testing.assert_allclose(routed, modules["router_weights_1"], rtol=2e-6)


@functools.cache
def hf_moe(name: str, expert_entry=None, width_entry=None) -> DeepseekMoe:
    """Golden `name`'s layer-1 MoE: routed experts stacked as the MoE loader stacks them."""
    config, weights, _ = golden(name)
    prefix = "model.layers.1.mlp."
    module = DeepseekMoe(
        config["hidden_size"],
        config["moe_intermediate_size"],
        read_routing(config),
        shared_width=config["n_shared_experts"] * config["moe_intermediate_size"],
        expert_entry=expert_entry,
        width_entry=width_entry,
        shared_width_entry=width_entry,
        rngs=nnx.Rngs(0),
    )
    experts = range(config["n_routed_experts"])
    expert = lambda e, proj: weights[f"{prefix}experts.{e}.{proj}_proj.weight"].T  # noqa: E731
    module.gate_up_proj[...] = np.stack(
        [np.stack([expert(e, "gate"), expert(e, "up")], axis=1) for e in experts]
    )
    module.down_proj[...] = np.stack([expert(e, "down") for e in experts])
    module.router[...] = weights[prefix + "gate.weight"].T
    if module.e_score_correction_bias is not None:
        module.e_score_correction_bias[...] = weights[prefix + "gate.e_score_correction_bias"]
    shared = {
        proj: weights[f"{prefix}shared_experts.{proj}_proj.weight"].T
        for proj in ("gate", "up", "down")
    }
    module.shared_expert.gate_up_proj[...] = np.stack([shared["gate"], shared["up"]], axis=1)
    module.shared_expert.down_proj[...] = shared["down"]
    return module


EXPERT_AXIS, WIDTH_AXIS = bj.MeshAxis.ATTN_TP.value, bj.MeshAxis.ATTN_DP.value


@pytest.mark.parametrize("name,dp,tp", [("deepseek_v2", 1, 1), ("deepseek_v3", 2, 4)])
def test_moe_matches_transformers(name, dp, tp):
    """Experts split over one mesh axis and their width (shared experts' too) over another,
    finalized, the shared experts counted once and the ranks summed, equal transformers'
    DeepSeek MoE of golden layer 1."""
    module = hf_moe(name, EXPERT_AXIS, WIDTH_AXIS)
    modules = golden(name)[2]

    def body(module, x):
        first = lax.axis_index(EXPERT_AXIS) == 0  # every width rank adds its share once
        offset = lax.axis_index(EXPERT_AXIS) * module.gate_up_proj.shape[0]
        output = module(x, expert_offset=offset, counted=PartsCounted(shared=first))
        return lax.psum(moe_routing.finalize(output), (EXPERT_AXIS, WIDTH_AXIS))

    x = jnp.asarray(modules["moe_in_1"])
    got = run_sharded(module, make_mesh(dp, tp), body, (x,), (P(),), P())
    np.testing.assert_allclose(got, modules["moe_out_1"], atol=2e-5, rtol=1e-5)
