"""A MoE with a router bias, expert biases and the clamped SwiGLU (GPT-OSS's) against float64
NumPy: one rank through every grouped-matmul path, and on a topology under gathered rows and
all-to-all, for expert-parallel sizes that split the experts, their width, or both: each expert's
down bias counted once, weighed by its routing weight."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
from models.config import MoeConfig
from models.layers.clamped_swiglu import ClampedSwiGlu
from models.layers.moe.experts import ExpertBiases, expert_outputs
from models.layers.moe.ffn import MoeFfn
from models.layers.moe.routing import route
from models.layers.moe.sparse import GroupedMatmulImpl
from tests.models import run_sharded, stage_counts

HIDDEN, TOKENS, LIMIT = 16, 24, 0.8
GATHER, ALL_TO_ALL = bj.MoeDispatch.GATHER, bj.MoeDispatch.ALL_TO_ALL
SLOW = pytest.mark.slow
MOE = MoeConfig(
    num_experts=8,
    top_k=3,
    expert_intermediate_size=8,
    renormalize=True,
    router_bias=True,
    expert_bias=True,
    swiglu_limit=LIMIT,
)
ACTIVATION = ClampedSwiGlu(LIMIT)


def clamped_swiglu(gate, up):
    """GPT-OSS's expert activation, float64."""
    gate, up = np.minimum(gate, LIMIT), np.clip(up, -LIMIT, LIMIT)
    return (up + 1) * gate / (1 + np.exp(-1.702 * gate))


def reference(x, router, router_bias, gate_up, gate_up_bias, down, down_bias) -> np.ndarray:
    """The whole layer, float64, one token at a time as transformers' GPT-OSS: top-k of the
    biased logits, softmax over the k; each expert's biases, its output weighed."""
    x, *weights = (np.asarray(a, np.float64) for a in (x, router, router_bias))
    router, router_bias = weights
    gate_up, gate_up_bias, down, down_bias = (
        np.asarray(a, np.float64) for a in (gate_up, gate_up_bias, down, down_bias)
    )
    logits = x @ router + router_bias
    out = np.zeros_like(x)
    for t in range(len(x)):
        chosen = np.argsort(-logits[t], kind="stable")[: MOE.top_k]
        gates = np.exp(logits[t, chosen] - logits[t, chosen].max())
        for e, weight in zip(chosen, gates / gates.sum(), strict=True):
            gate = x[t] @ gate_up[e, :, 0] + gate_up_bias[e, 0]
            up = x[t] @ gate_up[e, :, 1] + gate_up_bias[e, 1]
            out[t] += weight * (clamped_swiglu(gate, up) @ down[e] + down_bias[e])
    return out


def module_reference(module: MoeFfn, x: np.ndarray) -> np.ndarray:
    return reference(
        x,
        *(
            np.asarray(v[...])
            for v in (
                module.router,
                module.router_bias,
                module.gate_up_proj,
                module.gate_up_proj_bias,
                module.down_proj,
                module.down_proj_bias,
            )
        ),
    )


def test_activation_clamps_the_gate_above_and_the_up_projection_on_both_sides():
    """`(clip(up) + 1) * g * sigmoid(1.702 g)`, g = min(gate, limit): values past the limit on
    each side land where GPT-OSS puts them."""
    gate = np.array([-3.0, -0.5, 0.3, 0.8, 2.0])
    up = np.array([-2.0, 0.9, -0.7, 5.0, 0.1])
    got = ACTIVATION.apply(jnp.asarray(np.concatenate([gate, up]), jnp.float32))
    np.testing.assert_allclose(np.asarray(got), clamped_swiglu(gate, up), rtol=1e-6)
    with pytest.raises(ValueError, match="limit must be positive"):
        ClampedSwiGlu(0.0)


def test_biased_router_is_the_softmax_over_the_top_k_logits():
    """With a bias and renormalization the weights are GPT-OSS's softmax over the top-k
    logits; the bias changes which experts are picked."""
    rng = np.random.default_rng(1)
    x, router = rng.standard_normal((TOKENS, HIDDEN)), rng.standard_normal((HIDDEN, 8))
    bias = 2 * rng.standard_normal(8)
    got = route(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(router, jnp.float32),
        top_k=3,
        renormalize=True,
        bias=jnp.asarray(bias, jnp.float32),
    )
    logits = x @ router + bias
    experts = np.argsort(-logits, axis=-1, kind="stable")[:, :3]
    top = np.take_along_axis(logits, experts, axis=-1)
    weights = np.exp(top - top.max(-1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(got.experts), experts)
    np.testing.assert_allclose(
        np.asarray(got.weights), weights / weights.sum(-1, keepdims=True), rtol=1e-5
    )
    unbiased = np.argsort(-(x @ router), axis=-1, kind="stable")[:, :3]
    assert np.any(unbiased != experts)


@pytest.mark.parametrize(
    "impl",
    [GroupedMatmulImpl.RAGGED_DOT, GroupedMatmulImpl.PADDED_BATCHED, GroupedMatmulImpl.DENSE],
)
def test_every_grouped_path_adds_the_biases_of_the_rows_own_experts(impl):
    """A rank holding experts 2..5 of 8: each held (token, choice) row gets its own expert's
    gate/up bias before the clamped SwiGLU and its down bias after; rows of experts held
    elsewhere stay zero (no bias)."""
    call, (x, gate_up, down, biases), experts = held_experts_call(impl)
    got = jax.jit(call)(x, gate_up, down, biases)
    want = np.zeros((TOKENS, 3, HIDDEN))
    for t in range(TOKENS):
        for j, e in enumerate(experts[t]):
            if 2 <= e < 6:
                local = e - 2
                gate = x[t] @ gate_up[local, :, 0] + np.asarray(biases.gate_up)[local, 0]
                up = x[t] @ gate_up[local, :, 1] + np.asarray(biases.gate_up)[local, 1]
                want[t, j] = clamped_swiglu(gate, up) @ down[local] + np.asarray(biases.down)[local]
    chex.assert_trees_all_close(np.asarray(got), want, atol=1e-5)


def held_experts_call(impl: GroupedMatmulImpl):
    """`expert_outputs` on a rank holding experts 2..5 of 8, as a function of (x, gate_up,
    down, biases); those arguments (random); and each token's 3 experts [TOKENS, 3]."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    experts = np.stack([rng.permutation(8)[:3] for _ in range(TOKENS)]).astype(np.int32)
    gate_up = rng.standard_normal((4, HIDDEN, 2, 8)).astype(np.float32) / 4
    down = rng.standard_normal((4, 8, HIDDEN)).astype(np.float32) / 3
    biases = ExpertBiases(
        jnp.asarray(rng.standard_normal((4, 2, 8)), jnp.float32),
        jnp.asarray(rng.standard_normal((4, HIDDEN)), jnp.float32),
    )
    routing = route(jnp.asarray(x), jnp.zeros((HIDDEN, 8)), top_k=3, renormalize=True)
    routing = type(routing)(routing.weights, jnp.asarray(experts))

    def call(x, gate_up, down, biases):
        return expert_outputs(
            x,
            routing,
            gate_up,
            down,
            expert_offset=2,
            impl=impl,
            activation=ACTIVATION,
            biases=biases,
        )

    return call, (x, gate_up, down, biases), experts


JAXPRS = (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)


def adds_on_products(jaxpr) -> tuple[int, list[bool]]:
    """(the adds in `jaxpr` and the calls inside it that take a whole matmul product as an
    operand, which of `jaxpr`'s outputs are such products), looking through nested calls."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    products, adds = set(), 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
            products.update(eqn.outvars)
            continue
        if eqn.primitive.name == "add":
            adds += any(isinstance(v, jax.extend.core.Var) and v in products for v in eqn.invars)
        for inner in (p for p in eqn.params.values() if isinstance(p, JAXPRS)):
            inner_adds, outputs = adds_on_products(inner)
            adds += inner_adds
            if len(outputs) == len(eqn.outvars):  # a call: its outputs are the callee's
                products.update(
                    v for v, product in zip(eqn.outvars, outputs, strict=True) if product
                )
        for branch in eqn.params.get("branches", ()):
            adds += adds_on_products(branch)[0]
    return adds, [isinstance(v, jax.extend.core.Var) and v in products for v in jaxpr.outvars]


@pytest.mark.parametrize("impl", [GroupedMatmulImpl.RAGGED_DOT, GroupedMatmulImpl.PADDED_BATCHED])
def test_no_bias_is_added_to_a_whole_product(impl):
    """The gate/up bias is added after the product is split into its parts, the down bias after
    the rows are gathered back: added to a whole product, XLA makes the add the matmul's
    epilogue, and where cuBLAS wins the tiling search the add runs as a pass of its own over
    the product (GPT-OSS-20B's prefill, run 44). A product plus a bias counts 1."""
    call, args, _ = held_experts_call(impl)
    assert adds_on_products(jax.make_jaxpr(call)(*args))[0] == 0
    x, gate_up, down, biases = args
    products_plus_bias = jax.make_jaxpr(lambda x, w, b: x @ w + b[None])(
        x, gate_up[0, :, 0], biases.gate_up[0, 0]
    )
    assert adds_on_products(products_plus_bias)[0] == 1


LAYOUTS = (  # (dp, tp, moe_ep, dispatch): every kind of split, and the finalize deferred
    (1, 4, 1, GATHER, False),  # each expert's width over 4 ranks: the down bias on one
    (1, 4, 4, GATHER, True),  # experts over 4 EP ranks, gathered rows
    (2, 4, 2, ALL_TO_ALL, False),  # experts over EP 2, their width over 4
    (8, 1, 8, ALL_TO_ALL, True),
    (2, 2, 2, GATHER, False),
    (1, 8, 8, GATHER, False),
    (2, 4, 8, ALL_TO_ALL, False),
    (4, 2, 2, ALL_TO_ALL, True),
)
DEFAULT = LAYOUTS[:3]


@pytest.mark.parametrize(
    "dp,tp,ep,dispatch,defer",
    [pytest.param(*case, marks=[] if case in DEFAULT else [SLOW]) for case in LAYOUTS],
    ids=lambda v: str(getattr(v, "value", v)),
)
def test_sharded_biased_moe_equals_float64(dp, tp, ep, dispatch, defer):
    """Gathered rows summed over the MoE output group, or own rows sent all-to-all: the output
    equals the float64 layer (each expert's and each rank's weights and biases distinct), so
    every bias is counted once whatever splits the experts and their width."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp, moe_ep=ep)
    module = MoeFfn(
        HIDDEN, MOE, topology, dispatch=dispatch, activation=ACTIVATION, rngs=nnx.Rngs(5)
    )
    for bias in (module.router_bias, module.gate_up_proj_bias, module.down_proj_bias):
        bias[...] = bias[...] * 3  # of order one: a bias counted twice moves the output
    x = jax.random.normal(jax.random.key(2), (TOKENS * 2, HIDDEN), jnp.float32)
    own = dispatch is ALL_TO_ALL
    rows = P(topology.shard_entry(bj.SumGroup.FULL_TP)) if own else P()

    def body(module, x):
        out = module(x, defer=defer, counts=stage_counts(module))
        out = out.complete() if defer else out
        names = topology.group_names(bj.SumGroup.MOE_OUTPUT)
        return out if own or not names else jax.lax.psum(out, names)

    got = run_sharded(module, bj.make_mesh(topology), body, (x,), (rows,), rows)
    want = module_reference(module, np.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
