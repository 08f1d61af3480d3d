"""Scanned decoder layers (`build_model(..., scan_layers=True)`): each run of identical layers
between the stack entry and the terminal layer is one `bj.StackedLayers`, its parameters
stacked at build and run by one `lax.scan`. Against the unrolled model with the same weights on
one device: the same logits, greedy tokens through the KV caches, loss, gradients and updated
parameters (the scanned trainer recomputes each layer: `Remat.FULL`), on every layout, for an
MoE model whose dense layer splits its runs and Gemma 3 whose sliding and global layers split
theirs (a dense model, whose layers bind as theirs do, on two layouts); one while loop per run
in the compiled forward, the same collectives per layer; a scanned checkpoint round trip, each
device reading only its shard of each layer."""

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import boundary_jax as bj
from boundary_jax.report import parse_hlo
from models import weights as checkpoint
from models.build import abstract_model, build_model, load_model
from models.cli.plan import PLAN_SEQUENCES, plan_report
from models.config import PRESETS, DecoderConfig, hf_name_map, read_hf_config
from models.options import BuildOptions, Remat
from models.serving.runtime import ShardedCausalLM
from models.training.trainer import TrainConfig, Trainer
from models.weights import load as checkpoint_load
from models.weights import save_checkpoint
from tests.models import randomize_norms

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
SLOW = pytest.mark.slow


def _gemma3() -> DecoderConfig:
    """The Gemma 3 golden's architecture with 7 layers: sliding, sliding, sliding, global,
    global, sliding, sliding (scanned runs [1, 3), [3, 5), [5, 6))."""
    raw = json.loads((GOLDEN / "gemma3" / "config.json").read_text())
    kinds = ["sliding_attention"] * 3 + ["full_attention"] * 2 + ["sliding_attention"] * 2
    return read_hf_config(raw | {"num_hidden_layers": 7, "layer_types": kinds})


CONFIGS = {
    # runs: [1, 4)
    "dense": dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=5),
    # layer 3 dense among sparse ones; runs: [1, 3), [3, 4), [4, 5) (after the dense FFN),
    # [5, 7)
    "moe": dataclasses.replace(
        PRESETS["tiny-qwen3-moe"],
        num_layers=8,
        moe=dataclasses.replace(PRESETS["tiny-qwen3-moe"].moe, mlp_only_layers=(3,)),
    ),
    "gemma3": _gemma3(),
}
RUNS = {
    "dense": (range(1, 4),),
    "moe": (range(1, 3), range(3, 4), range(4, 5), range(5, 7)),
    "gemma3": (range(1, 3), range(3, 5), range(5, 6)),
}
# (attn_dp, attn_tp, input-scattered)
LAYOUTS = {
    "TP1": (1, 1, False),
    "TP4": (1, 4, False),
    "DP2xTP2": (2, 2, False),
    "TP4-scattered": (1, 4, True),
}
REFERENCE = "TP1"
"""The layout of the unrolled model that every scanned layout is compared with: one device, no
collectives, computed once per model instead of once per layout. This is no weaker than an
unrolled reference on the scanned model's own mesh: a scanned layout that computes anything
else differs from it (the layouts' rounding differs by about 1e-6, a tenth of the tolerance),
and it cannot agree by sharing a wrong collective with an unrolled model on its mesh."""
# Each case compiles four scanned programs (forward, prefill, decode, train step); each model's
# unrolled reference compiles four more, once. By default the dense model runs on TP4-scattered,
# the layout its round-trip and while-loop tests below share (so its scanned and reference
# programs compile once for all three); the MoE model's runs are covered by default by the
# Qwen2-MoE golden parity, Gemma 3's split into runs by test_runs_split_where_layers_differ;
# their full layout matrices and the MoE while-loop test are slow.
FAST = {("dense", "TP4-scattered")}
# The dense model runs on TP4 and TP4-scattered. On every layout its layers bind exactly the
# stage paths that Gemma 3's scanned runs [1, 3) and [3, 5) bind (dense-FFN layers, scanned two
# at a time) and the MoE model's layers 3 and 4 bind (the same Qwen3 attention and SwiGLU
# classes), so gemma3-* and moe-* run its scanned paths on TP1 and DP2xTP2 under -m slow.
DENSE_LAYOUTS = ("TP4", "TP4-scattered")
DEFAULT_DENSE = "TP4-scattered"
SCAN_GROUP = pytest.mark.xdist_group("scan")
"""On the tests that share the cached references, runners and trainers below: one xdist worker
(`--dist loadgroup`) runs them all, so none is built twice."""
CASES = [
    pytest.param(
        name,
        layout,
        id=f"{name}-{layout}",
        marks=[SCAN_GROUP] + ([] if (name, layout) in FAST else [SLOW]),
    )
    for name in CONFIGS
    for layout in LAYOUTS
    if name != "dense" or layout in DENSE_LAYOUTS
]
RNG = np.random.default_rng(11)
PROMPTS = [[int(t) for t in RNG.integers(0, 250, n)] for n in (9, 3, 12, 6)]
NEW_TOKENS = 4
OPTIMIZER = TrainConfig(learning_rate=1e-2, total_steps=10, warmup_steps=0, eps=1e-3)


def by_tensor(
    config: DecoderConfig, params: dict, *, scan_layers: bool, drop_padding: bool = False
) -> dict:
    """`{checkpoint tensor pattern: numpy value}` of flat parameters, a scanned run's split per
    layer: the one naming both kinds of model share. `drop_padding` drops the vocab padding
    (rows no token id reaches, as `save_checkpoint` does), which depends on the attention TP."""
    out = {}
    for path, source in hf_name_map(config, scan_layers=scan_layers).items():
        value = np.asarray(jax.device_get(params[path]))
        if drop_padding and source.padded_axis is not None:
            value = np.take(value, np.arange(config.vocab_size), axis=source.padded_axis)
        values = [value] if source.layers is None else list(value)
        for part, part_value in zip(source.layer_parts(), values, strict=True):
            out[part.name] = part_value
    return out


def flat_params(model: nnx.Module) -> dict:
    return {
        ".".join(str(p) for p in path): variable.get_value()
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def scanned_twin(unrolled: nnx.Module, config: DecoderConfig, topology: bj.Topology, **options):
    """A model built with `scan_layers` holding `unrolled`'s weights (its runs stacked)."""
    scanned = build_model(config, topology, BuildOptions(scan_layers=True, **options))
    values = by_tensor(config, flat_params(unrolled), scan_layers=False)
    state = nnx.state(scanned, nnx.Param)
    sources = hf_name_map(config, scan_layers=True)
    updated = []
    for path, variable in nnx.to_flat_state(state):
        source = sources[".".join(str(p) for p in path)]
        parts = [values[part.name] for part in source.layer_parts()]
        value = parts[0] if source.layers is None else np.stack(parts)
        assert value.shape == variable.shape, path
        updated.append((path, variable.replace(value=jnp.asarray(value, variable.dtype))))
    nnx.update(scanned, nnx.from_flat_state(updated))
    return scanned


def worst_relative(got: dict, want: dict) -> tuple[str, float]:
    assert got.keys() == want.keys()
    errors = {
        name: float(np.max(np.abs(got[name] - want[name])) / max(np.max(np.abs(want[name])), 1e-30))
        for name in want
    }
    return max(errors.items(), key=lambda item: item[1])


def topology_and_mesh(layout: str) -> tuple[bj.Topology, jax.sharding.Mesh]:
    dp, tp, _ = LAYOUTS[layout]
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    return topology, bj.make_mesh(topology)


def fresh_model(name: str, layout: str, scan: bool) -> nnx.Module:
    """A fresh model `name` for `layout` (every build has the same weights, norms random),
    unrolled or scanned."""
    config = CONFIGS[name]
    topology, _ = topology_and_mesh(layout)
    unrolled = build_model(config, topology)
    randomize_norms(unrolled, seed=3)
    if not scan:
        return unrolled
    return scanned_twin(unrolled, config, topology, remat=Remat.FULL)


@functools.cache
def runner(name: str, layout: str, scan: bool) -> ShardedCausalLM:
    """The serving runner of model `name` on `layout`, unrolled or scanned."""
    _, mesh = topology_and_mesh(layout)
    return ShardedCausalLM(
        fresh_model(name, layout, scan), mesh, input_scattered=LAYOUTS[layout][2]
    )


@functools.cache
def served(name: str, layout: str, scan: bool) -> dict:
    """Logits and greedy tokens of model `name` on `layout`, unrolled or scanned."""
    serving = runner(name, layout, scan)
    return {"logits": serving.forward(PROMPTS), "tokens": serving.generate(PROMPTS, NEW_TOKENS)}


@functools.cache
def trained(name: str, layout: str, scan: bool) -> dict:
    """One train step's results of model `name` on `layout`, unrolled or scanned: the trainer
    has its own model (its step donates its buffers)."""
    _, mesh = topology_and_mesh(layout)
    trainer = Trainer(
        fresh_model(name, layout, scan),
        mesh,
        OPTIMIZER.optimizer(),
        input_scattered=LAYOUTS[layout][2],
    )
    metrics = trainer.step(trainer.pack(PROMPTS))
    params = by_tensor(CONFIGS[name], trainer.state.params, scan_layers=scan, drop_padding=True)
    return {"metrics": metrics, "params": params, "trainer": trainer}


@pytest.mark.parametrize("name,layout", CASES)
def test_scanned_equals_unrolled(name, layout):
    """Against the unrolled model on one device (`REFERENCE`): logits within 1e-5 of the
    largest, the same greedy tokens through the stacked KV caches, and after one AdamW step the
    same loss, gradient norm (1e-5 relative) and parameters (2e-5 relative: Adam's first step
    divides by the gradients' magnitudes, which float32 reorderings move; the vocab padding,
    which depends on the layout, dropped)."""
    got, want = served(name, layout, True), served(name, REFERENCE, False)
    scale = np.max(np.abs(want["logits"]))
    assert np.max(np.abs(got["logits"] - want["logits"])) <= 1e-5 * scale
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    got, want = trained(name, layout, True), trained(name, REFERENCE, False)
    assert got["metrics"]["loss"] == pytest.approx(want["metrics"]["loss"], rel=1e-5)
    assert got["metrics"]["grad_norm"] == pytest.approx(want["metrics"]["grad_norm"], rel=1e-5)
    tensor, error = worst_relative(got["params"], want["params"])
    assert error < 2e-5, (tensor, error)


def test_runs_split_where_layers_differ():
    """The scanned models hold the stack entry and the terminal layer alone and each run of one
    structure as a `StackedLayers` whose parameters carry a leading layer axis, unsplit."""
    for name, config in CONFIGS.items():
        model = abstract_model(config, bj.Topology(attn_tp=4), BuildOptions(scan_layers=True))
        runs = [block for block in model.layers if isinstance(block, bj.StackedLayers)]
        assert [run.indices for run in runs] == list(RUNS[name]), name
        for run in runs:
            kernel = run.layer.attn.q_proj.kernel
            assert kernel.shape[0] == len(run)
            assert kernel.get_metadata()["out_sharding"][0] is None
    moe = abstract_model(CONFIGS["moe"], bj.Topology(), BuildOptions(scan_layers=True))
    ffns = [type(block.layer.mlp).__name__ for block in moe.layers[1:-1]]
    assert ffns == ["MoeFfn", "SwiGLU", "MoeFfn", "MoeFfn"]


@SCAN_GROUP
@pytest.mark.parametrize(
    "name,layout", [("dense", DEFAULT_DENSE), pytest.param("moe", "DP2xTP2", marks=SLOW)]
)
def test_one_while_loop_per_run_and_the_same_collectives_per_layer(name, layout):
    """The scanned forward compiles one more while loop per run of two layers or more than the
    unrolled one (the layers really scan; XLA inlines a loop of one trip), and the plan
    report's collectives of every layer (a run's scan body counted once per layer) and outside
    the layers equal the unrolled model's."""
    scanned, unrolled = (runner(name, layout, scan) for scan in (True, False))
    texts = [r.lower_forward(PLAN_SEQUENCES).compile().as_text() for r in (scanned, unrolled)]
    loops = sum(len(run) > 1 for run in RUNS[name])
    assert texts[0].count(" while(") - texts[1].count(" while(") == loops
    report = plan_report(scanned)
    want = parse_hlo(texts[1])
    assert report["scan_layers"]
    layers = CONFIGS[name].num_layers
    assert [entry["layer"] for entry in report["collectives_by_layer"]] == list(range(layers))
    for entry in report["collectives_by_layer"]:
        assert entry["sequence"] == list(want.sequence(entry["layer"])), entry["layer"]
        assert entry["bytes"] == want.bytes(entry["layer"]), entry["layer"]
        assert entry["sequence"], entry["layer"]
    assert report["collectives_outside_layers"] == list(want.sequence(None))


@SCAN_GROUP
@pytest.mark.parametrize(
    "name,layout",
    [pytest.param("dense", DEFAULT_DENSE, marks=SLOW), pytest.param("moe", "DP2xTP2", marks=SLOW)],
)
def test_trained_scanned_model_round_trips_through_a_checkpoint(
    tmp_path, monkeypatch, name, layout
):
    """A trained scanned model saves the unrolled model's Hugging Face tensors; loaded back
    scanned, every device reads only its block of each layer's tensor, and the forward equals
    the unrolled load's. (The unrolled model was trained on `REFERENCE`: the checkpoint holds
    global tensors.)"""
    config = CONFIGS[name]
    trainers = {True: trained(name, layout, True)["trainer"]}
    trainers[False] = trained(name, REFERENCE, False)["trainer"]
    for scan, trainer in trainers.items():
        save_checkpoint(config, trainer.state.params, tmp_path / str(scan), scan_layers=scan)
    saved = {
        scan: load_file(str(tmp_path / str(scan) / checkpoint.SINGLE_FILE)) for scan in trainers
    }
    tensor, error = worst_relative(saved[True], saved[False])
    assert error < 1e-5, (tensor, error)

    reads = []
    original = checkpoint_load._Checkpoint.read

    def recording_read(self, tensor_name, index):
        block = original(self, tensor_name, index)
        reads.append((tensor_name, block.size))
        return block

    monkeypatch.setattr(checkpoint_load._Checkpoint, "read", recording_read)
    dp, tp, scattered = LAYOUTS[layout]
    mesh = bj.make_mesh(bj.Topology(attn_dp=dp, attn_tp=tp))
    loaded = load_model(tmp_path / "True", mesh, BuildOptions(scan_layers=True))
    monkeypatch.undo()
    for layer in RUNS[name][0]:
        q = f"model.layers.{layer}.self_attn.q_proj.weight"
        # one read per device, of its attention-TP block
        assert [size for n, size in reads if n == q] == [saved[True][q].size // tp] * (dp * tp)
    scanned = ShardedCausalLM(loaded, mesh, input_scattered=scattered).forward(PROMPTS)
    unrolled = ShardedCausalLM(load_model(tmp_path / "True", mesh), mesh).forward(PROMPTS)
    assert np.max(np.abs(scanned - unrolled)) <= 1e-5 * np.max(np.abs(unrolled))


@pytest.mark.parametrize("name", ["qwen2_moe", pytest.param("gemma3", marks=SLOW)])
def test_golden_parity_with_scanned_layers(name):
    """Loaded scanned, the logits equal transformers' within 1e-4 and the greedy tokens are
    transformers'. Qwen2-MoE (sparse, dense, sparse, sparse) on TP 4 with EP 4 and a fusion
    provider deferring each sparse FFN's finalize to the next input: its dense layer 1 and
    sparse layer 2 are separate runs, and each run's first layer takes the carry in another
    form than it hands on, so it runs from its slice before the scan. Gemma 3 on DP 2 x TP 2:
    its global layer 1 (under -m slow: its split into runs is checked by
    test_runs_split_where_layers_differ). (Dense goldens scan in
    tests/models/decoder/test_captures.py, OLMo 2 in test_norm_decoders.py.)"""
    prompts = json.loads((GOLDEN / name / "prompts.json").read_text())
    reference = np.load(GOLDEN / name / "reference.npz")
    if name == "qwen2_moe":
        mesh = bj.make_mesh(bj.Topology(attn_tp=4, moe_ep=4))
        defer = bj.fusions.FusionProvider(defer_finalize=True)
        model = load_model(
            GOLDEN / name, mesh, BuildOptions(fusions=defer, scan_layers=True), moe_ep=4
        )
    else:
        mesh = bj.make_mesh(bj.Topology(attn_dp=2, attn_tp=2))
        model = load_model(GOLDEN / name, mesh, BuildOptions(scan_layers=True))
    assert any(isinstance(block, bj.StackedLayers) for block in model.layers)
    runner = ShardedCausalLM(model, mesh)
    logits = runner.forward(prompts)
    want = reference["logits"]
    assert np.max(np.abs(logits - want)) <= 1e-4 * np.max(np.abs(want))
    generated = reference["generated"]
    np.testing.assert_array_equal(runner.generate(prompts, generated.shape[1]), generated)


def test_stacking_rejects_layers_of_different_structure():
    """A dense and a sparse layer cannot share one run."""
    model = build_model(CONFIGS["moe"], bj.Topology())
    with pytest.raises(ValueError, match="layer 3 differs from layer 2"):
        bj.StackedLayers(list(model.layers)[2:4], start=2)
