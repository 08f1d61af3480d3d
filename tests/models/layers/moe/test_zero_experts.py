"""Zero-computation (identity) experts, LongCat-Flash's: the router scores them after the routed
experts, a choice of one returns its input times its weight, and they hold no weights and cost
no matmul or dispatch; the sharded MoE equals a float64 NumPy reference under TP, attention DP
and expert parallelism (gathered rows and all-to-all); mutants of the path are caught."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
from boundary_jax import make_mesh
from models.config import DeepseekRouting, ExpertScoring, MoeConfig
from models.layers.moe import experts as routed_experts
from models.layers.moe import routing as moe_routing
from models.layers.moe import sparse as moe
from models.layers.moe.deepseek_router import DeepseekMoeFfn, deepseek_route
from tests.models import run_sharded, stage_counts

GATHER, ALL_TO_ALL = bj.MoeDispatch.GATHER, bj.MoeDispatch.ALL_TO_ALL
HIDDEN, WIDTH, EXPERTS, ZERO, TOP_K, TOKENS = 16, 8, 8, 4, 3, 32
RULE = DeepseekRouting(
    EXPERTS,
    TOP_K,
    ExpertScoring.SOFTMAX,
    correction_bias=True,
    scaling_factor=6.0,
    zero_experts=ZERO,
)
LAYER_MOE = MoeConfig(EXPERTS, TOP_K, WIDTH, renormalize=False, routing=RULE)
TOKENS_IN = jax.random.normal(jax.random.key(3), (TOKENS, HIDDEN), jnp.float32)


def longcat_reference(x, router, bias, gate_up, down) -> tuple[np.ndarray, int]:
    """Float64, one token at a time, as transformers' LongcatFlashMoE: (output [T, hidden],
    the choices of a zero-computation expert)."""
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(router, np.float64)
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    choice = scores + np.asarray(bias, np.float64)
    out, zero_choices = np.zeros_like(x), 0
    for t in range(len(x)):
        for e in np.argsort(-choice[t], kind="stable")[:TOP_K]:
            weight = scores[t, e] * RULE.scaling_factor
            if e >= EXPERTS:
                out[t] += weight * x[t]
                zero_choices += 1
                continue
            gate, up = np.moveaxis(np.asarray(gate_up[e], np.float64), 1, 0)
            hidden = x[t] @ gate
            hidden = hidden / (1 + np.exp(-hidden)) * (x[t] @ up)
            out[t] += weight * (hidden @ np.asarray(down[e], np.float64))
    return out, zero_choices


@functools.cache
def layer_case(dp, tp, ep, dispatch) -> tuple[DeepseekMoeFfn, jax.sharding.Mesh]:
    """The layer on its topology, each expert (and each rank's shard) with its own weights and
    a correction bias that moves some choices."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp, moe_ep=ep)
    module = DeepseekMoeFfn(HIDDEN, LAYER_MOE, topology, dispatch=dispatch, rngs=nnx.Rngs(7))
    module.e_score_correction_bias[...] = 0.05 * jax.random.normal(
        jax.random.key(8), (EXPERTS + ZERO,)
    )
    return module, make_mesh(topology)


def run_layer(module, mesh, x, *, defer: bool, counts=None) -> np.ndarray:
    """The layer's output on every token, completed as its boundary would (as in
    test_moe_decoder): gathered rows summed over the MoE output group, own rows as they are;
    its replicated parts counted as its stage boundary counts them, or as `counts` says."""
    topology = module.topology
    own = module.dispatch is ALL_TO_ALL
    rows = P(topology.shard_entry(bj.SumGroup.FULL_TP)) if own else P()

    def body(module, x):
        out = module(x, defer=defer, counts=counts or stage_counts(module))
        if defer:
            out = out.complete()
        names = () if own else topology.group_names(bj.SumGroup.MOE_OUTPUT)
        return jax.lax.psum(out, names) if names else out

    return np.asarray(run_sharded(module, mesh, body, (x,), (rows,), rows))


def reference(module) -> tuple[np.ndarray, int]:
    return longcat_reference(
        TOKENS_IN,
        module.router[...],
        module.e_score_correction_bias[...],
        module.gate_up_proj[...],
        module.down_proj[...],
    )


def relative_error(got, want) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


CASES = [  # (dp, tp, ep, dispatch, defer)
    (1, 1, 1, GATHER, False),
    (1, 4, 1, GATHER, True),
    (2, 2, 1, GATHER, False),
    (1, 4, 4, GATHER, False),
    (1, 4, 4, ALL_TO_ALL, True),
    (2, 4, 2, ALL_TO_ALL, False),  # experts over attention DP, their width over attention TP
]


@pytest.mark.parametrize("dp,tp,ep,dispatch,defer", CASES, ids=str)
def test_zero_experts_match_float64_reference(dp, tp, ep, dispatch, defer):
    """Routed and zero-computation experts, counted once over the ranks the output is summed
    over (or on every rank's own rows), equal transformers' math in float64; the router really
    chooses the zero-computation experts."""
    module, mesh = layer_case(dp, tp, ep, dispatch)
    want, zero_choices = reference(module)
    assert TOKENS * TOP_K // 8 < zero_choices < TOKENS * TOP_K // 2
    got = run_layer(module, mesh, TOKENS_IN, defer=defer)
    assert relative_error(got, want) < 1e-5


def test_zero_experts_hold_no_weights():
    """The router scores routed + zero experts; the expert weights are the routed ones only."""
    module, _ = layer_case(1, 4, 4, GATHER)
    assert module.router.shape == (HIDDEN, EXPERTS + ZERO)
    assert module.e_score_correction_bias.shape == (EXPERTS + ZERO,)
    assert module.gate_up_proj.shape == (EXPERTS, HIDDEN, 2, WIDTH)
    assert module.down_proj.shape == (EXPERTS, WIDTH, HIDDEN)


def test_zero_expert_output_is_the_weighted_identity():
    """Only choices past the routed experts count, each times its weight."""
    x = jnp.arange(6.0).reshape(2, 3)
    routing = moe_routing.Routing(
        weights=jnp.array([[0.5, 0.25, 2.0], [1.0, 3.0, 0.125]]),
        experts=jnp.array([[8, 1, 11], [0, 2, 3]], jnp.int32),
    )
    got = moe_routing.zero_expert_output(x, routing, num_experts=8)
    np.testing.assert_array_equal(got, np.array([[0.0, 2.5, 5.0], [0.0, 0.0, 0.0]]))


def test_all_zero_choices_send_nothing_and_cost_no_matmul(monkeypatch):
    """Tokens whose every choice is a zero-computation expert: the all-to-all sends no row
    (every received tag is -1), the grouped matmuls get no row, and the output is each token
    times its summed weights."""
    module, mesh = layer_case(1, 4, 4, ALL_TO_ALL)
    dispatch, grouped = bj.ops.dispatch_to_experts, routed_experts.grouped_expert_outputs
    seen = {}

    def recording_dispatch(*args, **options):
        dispatched = dispatch(*args, **options)
        seen["tags"] = dispatched.tags
        return dispatched

    def recording_grouped(x, rows, *rest):
        seen["sizes"] = rows.sizes
        return grouped(x, rows, *rest)

    monkeypatch.setattr(bj.ops, "dispatch_to_experts", recording_dispatch)
    monkeypatch.setattr(routed_experts, "grouped_expert_outputs", recording_grouped)
    biased = nnx.clone(module)
    biased.e_score_correction_bias[...] = jnp.concatenate([jnp.zeros(EXPERTS), jnp.ones(ZERO)])
    topology = module.topology

    def body(module, x):
        out = module(x, defer=False, counts=stage_counts(module))
        sent = jnp.sum(seen["tags"] >= 0) + jnp.sum(seen["sizes"])
        return out, jax.lax.psum(sent, topology.group_names(bj.SumGroup.FULL_TP))

    rows = P(topology.shard_entry(bj.SumGroup.FULL_TP))
    got, sent = run_sharded(biased, mesh, body, (TOKENS_IN,), (rows,), (rows, P()))
    want, zero_choices = reference(biased)
    assert zero_choices == TOKENS * TOP_K and int(sent) == 0
    assert relative_error(np.asarray(got), want) < 1e-6


def test_mutant_zero_experts_counted_on_every_rank_is_caught():
    """On gathered rows every rank computes the identity part whole: adding it on every rank
    of the MoE output group counts it TP times."""
    module, mesh = layer_case(1, 4, 4, GATHER)
    assert module.topology.tp_size == 4
    got = run_layer(module, mesh, TOKENS_IN, defer=False, counts=lambda name: True)
    assert relative_error(got, reference(module)[0]) > 1e-2


def test_mutant_zero_experts_returning_zero_is_caught(monkeypatch):
    """Zero-computation experts that return zero instead of their input are caught."""
    monkeypatch.setattr(moe, "zero_expert_output", lambda x, routing, num_experts: 0 * x)
    module, mesh = layer_case(2, 4, 2, ALL_TO_ALL)
    assert (
        relative_error(run_layer(module, mesh, TOKENS_IN, defer=False), reference(module)[0]) > 1e-2
    )


def test_router_scores_zero_experts_after_the_routed_ones():
    """`deepseek_route` with zero experts takes a [hidden, routed + zero] router and bias, and
    the rule rejects grouped selection beside them."""
    with pytest.raises(ValueError, match="total_experts=12"):
        deepseek_route(jnp.zeros((2, HIDDEN)), jnp.zeros((HIDDEN, EXPERTS)), jnp.zeros(12), RULE)
    with pytest.raises(NotImplementedError, match="grouped selection"):
        DeepseekRouting(8, 2, ExpertScoring.SOFTMAX, num_groups=2, zero_experts=4)
