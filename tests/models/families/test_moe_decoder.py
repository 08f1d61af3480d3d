"""Qwen3-MoE, Mixtral and Qwen2-MoE on boundaries equal Hugging Face transformers (golden files),
under TP, attention DP, expert parallelism and both dispatch modes; the sharded MoE FFN equals
the float64 reference; mutants of the MoE path are caught; the compiled collectives are held."""

import dataclasses
import functools
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
import models.decoder.moe
from boundary_jax import make_mesh
from models.build import build_model, load_model
from models.cli.plan import collective_report
from models.config import MoeConfig, read_hf_config, write_hf_config
from models.families.mixtral import MixtralForCausalLM
from models.families.qwen2_moe import Qwen2MoeForCausalLM
from models.families.qwen3_moe import Qwen3MoeForCausalLM
from models.layers.moe import experts as routed_experts
from models.layers.moe import routing as moe_routing
from models.layers.moe import sparse as moe
from models.layers.moe.ffn import SHARED_EXPERT, MoeFfn
from models.layers.moe.sparse import GroupedMatmulImpl
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM
from models.weights import load_config
from tests.models import MoeLayout, run_sharded, stage_counts

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
GATHER, ALL_TO_ALL = bj.MoeDispatch.GATHER, bj.MoeDispatch.ALL_TO_ALL
DEFER = bj.fusions.FusionProvider(defer_finalize=True)


LAYOUTS = (
    MoeLayout(1, 1),
    MoeLayout(1, 4),
    MoeLayout(2, 2, defer=True),
    MoeLayout(1, 4, ep=4),
    MoeLayout(1, 4, ep=4, dispatch=ALL_TO_ALL, defer=True),
    MoeLayout(8, 1, ep=8, dispatch=ALL_TO_ALL),
    MoeLayout(1, 4, ep=4, dispatch=ALL_TO_ALL, scattered=True),
)
# Every case below runs under -m slow. By default one: Mixtral (with sliding windows) on DP 2 x
# TP 2, all-to-all. Qwen2-MoE's shared expert runs by default scanned on TP 4 with EP 4
# (tests/models/decoder/test_scan_layers.py), input-scattered rows sent all-to-all in
# test_deepseek.py. EP with gathered rows, TP without EP, each expert's width split over
# attention TP and the deferred layouts run layer by layer below (float64 reference and
# compiled collectives).
DEFAULT_CASES = {("mixtral_sliding", MoeLayout(2, 2, ep=4, dispatch=ALL_TO_ALL))}
GOLDEN_CASES = (
    [(name, layout) for name in ("qwen3_moe", "mixtral", "qwen2_moe") for layout in LAYOUTS]
    + [
        ("mixtral_sliding", layout)
        for layout in (MoeLayout(1, 1), MoeLayout(2, 2, ep=4, dispatch=ALL_TO_ALL))
    ]
    + [  # all-to-all with each expert's width split over attention TP (moe_tp > 1)
        ("qwen2_moe", MoeLayout(2, 2, ep=2, dispatch=ALL_TO_ALL)),
        ("qwen3_moe", MoeLayout(2, 4, ep=2, dispatch=ALL_TO_ALL, defer=True)),
    ]
)
assert set(GOLDEN_CASES) >= DEFAULT_CASES
CASES = [
    pytest.param(
        name,
        layout,
        id=f"{name}-{layout}",
        marks=[pytest.mark.xdist_group(name)]
        + ([] if (name, layout) in DEFAULT_CASES else [pytest.mark.slow]),
    )
    for name, layout in GOLDEN_CASES
]


@functools.cache
def golden(name: str) -> tuple[list[list[int]], dict[str, np.ndarray]]:
    prompts = json.loads((GOLDEN / name / "prompts.json").read_text())
    return prompts, dict(np.load(GOLDEN / name / "reference.npz"))


@functools.cache
def runner(name: str, layout: MoeLayout) -> ShardedCausalLM:
    mesh = make_mesh(bj.Topology(attn_dp=layout.dp, attn_tp=layout.tp, moe_ep=layout.ep))
    model = load_model(
        GOLDEN / name,
        mesh,
        BuildOptions(
            moe_dispatch=layout.dispatch, fusions=DEFER if layout.defer else bj.fusions.NO_FUSIONS
        ),
        moe_ep=layout.ep,
    )
    return ShardedCausalLM(model, mesh, input_scattered=layout.scattered)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("name,layout", CASES)
def test_logits_and_greedy_tokens_match_transformers(name, layout):
    """float32 logits within 1e-4 (relative to the largest) of HF's, zero past each sequence's
    end, and HF's greedy tokens through the sharded KV cache."""
    prompts, reference = golden(name)
    run = runner(name, layout)
    logits = run.forward(prompts)
    assert logits.shape == reference["logits"].shape
    assert relative_error(logits, reference["logits"]) <= 1e-4
    for index, length in enumerate(reference["lengths"]):
        assert not np.any(logits[index, length:])
    tokens = run.generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens, reference["generated"])


@pytest.mark.parametrize(
    "dense,architecture", [("qwen3", "Qwen3MoeForCausalLM"), ("qwen2", "Qwen2MoeForCausalLM")]
)
def test_a_qwen_moe_config_without_experts_is_its_dense_model(dense, architecture, tmp_path):
    """transformers builds every FFN of a Qwen MoE config with `num_experts: 0` as the dense
    MLP, so the dense golden checkpoint renamed to the MoE architecture gives the dense golden's
    logits on TP 2; its config writes back as read, and the MoE options are refused."""
    shutil.copytree(GOLDEN / dense, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    moe_type = architecture.removesuffix("ForCausalLM").lower().replace("moe", "_moe")
    config = json.loads(path.read_text()) | {
        "architectures": [architecture],
        "model_type": moe_type,
        "num_experts": 0,
    }
    path.write_text(json.dumps(config))
    read = load_config(tmp_path / "ckpt")
    assert read.moe is None and read.architecture == architecture
    assert read_hf_config(write_hf_config(read)) == read
    mesh = make_mesh(bj.Topology(attn_tp=2))
    run = ShardedCausalLM(load_model(tmp_path / "ckpt", mesh), mesh)
    prompts, reference = golden(dense)
    assert relative_error(run.forward(prompts), reference["logits"]) <= 1e-4
    with pytest.raises(ValueError, match="has no experts"):
        load_model(tmp_path / "ckpt", make_mesh(bj.Topology(attn_tp=2, moe_ep=2)), moe_ep=2)


def test_model_classes_and_sparse_layers():
    """load_model picks the class by architecture; mlp_only_layers stay dense; Qwen2-MoE's
    sparse layers carry its gated shared expert and do not renormalize."""
    assert isinstance(runner("mixtral", MoeLayout(1, 1)).model, MixtralForCausalLM)
    model = runner("qwen3_moe", MoeLayout(1, 1)).model
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert [isinstance(layer.mlp, MoeFfn) for layer in model.layers] == [True, False, True]
    model = runner("qwen2_moe", MoeLayout(1, 4)).model
    assert isinstance(model, Qwen2MoeForCausalLM)
    sparse = [isinstance(layer.mlp, MoeFfn) for layer in model.layers]
    assert sparse == [True, False, True, True]
    ffn = model.layers[0].mlp
    assert not ffn.renormalize and ffn.shared_expert.expert_gate is not None
    assert model.layers[0].attn.kv_proj.bias is not None


# --------------------------------------------------------------------------------------------
# The MoE FFN alone against the float64 reference
# --------------------------------------------------------------------------------------------

HIDDEN, TOKENS = 16, 32
LAYER_MOE = MoeConfig(
    num_experts=8,
    top_k=3,
    expert_intermediate_size=8,
    renormalize=False,
    shared_expert_intermediate_size=12,  # split over TP 4; whole (first rank only) over 8
    shared_expert_gate=True,
)
LAYER_MESHES = (  # (dp, tp, moe_ep, dispatch)
    (1, 1, 1, GATHER),
    (1, 4, 4, GATHER),
    (2, 2, 2, GATHER),
    (2, 4, 2, GATHER),
    (1, 8, 8, GATHER),
    (1, 4, 4, ALL_TO_ALL),
    (2, 4, 8, ALL_TO_ALL),
    (2, 4, 2, ALL_TO_ALL),  # experts over attention DP, their width over attention TP 4
    (2, 2, 2, ALL_TO_ALL),
)


def layer_case(
    dp, tp, ep, dispatch, *, capacity=None, impl=GroupedMatmulImpl.RAGGED_DOT
) -> tuple[MoeFfn, jax.sharding.Mesh]:
    topology = bj.Topology(attn_dp=dp, attn_tp=tp, moe_ep=ep)
    module = MoeFfn(
        HIDDEN,
        LAYER_MOE,
        topology,
        dispatch=dispatch,
        capacity=capacity,
        impl=impl,
        rngs=nnx.Rngs(5),
    )
    return module, make_mesh(topology)


def run_layer(module: MoeFfn, mesh, x: jax.Array, *, defer: bool, counts=None) -> np.ndarray:
    """The layer's output on every token, completed as its boundary would: gathered rows summed
    over the MoE output group, own rows concatenated; a deferred finalize completed first; its
    replicated parts counted as its stage boundary counts them, or as `counts` says."""
    topology = module.topology
    own = module.dispatch is ALL_TO_ALL
    rows = P(topology.shard_entry(bj.SumGroup.FULL_TP)) if own else P()

    def body(module, x):
        out = module(x, defer=defer, counts=counts or stage_counts(module))
        if defer:
            out = out.complete()
        if own:
            return out
        names = topology.group_names(bj.SumGroup.MOE_OUTPUT)
        return jax.lax.psum(out, names) if names else out

    return np.asarray(run_sharded(module, mesh, body, (x,), (rows,), rows))


def layer_reference(module: MoeFfn, x: np.ndarray) -> np.ndarray:
    shared = module.shared_expert
    return moe.moe_reference(
        x,
        np.asarray(module.router[...]),
        np.asarray(module.gate_up_proj[...]),
        np.asarray(module.down_proj[...]),
        top_k=LAYER_MOE.top_k,
        renormalize=LAYER_MOE.renormalize,
        shared=(np.asarray(shared.gate_up_proj[...]), np.asarray(shared.down_proj[...])),
        shared_gate=np.asarray(shared.expert_gate[...]),
    )


TOKENS_IN = jax.random.normal(jax.random.key(2), (TOKENS, HIDDEN), jnp.float32)


# Each mesh runs finalized and deferred under -m slow; by default each runs one of the two, in
# turn down LAYER_MESHES (deferred on the even rows), so both dispatches run both finalizes.
LAYER_CASES = [
    pytest.param(
        dp,
        tp,
        ep,
        dispatch,
        defer,
        id=f"{dp}-{tp}-{ep}-{dispatch}-{'deferred' if defer else 'finalized'}",
        marks=[] if defer == (index % 2 == 0) else [pytest.mark.slow],
    )
    for index, (dp, tp, ep, dispatch) in enumerate(LAYER_MESHES)
    for defer in (False, True)
]


@pytest.mark.parametrize("dp,tp,ep,dispatch,defer", LAYER_CASES)
def test_moe_ffn_matches_float64_reference(dp, tp, ep, dispatch, defer):
    """Experts over EP, width over moe_tp, tokens gathered or sent all-to-all: the completed
    output equals the float64 layer (each expert and each rank's shard has its own weights)."""
    module, mesh = layer_case(dp, tp, ep, dispatch)
    want = layer_reference(module, np.asarray(TOKENS_IN))
    got = run_layer(module, mesh, TOKENS_IN, defer=defer)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


EVERY_EP = [  # every divisor of the full TP group on each 8-device mesh, not in LAYER_MESHES
    (dp, tp, ep, dispatch)
    for dp, tp in ((1, 8), (2, 4), (4, 2))
    for ep in (1, 2, 4, 8)
    for dispatch in (GATHER, ALL_TO_ALL)
    if (dp, tp, ep, dispatch) not in LAYER_MESHES
]
# By default one dispatch for each size on each mesh (every size that splits a mesh axis among
# them: 2 and 4 on TP 8, 4 on DP 2 x TP 4, 2 and 4 on DP 4 x TP 2), the other under -m slow.
DEFAULT_EVERY_EP = {
    (1, 8, 1, GATHER),
    (1, 8, 2, ALL_TO_ALL),
    (1, 8, 4, GATHER),
    (1, 8, 8, ALL_TO_ALL),
    (2, 4, 1, ALL_TO_ALL),
    (2, 4, 4, ALL_TO_ALL),
    (2, 4, 8, GATHER),
    (4, 2, 2, GATHER),
    (4, 2, 4, ALL_TO_ALL),
    (4, 2, 8, GATHER),
}
assert set(EVERY_EP) >= DEFAULT_EVERY_EP


@pytest.mark.parametrize(
    "dp,tp,ep,dispatch",
    [
        pytest.param(*case, marks=[] if case in DEFAULT_EVERY_EP else [pytest.mark.slow])
        for case in EVERY_EP
    ],
)
def test_every_expert_parallel_size_matches_float64_reference(dp, tp, ep, dispatch):
    """Any moe_ep dividing the full TP group, also one that splits a mesh axis into an
    expert-parallel part and a width part (moe_ep 2 or 4 on TP 8, 4 on DP 2 x TP 4, 2 on DP 4 x
    TP 2): the completed output equals the float64 layer."""
    module, mesh = layer_case(dp, tp, ep, dispatch)
    want = layer_reference(module, np.asarray(TOKENS_IN))
    got = run_layer(module, mesh, TOKENS_IN, defer=False)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


@pytest.mark.parametrize(  # gather, and all-to-all with the width split (moe_tp 2), by default
    "dp,tp,ep,dispatch",
    [
        (1, 4, 4, GATHER),
        pytest.param(2, 2, 2, GATHER, marks=pytest.mark.slow),
        (2, 4, 2, ALL_TO_ALL),
        pytest.param(2, 4, 8, ALL_TO_ALL, marks=pytest.mark.slow),
    ],
)
def test_padded_batched_experts_match_float64_reference(monkeypatch, dp, tp, ep, dispatch):
    """PADDED_BATCHED inside the layer: every dispatch sizes the buckets by the even share of
    the whole layer (32 tokens x top-3 over 8 experts: 12 rows each expert sees), they hold
    every expert's rows (the grouped fallback is poisoned), and the output equals float64."""
    real_grouped, real_buckets = (
        routed_experts.grouped_expert_outputs,
        routed_experts.capacity_buckets,
    )
    shares = []

    def buckets(share, rows):
        shares.append(share)
        return real_buckets(share, rows)

    monkeypatch.setattr(routed_experts, "capacity_buckets", buckets)
    monkeypatch.setattr(
        routed_experts,
        "grouped_expert_outputs",
        lambda *args: jnp.full_like(real_grouped(*args), jnp.nan),
    )
    module, mesh = layer_case(dp, tp, ep, dispatch, impl=GroupedMatmulImpl.PADDED_BATCHED)
    want = layer_reference(module, np.asarray(TOKENS_IN))
    got = run_layer(module, mesh, TOKENS_IN, defer=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))
    assert shares and set(shares) == {TOKENS * LAYER_MOE.top_k / LAYER_MOE.num_experts}


def test_moe_ffn_spreads_experts_over_ranks():
    """Each EP rank holds its own block of experts; routing is not trivial (every rank's
    experts are chosen, by tokens on different ranks)."""
    module, _ = layer_case(2, 4, 8, ALL_TO_ALL)
    assert nnx.get_partition_spec(nnx.state(module)).gate_up_proj.get_value() == P(
        ("attn_dp", "attn_tp"), None, None, None
    )
    routing = moe_routing.route(TOKENS_IN, module.router[...], top_k=3, renormalize=False)
    chosen = np.asarray(routing.experts)  # 8 experts over 8 ranks: expert e lives on rank e
    per_rank = [set(chosen[rank * 4 : rank * 4 + 4].ravel()) for rank in range(8)]
    assert set().union(*per_rank) == set(range(8))
    assert len({frozenset(s) for s in per_rank}) > 1


def mutant_error(module, mesh, *, defer=False, counts=None) -> float:
    want = layer_reference(module, np.asarray(TOKENS_IN))
    return relative_error(run_layer(module, mesh, TOKENS_IN, defer=defer, counts=counts), want)


def test_mutant_shared_expert_added_on_every_rank_is_caught():
    """A shared expert whole on every rank, added on every rank, is counted tp times."""
    module, mesh = layer_case(1, 8, 8, GATHER)
    assert [part.name for part in module.replicated] == [SHARED_EXPERT]
    assert mutant_error(module, mesh) < 1e-5
    assert mutant_error(module, mesh, counts=lambda name: True) > 1e-2


def test_mutant_renormalized_router_is_caught():
    """Qwen2-MoE keeps the softmax probabilities of its top-k: renormalizing them is caught."""
    module, mesh = layer_case(2, 4, 8, ALL_TO_ALL)
    module.renormalize = True
    assert mutant_error(module, mesh) > 1e-2


def test_mutant_split_shared_expert_counted_on_one_rank_is_caught():
    """A shared expert split over TP owes the sum of every rank's share: declaring it
    replicated (so only the first rank adds its share) is caught."""
    module, mesh = layer_case(1, 4, 4, GATHER)
    assert module.shared_expert.gate_up_proj.shape == (HIDDEN, 2, 12)
    assert module.replicated == ()  # split: every rank adds its share
    module.replicated = (bj.declare.Replicated(SHARED_EXPERT),)
    assert mutant_error(module, mesh) > 1e-2


@pytest.mark.slow
def test_whole_shared_expert_counted_once_in_a_model(monkeypatch):
    """A Qwen2-MoE whose shared expert (width 12) does not split over TP 8 keeps it whole on
    every rank, declares it replicated and adds it on one: equal to one device; added on every
    rank, it is not."""
    config = load_config(GOLDEN / "qwen2_moe")
    moe_config = dataclasses.replace(
        config.moe, shared_expert_intermediate_size=12, mlp_only_layers=()
    )
    config = dataclasses.replace(config, num_layers=2, moe=moe_config)
    prompts, _ = golden("qwen2_moe")
    single = bj.Topology()
    want = ShardedCausalLM(build_model(config, single), make_mesh(single)).forward(prompts)
    topology = bj.Topology(attn_tp=8, moe_ep=8)
    model = build_model(config, topology)
    plan = model.layers[0].ffn_boundary.plan
    assert [(part.name, part.ranks) for part in plan.counted_once] == [
        (SHARED_EXPERT, ("attn_tp",))
    ]
    honest = ShardedCausalLM(model, make_mesh(topology)).forward(prompts)
    monkeypatch.setattr(bj.ops, "is_first_rank", lambda ranks: True)
    every_rank = ShardedCausalLM(build_model(config, topology), make_mesh(topology))
    errors = [relative_error(honest, want), relative_error(every_rank.forward(prompts), want)]
    assert errors[0] <= 1e-5 and errors[1] > 1e-2


@pytest.mark.parametrize("mutant", ["skipped", "doubled"])
def test_mutant_finalize_skipped_or_doubled_is_caught(monkeypatch, mutant):
    """A finalize that ignores the routing weights, or adds twice, changes the output."""
    complete = bj.DeferredFinalize.complete
    broken = {
        "skipped": lambda self: jnp.sum(self.expert_outputs, axis=1),
        "doubled": lambda self: 2 * complete(self),
    }[mutant]
    monkeypatch.setattr(bj.DeferredFinalize, "complete", broken)
    module, mesh = layer_case(2, 4, 2, GATHER)
    assert mutant_error(module, mesh, defer=True) > 1e-2


def test_mutant_token_sent_to_the_wrong_rank_is_caught(monkeypatch):
    """Rows dispatched one EP rank off reach the wrong experts."""
    dispatch = bj.ops.dispatch_to_experts

    def off_by_one(rows, tags, destination, topology, **options):
        return dispatch(rows, tags, (destination + 1) % topology.moe_ep, topology, **options)

    monkeypatch.setattr(bj.ops, "dispatch_to_experts", off_by_one)
    module, mesh = layer_case(1, 4, 4, ALL_TO_ALL)
    assert mutant_error(module, mesh) > 1e-2


def test_mutant_moe_sum_missing_is_caught(monkeypatch):
    """A sparse FFN declared complete (no MoE output sum) gives logits far from HF's."""
    honest = models.decoder.moe.moe_stage_facts

    def no_sum(config, topology, dispatch, layer_index, *designs):
        attn, ffn = honest(config, topology, dispatch, layer_index, *designs)
        if ffn.sparse:
            ffn = bj.declare_ffn(sparse=True, output_complete=True)
        return attn, ffn

    monkeypatch.setattr(models.decoder.moe, "moe_stage_facts", no_sum)
    prompts, reference = golden("mixtral")
    mesh = make_mesh(bj.Topology(attn_tp=4))
    run = ShardedCausalLM(load_model(GOLDEN / "mixtral", mesh, moe_ep=4), mesh)
    assert relative_error(run.forward(prompts), reference["logits"]) > 1e-2


# --------------------------------------------------------------------------------------------
# Collectives of a middle sparse layer (docs/collectives.md, "MoE decoders")
# --------------------------------------------------------------------------------------------

TABLE = pathlib.Path(__file__).parents[3] / "docs" / "collectives.md"
KINDS = {"AR": "all-reduce", "RS": "reduce-scatter", "AG": "all-gather", "A2A": "all-to-all"}


def _documented_moe_rows() -> dict[MoeLayout, tuple[str, ...]]:
    """The "MoE decoders" table of docs/collectives.md: layout -> the middle layer's kinds."""
    text = TABLE.read_text().split("## MoE decoders", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        layout = MoeLayout(
            int(cells["dp"]),
            int(cells["tp"]),
            ep=int(cells["ep"]),
            dispatch=bj.MoeDispatch(cells["dispatch"]),
            scattered=cells["batch"] == "input-scattered",
            defer=cells["finalize"] == "deferred",
        )
        rows[layout] = tuple(KINDS[kind] for kind in cells["middle sparse layer"].split())
    return rows


MIDDLE_SPARSE_LAYER = _documented_moe_rows()
# Every row under -m slow; by default one row of each dispatch: gathered rows on DP 2 x TP 2
# with a deferred finalize, all-to-all from input-scattered rows on TP 4.
DEFAULT_MIDDLE_SPARSE = {
    MoeLayout(2, 2, ep=4, defer=True),
    MoeLayout(1, 4, ep=4, dispatch=ALL_TO_ALL, scattered=True),
}
assert set(MIDDLE_SPARSE_LAYER) >= DEFAULT_MIDDLE_SPARSE


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(layout, marks=[] if layout in DEFAULT_MIDDLE_SPARSE else [pytest.mark.slow])
        for layout in MIDDLE_SPARSE_LAYER
    ],
    ids=str,
)
def test_middle_sparse_layer_collectives(layout):
    """A middle layer of a 4-layer Mixtral runs exactly the collectives docs/collectives.md
    documents for it (gather and all-to-all, finalize deferred or not), each all-to-all over the
    expert-parallel ranks (also where they are part of a mesh axis)."""
    assert len(MIDDLE_SPARSE_LAYER) >= 10
    config = dataclasses.replace(load_config(GOLDEN / "mixtral"), num_layers=4)
    topology = bj.Topology(attn_dp=layout.dp, attn_tp=layout.tp, moe_ep=layout.ep)
    model = build_model(
        config,
        topology,
        BuildOptions(
            moe_dispatch=layout.dispatch, fusions=DEFER if layout.defer else bj.fusions.NO_FUSIONS
        ),
    )
    run = ShardedCausalLM(model, make_mesh(topology), input_scattered=layout.scattered)
    report = collective_report(run)
    assert report.sequence(1) == MIDDLE_SPARSE_LAYER[layout]
    exchanges = [c for c in report.collectives if c.layer == 1 and c.kind == "all-to-all"]
    assert all(c.group_size == layout.ep for c in exchanges)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def test_ep_size_must_divide_the_tp_group():
    with pytest.raises(ValueError, match=r"TP group .* got moe_ep=3\. Choose moe_ep among"):
        bj.Topology(attn_tp=4, moe_ep=3)


def test_mesh_without_the_expert_parallel_axes_is_rejected():
    """moe_ep 2 on attention TP 4 needs the mesh make_mesh builds (attn_tp_ep x attn_tp): a mesh
    of one attn_tp axis is rejected where a model meets it, naming the fix."""
    mesh = make_mesh(bj.Topology(attn_tp=4))
    with pytest.raises(ValueError, match=r"make_mesh\(topology\)"):
        load_model(GOLDEN / "mixtral", mesh, moe_ep=2)


def test_ep_size_must_divide_the_experts():
    topology = bj.Topology(attn_dp=2, attn_tp=3, moe_ep=6)
    with pytest.raises(ValueError, match="number of experts; got moe_ep=6 for num_experts="):
        MoeFfn(HIDDEN, LAYER_MOE, topology, rngs=nnx.Rngs(0))


def test_capacity_that_could_drop_tokens_is_rejected():
    module, mesh = layer_case(1, 4, 4, ALL_TO_ALL, capacity=5)
    with pytest.raises(ValueError, match="could drop tokens"):
        run_layer(module, mesh, TOKENS_IN, defer=False)


def test_dense_checkpoint_takes_no_moe_options():
    mesh = make_mesh(bj.Topology(attn_tp=4))
    with pytest.raises(ValueError, match="has no experts"):
        load_model(GOLDEN / "qwen3", mesh, moe_ep=4)


@pytest.mark.parametrize(
    "change",
    [
        {"scoring_func": "sigmoid"},
        {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
        {"routed_scaling_factor": 2.5},
    ],
    ids=["sigmoid", "grouped", "scaled"],
)
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_unsupported_router_is_rejected(name, change):
    config = json.loads((GOLDEN / name / "config.json").read_text())
    with pytest.raises(ValueError, match="unsupported router"):
        read_hf_config(config | change)
    plain = {"topk_method": "greedy", "n_group": 1, "routed_scaling_factor": 1.0}
    assert read_hf_config(config | plain) == read_hf_config(config)
