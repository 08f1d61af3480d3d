"""One rank's MoE compute: router, grouped expert matmuls and finalize against float64 loops."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
from models.layers.moe import experts as routed_experts
from models.layers.moe import routing as moe_routing
from models.layers.moe import sparse as moe
from models.layers.moe.routing import MoeOutput, Routing
from models.layers.moe.sparse import GroupedMatmulImpl
from pallas_kernels.grouped_matmul import TRITON_MAX_ROUTED_ROWS, grouped_matmul_reference
from pallas_kernels.grouped_matmul import ops as grouped_matmul_ops
from tests.models import make_mesh, run_sharded

HIDDEN, TOKENS = 16, 24
GROUPED = (GroupedMatmulImpl.DENSE, GroupedMatmulImpl.RAGGED_DOT, GroupedMatmulImpl.PADDED_BATCHED)
SLOW = pytest.mark.slow
# Sweeps run DENSE (an einsum over every expert) under -m slow; the width-slice test runs it.
SWEPT = [pytest.param(GroupedMatmulImpl.DENSE, marks=SLOW), *GROUPED[1:]]


@dataclasses.dataclass(frozen=True)
class Layer:
    """Float64 NumPy weights of one MoE layer; every expert and width column is distinct."""

    x: np.ndarray  # [T, hidden]
    router: np.ndarray  # [hidden, E]
    gate: np.ndarray  # [E, hidden, width]
    up: np.ndarray
    down: np.ndarray  # [E, width, hidden]
    shared: tuple[np.ndarray, np.ndarray, np.ndarray]
    shared_gate: np.ndarray  # [hidden, 1]

    @property
    def gate_up(self) -> np.ndarray:
        """[E, hidden, 2, width]: gate and up stacked as the module stores them."""
        return np.stack([self.gate, self.up], axis=2)


@functools.cache
def make_layer(experts: int, width: int = 8, seed: int = 0) -> Layer:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape) / np.sqrt(shape[-2])  # noqa: E731
    # Router logits of std ~2 give varied top-k sets without near-ties.
    return Layer(
        x=rng.standard_normal((TOKENS, HIDDEN)),
        router=2 * normal(HIDDEN, experts),
        gate=normal(experts, HIDDEN, width),
        up=normal(experts, HIDDEN, width),
        down=normal(experts, width, HIDDEN),
        shared=(rng.standard_normal((HIDDEN, 2, 12)) / np.sqrt(HIDDEN), normal(12, HIDDEN)),
        shared_gate=normal(HIDDEN, 1),
    )


def silu(v):
    return v / (1 + np.exp(-v))


def loop_outputs(layer: Layer, experts, offset: int, local: int, cols=slice(None)) -> np.ndarray:
    """[T, k, hidden] by a plain loop: expert experts[t, j] on token t if in the block, else 0."""
    tokens, top_k = experts.shape
    out = np.zeros((tokens, top_k, HIDDEN))
    for t in range(tokens):
        for j in range(top_k):
            e = int(experts[t, j])
            if offset <= e < offset + local:
                g, u = layer.gate[e][:, cols], layer.up[e][:, cols]
                d = layer.down[e][cols]
                out[t, j] = (silu(layer.x[t] @ g) * (layer.x[t] @ u)) @ d
    return out


def numpy_routing(layer: Layer, top_k: int, renormalize: bool):
    logits = layer.x @ layer.router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, experts, axis=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize"))
def jit_route(x, router, *, top_k, renormalize):
    return moe_routing.route(x, router, top_k=top_k, renormalize=renormalize)


@functools.partial(jax.jit, static_argnames=("impl",))
def jit_expert_outputs(x, routing, gate_up, down, offset, *, impl):
    return routed_experts.expert_outputs(x, routing, gate_up, down, expert_offset=offset, impl=impl)


def routing_of(weights, experts) -> Routing:
    return Routing(weights=jnp.asarray(weights), experts=jnp.asarray(experts, jnp.int32))


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 4), (6, 1)])
def test_route_is_softmax_then_top_k(experts, top_k, renormalize):
    """Top-k of the full softmax, descending; renormalised to sum 1 only when asked."""
    layer = make_layer(experts)
    with jax.enable_x64(True):
        got = jit_route(layer.x, layer.router, top_k=top_k, renormalize=renormalize)
        want_weights, want_experts = numpy_routing(layer, top_k, renormalize)
        np.testing.assert_array_equal(np.asarray(got.experts), want_experts)
        assert got.experts.dtype == jnp.int32 and got.weights.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got.weights), want_weights, rtol=1e-12)
    sums = np.asarray(got.weights).sum(-1)
    if renormalize:
        np.testing.assert_allclose(sums, 1.0, rtol=1e-12)
    elif top_k < experts:
        assert (sums < 1 - 1e-3).all()  # the raw probabilities of k < E experts
    assert len(np.unique(want_experts)) == experts  # every expert chosen by some token


BLOCKS = [
    # (experts, top_k, offset, local): the whole set, first/middle/last blocks, single experts;
    # by default the whole set, a middle block, the last single expert and uneven sizes.
    (8, 2, 0, 8),
    pytest.param(8, 2, 0, 2, marks=SLOW),
    (8, 2, 4, 2),
    pytest.param(8, 2, 6, 2, marks=SLOW),
    pytest.param(16, 4, 4, 4, marks=SLOW),
    (16, 4, 15, 1),
    (6, 3, 2, 3),
]


@pytest.mark.parametrize("impl", SWEPT, ids=lambda i: i.name)
@pytest.mark.parametrize("experts,top_k,offset,local", BLOCKS)
def test_block_outputs_equal_per_token_loop(experts, top_k, offset, local, impl):
    """Row (t, j) is expert experts[t, j] on token t when this block holds it, zero otherwise."""
    layer = make_layer(experts)
    weights, chosen = numpy_routing(layer, top_k, renormalize=True)
    block = slice(offset, offset + local)
    held = (chosen >= offset) & (chosen < offset + local)
    if local < experts:  # the block covers some choices and misses others
        assert held.any() and not held.all()
    with jax.enable_x64(True):
        got = jit_expert_outputs(
            layer.x,
            routing_of(weights, chosen),
            layer.gate_up[block],
            layer.down[block],
            jnp.int32(offset),
            impl=impl,
        )
        assert got.shape == (TOKENS, top_k, HIDDEN) and got.dtype == jnp.float64
        want = loop_outputs(layer, chosen, offset, local)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-12, rtol=1e-12)
    assert (np.abs(want[held]).max(-1) > 1e-3).all() and not want[~held].any()


@pytest.mark.parametrize("impl", GROUPED, ids=lambda i: i.name)
def test_width_slices_sum_to_whole_expert(impl):
    """Outputs over slices of the expert width sum to the outputs of the whole width."""
    layer = make_layer(8)
    weights, chosen = numpy_routing(layer, 2, renormalize=True)
    with jax.enable_x64(True):
        parts = [
            jit_expert_outputs(
                layer.x,
                routing_of(weights, chosen),
                layer.gate_up[2:6, ..., cols],
                layer.down[2:6, cols],
                jnp.int32(2),
                impl=impl,
            )
            for cols in (slice(0, 3), slice(3, 8))
        ]
        want = loop_outputs(layer, chosen, 2, 4)
        np.testing.assert_allclose(np.asarray(parts[0] + parts[1]), want, atol=1e-12)
    # Each slice alone is not the whole: the sum is owed, not already taken.
    assert np.abs(np.asarray(parts[0]) - want).max() > 1e-2


SPLITS = [
    # (experts, top_k, expert ranks, width ranks, renormalize, shared); by default experts over
    # ranks alone, a shared expert with the width split, and uneven sizes without renormalizing.
    pytest.param(8, 2, 4, 1, True, False, marks=SLOW),
    (8, 2, 2, 2, True, True),
    (16, 4, 8, 1, True, False),
    pytest.param(16, 4, 4, 2, False, True, marks=SLOW),
    (6, 3, 3, 2, False, False),
]


def rank_outputs(layer, routing, ranks, widths, impl, shared):
    """Every (expert block, width slice) rank's MoeOutput."""
    experts, _, width = layer.gate.shape
    local, cols = experts // ranks, width // widths
    outputs = []
    for r in range(ranks):
        for w in range(widths):
            block, sl = slice(r * local, (r + 1) * local), slice(w * cols, (w + 1) * cols)
            out = jit_expert_outputs(
                layer.x,
                routing,
                layer.gate_up[block, ..., sl],
                layer.down[block, sl],
                jnp.int32(r * local),
                impl=impl,
            )
            shared_out = None
            if shared:
                shared_cols = slice(w * 12 // widths, (w + 1) * 12 // widths)
                gate_up, d = layer.shared
                shared_out = moe.shared_expert(
                    jnp.asarray(layer.x),
                    jnp.asarray(gate_up[..., shared_cols]),
                    jnp.asarray(d[shared_cols]),
                    jnp.asarray(layer.shared_gate),
                )
                if r:  # a width-split shared expert belongs to one expert rank's sum only
                    shared_out = jnp.zeros_like(shared_out)
            outputs.append(MoeOutput(expert_outputs=out, routing=routing, shared=shared_out))
    return outputs


@pytest.mark.parametrize("impl", SWEPT, ids=lambda i: i.name)
@pytest.mark.parametrize("experts,top_k,ranks,widths,renormalize,shared", SPLITS)
def test_rank_partials_sum_to_reference(experts, top_k, ranks, widths, renormalize, shared, impl):
    """Finalized partials summed over expert blocks and width slices equal the float64 loop,
    and finalize commutes with the sum (deferring it changes nothing)."""
    layer = make_layer(experts)
    kwargs = {"top_k": top_k, "renormalize": renormalize}
    reference = moe.moe_reference(
        layer.x,
        layer.router,
        layer.gate_up,
        layer.down,
        **kwargs,
        shared=layer.shared if shared else None,
        shared_gate=layer.shared_gate if shared else None,
    )
    with jax.enable_x64(True):
        routing = jit_route(layer.x, layer.router, **kwargs)
        outputs = rank_outputs(layer, routing, ranks, widths, impl, shared)
        finalized_then_summed = sum(np.asarray(moe_routing.finalize(o)) for o in outputs)
        summed = jax.tree.map(lambda *leaves: sum(leaves), *outputs)
        summed = dataclasses.replace(summed, routing=routing)
        summed_then_finalized = np.asarray(moe_routing.finalize(summed))
    np.testing.assert_allclose(finalized_then_summed, reference, atol=1e-12, rtol=1e-12)
    np.testing.assert_allclose(summed_then_finalized, reference, atol=1e-12, rtol=1e-12)

    # The comparison can fail: each of these mistakes moves the result far beyond 1e-12.
    weights = np.asarray(routing.weights)
    chosen = np.asarray(routing.experts)
    per_choice = loop_outputs(layer, chosen, 0, experts)
    extra = reference - np.einsum("tk,tkh->th", weights, per_choice)  # the shared expert, or 0
    mutants = {
        "wrong expert": loop_outputs(layer, (chosen + 1) % experts, 0, experts),
        "last choice dropped": per_choice * (np.arange(top_k) < top_k - 1)[None, :, None],
        "first choice doubled": per_choice * (1 + (np.arange(top_k) == 0))[None, :, None],
    }
    for name, mutant in mutants.items():
        mutated = np.einsum("tk,tkh->th", weights, mutant) + extra
        assert np.abs(mutated - reference).max() > 1e-2, name
    flipped = moe.moe_reference(
        layer.x,
        layer.router,
        layer.gate_up,
        layer.down,
        top_k=top_k,
        renormalize=not renormalize,
    )
    if top_k < experts:
        assert np.abs(flipped + extra - reference).max() > 1e-2, "renormalisation flipped"


def test_finalize_float32_and_bf16():
    """finalize accumulates in float32 and returns the activation dtype or the one asked."""
    layer = make_layer(8)
    routing = jit_route(
        jnp.asarray(layer.x, jnp.float32),
        jnp.asarray(layer.router, jnp.float32),
        top_k=2,
        renormalize=True,
    )
    out = jit_expert_outputs(
        jnp.asarray(layer.x, jnp.bfloat16),
        routing,
        *(jnp.asarray(a, jnp.bfloat16) for a in (layer.gate_up, layer.down)),
        jnp.int32(0),
        impl=GroupedMatmulImpl.RAGGED_DOT,
    )
    assert out.dtype == jnp.bfloat16
    output = MoeOutput(expert_outputs=out, routing=routing, shared=None)
    assert moe_routing.finalize(output).dtype == jnp.bfloat16
    got = moe_routing.finalize(output, jnp.float32)
    want = moe.moe_reference(
        layer.x, layer.router, layer.gate_up, layer.down, top_k=2, renormalize=True
    )
    chex.assert_trees_all_close(np.asarray(got), want.astype(np.float32), atol=5e-2)


EXPERT_AXIS, WIDTH_AXIS = bj.MeshAxis.ATTN_TP.value, bj.MeshAxis.ATTN_DP.value


@pytest.mark.parametrize("shared", [False, True])  # one device and DP 2 x TP 4 under -m slow
@pytest.mark.parametrize(
    "dp,tp", [pytest.param(1, 1, marks=SLOW), (1, 4), pytest.param(2, 4, marks=SLOW), (2, 2)]
)
def test_module_under_shard_map(dp, tp, shared):
    """SparseMoe with experts split over one mesh axis and width over another, finalized and
    summed by the caller, equals the float64 reference of its global weights."""
    module = moe.SparseMoe(
        HIDDEN,
        8,
        16,
        top_k=2,
        renormalize=not shared,
        shared_width=12 if shared else None,
        shared_gated=shared,
        expert_entry=EXPERT_AXIS,
        width_entry=WIDTH_AXIS,
        shared_width_entry=WIDTH_AXIS,
        rngs=nnx.Rngs(3),
    )
    spec = nnx.get_partition_spec(nnx.state(module))
    assert spec.gate_up_proj.get_value() == P(EXPERT_AXIS, None, None, WIDTH_AXIS)
    assert spec.down_proj.get_value() == P(EXPERT_AXIS, WIDTH_AXIS, None)
    x = jax.random.normal(jax.random.key(1), (TOKENS, HIDDEN), jnp.float32)

    def body(module, x):
        local = module.gate_up_proj.shape[0]
        offset = lax.axis_index(EXPERT_AXIS) * local
        output = module(x, expert_offset=offset)
        if output.shared is not None:  # the test owns the rule: count the shared expert once
            first = lax.axis_index(EXPERT_AXIS) == 0
            output = dataclasses.replace(output, shared=jnp.where(first, output.shared, 0.0))
        return lax.psum(moe_routing.finalize(output), (EXPERT_AXIS, WIDTH_AXIS))

    got = run_sharded(module, make_mesh(dp, tp), body, (x,), (P(),), P())
    weights = {
        k: np.asarray(v, np.float64)
        for k, v in nnx.to_pure_dict(nnx.state(module)).items()
        if not isinstance(v, dict)
    }
    shared_module = module.shared_expert
    want = moe.moe_reference(
        np.asarray(x),
        weights["router"],
        weights["gate_up_proj"],
        weights["down_proj"],
        top_k=2,
        renormalize=not shared,
        shared=None
        if shared_module is None
        else (
            np.asarray(shared_module.gate_up_proj[...]),
            np.asarray(shared_module.down_proj[...]),
        ),
        shared_gate=None if shared_module is None else np.asarray(shared_module.expert_gate[...]),
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)


def test_pallas_experts_keep_the_varying_axes_check():
    """With the Pallas expert kernel bound (the Triton body, interpreted) shard_map keeps
    check_vma on: experts split over TP and summed over it equal the float64 layer; the same
    split experts treated as whole (their output returned as complete, the sum over the expert
    ranks forgotten) fail to trace, where with the check off they run, wrong."""
    module = moe.SparseMoe(
        128,
        8,
        64,
        top_k=2,
        renormalize=True,
        expert_entry=EXPERT_AXIS,
        impl=GroupedMatmulImpl.PALLAS_INTERPRET,
        rngs=nnx.Rngs(4),
    )
    x = jax.random.normal(jax.random.key(1), (TOKENS, 128), jnp.float32)
    mesh = make_mesh(1, 2)

    def partial(module, x):
        offset = lax.axis_index(EXPERT_AXIS) * module.gate_up_proj.shape[0]
        return module.finalized(x, expert_offset=offset)

    def summed(module, x):
        return lax.psum(partial(module, x), EXPERT_AXIS)

    want = moe.moe_reference(
        np.asarray(x),
        np.asarray(module.router[...]),
        np.asarray(module.gate_up_proj[...]),
        np.asarray(module.down_proj[...]),
        top_k=2,
        renormalize=True,
    )
    got = run_sharded(module, mesh, summed, (x,), (P(),), P())
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="replicat"):
        run_sharded(module, mesh, partial, (x,), (P(),), P())
    unchecked = run_sharded(module, mesh, partial, (x,), (P(),), P(), check_vma=False)
    assert np.abs(np.asarray(unchecked) - want).max() > 1e-2


def test_rejects_bad_shapes_and_settings():
    """Mismatched expert weights and top_k out of range fail clearly (the kernels' own inputs:
    tests/pallas_kernels/test_grouped_matmul.py)."""
    layer = make_layer(8)
    x = jnp.asarray(layer.x, jnp.float32)
    routing = jit_route(x, jnp.asarray(layer.router, jnp.float32), top_k=2, renormalize=True)
    gate_up = jnp.asarray(layer.gate_up, jnp.float32)
    with pytest.raises(ValueError, match="down \\[local_experts, width, hidden\\]"):
        routed_experts.expert_outputs(x, routing, gate_up, gate_up[:, :, 0])
    with pytest.raises(ValueError, match="gate_up \\[local_experts, hidden, 2, width\\]"):
        routed_experts.expert_outputs(x, routing, gate_up[:, :, 0], jnp.asarray(layer.down))
    with pytest.raises(ValueError, match="top_k must be in"):
        moe_routing.route(x, jnp.asarray(layer.router), top_k=9, renormalize=True)
    with pytest.raises(ValueError, match="router must be"):
        moe_routing.route(x, jnp.asarray(layer.router).T, top_k=2, renormalize=True)
    with pytest.raises(ValueError, match="needs a shared expert"):
        moe.SparseMoe(16, 8, 8, top_k=2, renormalize=True, shared_gated=True, rngs=nnx.Rngs(0))


def test_capacity_buckets():
    """1.25 and 1.5 times the even share, in whole tiles (64 rows; 8 for small shares), never
    above the routed rows."""
    assert routed_experts.capacity_buckets(256, 32768) == (320, 384)  # Qwen3-30B-A3B, 4096 tokens
    assert routed_experts.capacity_buckets(6, 48) == (8, 16)
    assert routed_experts.capacity_buckets(24, 30) == (30,)
    assert routed_experts.capacity_buckets(0.25, 48) == (8,)


def skewed_routing(busiest_load: int, tokens: int = TOKENS, experts: int = 8):
    """Top-2 choices of distinct experts where expert 0 gets `busiest_load` rows and the
    others about an even share of the rest."""
    chosen = np.zeros((tokens, 2), np.int32)
    for t in range(tokens):
        others = [1 + (t + i) % (experts - 1) for i in range(2)]
        chosen[t] = [0, others[0]] if t < busiest_load else others
    return np.full((tokens, 2), 0.5), chosen


@pytest.mark.parametrize(
    "busiest_load,branch",
    [(8, "padded 8"), (9, "padded 16"), (16, "padded 16"), (17, "grouped")],
)
def test_padded_batched_takes_the_first_bucket_that_fits(monkeypatch, busiest_load, branch):
    """With an even share of 6 rows (buckets 8 and 16), the busiest expert's load picks the
    branch: the first bucket that holds it, else the grouped matmuls. Every other branch is
    poisoned, so a wrong pick (a dropped row, or a needless fallback) shows."""
    layer = make_layer(8)
    weights, chosen = skewed_routing(busiest_load)
    assert np.bincount(chosen.reshape(-1)).max() == busiest_load
    padded, grouped = routed_experts.padded_expert_outputs, routed_experts.grouped_expert_outputs

    def poisoned(name, real):
        def call(*args):
            out = real(*args)
            return out if name == branch else jnp.full_like(out, jnp.nan)

        return call

    monkeypatch.setattr(
        routed_experts,
        "padded_expert_outputs",
        lambda x, rows, w, capacity, *rest: poisoned(f"padded {capacity}", padded)(
            x, rows, w, capacity, *rest
        ),
    )
    monkeypatch.setattr(routed_experts, "grouped_expert_outputs", poisoned("grouped", grouped))
    with jax.enable_x64(True):
        got = routed_experts.expert_outputs(
            jnp.asarray(layer.x),
            routing_of(weights, chosen),
            layer.gate_up,
            layer.down,
            impl=GroupedMatmulImpl.PADDED_BATCHED,
        )
        want = loop_outputs(layer, chosen, 0, 8)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("impl", SWEPT, ids=lambda i: i.name)
@pytest.mark.parametrize("busiest_load", [8, 16, 17], ids=["bucket 8", "bucket 16", "grouped"])
@pytest.mark.parametrize("offset,local", [pytest.param(0, 8, marks=SLOW), (0, 4)])  # whole: slow
def test_finalized_expert_outputs_equal_the_weighted_loop(impl, busiest_load, offset, local):
    """finalized_expert_outputs is the weighted sum of the block's per-choice outputs plus the
    shared share, through every PADDED_BATCHED branch (each bucket and the grouped fallback)."""
    layer = make_layer(8)
    weights, chosen = skewed_routing(busiest_load)
    weights = weights * np.linspace(0.5, 1.5, TOKENS)[:, None]  # no two tokens weighted alike
    shared = np.tanh(layer.x)  # any [T, hidden] share
    block = slice(offset, offset + local)
    with jax.enable_x64(True):
        got = routed_experts.finalized_expert_outputs(
            jnp.asarray(layer.x),
            routing_of(weights, chosen),
            layer.gate_up[block],
            layer.down[block],
            shared=jnp.asarray(shared),
            expert_offset=offset,
            impl=impl,
        )
    want = np.einsum("tk,tkh->th", weights, loop_outputs(layer, chosen, offset, local)) + shared
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-12, rtol=1e-12)
    unweighted = loop_outputs(layer, chosen, offset, local).sum(1) + shared
    assert np.abs(unweighted - want).max() > 1e-2  # the weights matter


def test_gpu_by_size_pads_prefill_layers_and_falls_back_to_the_hopper_kernel(monkeypatch):
    """A layer of more than TRITON_MAX_ROUTED_ROWS routed rows runs PADDED_BATCHED, with the
    Hopper kernel past its buckets; a decode-sized layer runs the Triton kernel (the kernels
    stood in for by ragged_dot, recording which ran)."""
    ran = []

    def triton(rows, weights, group_sizes, *, tiling, interpret):
        ran.append("triton")
        return grouped_matmul_reference(rows, weights, group_sizes)

    def hopper(rows, weights, group_sizes, *, tiling):
        ran.append("hopper")
        return grouped_matmul_reference(rows, weights, group_sizes)

    padded = routed_experts.padded_expert_outputs

    def record_padded(x, rows, weights, capacity, *rest):
        ran.append(f"padded {capacity}")
        return padded(x, rows, weights, capacity, *rest)

    monkeypatch.setattr(grouped_matmul_ops, "expert_matmul", triton)
    monkeypatch.setattr(grouped_matmul_ops, "hopper_ragged_dot", hopper)
    monkeypatch.setattr(grouped_matmul_ops, "HOPPER_AVAILABLE", True)
    monkeypatch.setattr(routed_experts, "padded_expert_outputs", record_padded)
    rng = np.random.default_rng(0)
    gate_up = jnp.asarray(rng.standard_normal((4, 128, 2, 128)) / 11, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((4, 128, 128)) / 11, jnp.bfloat16)
    outputs = {
        impl: jax.jit(functools.partial(routed_experts.expert_outputs, impl=impl))
        for impl in (GroupedMatmulImpl.GPU_BY_SIZE, GroupedMatmulImpl.RAGGED_DOT)
    }
    for tokens in (4, TRITON_MAX_ROUTED_ROWS // 2 + 4):  # top-2: 8 and 2056 rows
        x = jnp.asarray(rng.standard_normal((tokens, 128)), jnp.bfloat16)
        chosen = np.stack([rng.permutation(4)[:2] for _ in range(tokens)]).astype(np.int32)
        routing = Routing(jnp.full((tokens, 2), 0.5), jnp.asarray(chosen))
        got = outputs[GroupedMatmulImpl.GPU_BY_SIZE](x, routing, gate_up, down)
        want = outputs[GroupedMatmulImpl.RAGGED_DOT](x, routing, gate_up, down)
        chex.assert_trees_all_close(got.astype(jnp.float32), want.astype(jnp.float32), atol=5e-2)
    # 2056 rows over 4 experts: an even share of 514, buckets of 1.25 and 1.5 times it.
    # Two grouped matmuls per path: gate | up as one, then down.
    assert ran == ["triton"] * 2 + ["padded 704", "padded 832"] + ["hopper"] * 2


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="the Hopper kernel runs on GPU only")
def test_pallas_gpu_matches_ragged_dot():  # pragma: no cover - GPU only
    """On a Hopper GPU, the Pallas kernel's outputs equal lax.ragged_dot's (bf16)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 128)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((128, 16)), jnp.bfloat16)
    gate_up = jnp.asarray(rng.standard_normal((4, 128, 2, 128)) / 11, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((4, 128, 128)) / 11, jnp.bfloat16)
    routing = moe_routing.route(x, router, top_k=4, renormalize=True)
    outs = [
        jit_expert_outputs(x, routing, gate_up, down, jnp.int32(4), impl=impl)
        for impl in (GroupedMatmulImpl.RAGGED_DOT, GroupedMatmulImpl.PALLAS_GPU)
    ]
    chex.assert_trees_all_close(*(o.astype(jnp.float32) for o in outs), atol=5e-2)


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="the Hopper kernel runs on GPU only")
@pytest.mark.parametrize("skewed", [False, True], ids=["padded", "fallback"])
def test_gpu_by_size_prefill_matches_ragged_dot(skewed):  # pragma: no cover - GPU only
    """On a Hopper GPU, GPU_BY_SIZE at prefill sizes (4096 routed rows: batched matmuls padded
    to a bucket, or past the buckets the Hopper kernel) equals lax.ragged_dot (bf16)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((512, 128)), jnp.bfloat16)
    gate_up = jnp.asarray(rng.standard_normal((16, 128, 2, 128)) / 11, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((16, 128, 128)) / 11, jnp.bfloat16)
    if skewed:  # expert 0 in every token's choices: 512 rows, past the buckets (320, 384)
        others = [1 + rng.permutation(15)[:7] for _ in range(512)]
        chosen = np.stack([np.concatenate([[0], o]) for o in others]).astype(np.int32)
    else:
        chosen = np.stack([rng.permutation(16)[:8] for _ in range(512)]).astype(np.int32)
    routing = routing_of(np.full((512, 8), 1 / 8), chosen)
    outs = [
        jit_expert_outputs(x, routing, gate_up, down, jnp.int32(0), impl=impl)
        for impl in (GroupedMatmulImpl.RAGGED_DOT, GroupedMatmulImpl.GPU_BY_SIZE)
    ]
    chex.assert_trees_all_close(*(o.astype(jnp.float32) for o in outs), atol=5e-2)
