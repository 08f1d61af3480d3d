"""The pipeline runtime on simulated CPU meshes: every family split into 2, 3 and 4 stages equals
the one-program model; generation, training, the plan report, the command line and bad input."""

import dataclasses
import functools
import io
import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx
from rich.console import Console

import boundary_jax as bj
from models.build import build_model
from models.cli.main import main
from models.cli.plan import print_pipeline_plan
from models.config import PRESETS, read_hf_config
from models.layers.hyper_connections import HyperConnections
from models.options import BuildOptions
from models.pipeline import (
    PipelineCausalLM,
    PipelineSplit,
    PipelineTrainer,
    bubble,
    build_pipeline,
    gpipe_ticks,
    pipeline_split,
    transport,
)
from models.pipeline.report import pipeline_plan_report
from models.serving.runtime import ShardedCausalLM
from models.serving.sampling import Sampling
from models.training.trainer import FlatParams, TrainConfig, Trainer
from models.weights import save_checkpoint

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
PROMPTS = [[5, 7, 9, 11, 2, 30], [3], [8, 8, 1, 4, 6, 2, 9, 40, 41], [17, 4, 99]]
TP = 2  # every stage runs attention TP 2, so pp=4 fills the 8 simulated devices


def _hf(name: str, layer_types: list[str]):
    """A golden checkpoint's config, grown to four layers."""
    config = json.loads((GOLDEN / name / "config.json").read_text())
    return read_hf_config({**config, "num_hidden_layers": 4, "layer_types": layer_types})


# (config, build options): dense (tied embeddings), MoE with expert parallelism and its FFNs on
# their own rows (a dense layer among sparse ones), post-norm, sandwich-norm, MHC.
FAMILIES = {
    "dense": (PRESETS["tiny-qwen3"], {}),
    "moe-ep": (
        PRESETS["tiny-qwen3-moe"],
        {"moe_dispatch": bj.MoeDispatch.ALL_TO_ALL, "moe_ep": 2},
    ),
    "post-norm": (
        _hf(
            "exaone4",
            ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        ),
        {},
    ),
    "sandwich-norm": (
        _hf(
            "gemma3",
            ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        ),
        {},
    ),
    "mhc": (PRESETS["tiny-qwen3"], {"hyper_connections": HyperConnections(sinkhorn_iters=3)}),
}
# pp: (layers per stage, microbatches, input-scattered). One microbatch of an ordinary batch runs
# the one-program model's operations on its rows, so its logits are bit-identical; two
# microbatches change the row blocks, input-scattered batches the collectives.
SPLITS = {2: ((2, 2), 2, False), 3: ((1, 1, 2), 1, False), 4: ((1, 1, 1, 1), 2, True)}
SLOW = pytest.mark.slow
# By default two splits run: PP 3 of the dense model (one microbatch: bit-identical) and two
# microbatches at PP 2 of the MoE (FFNs on gathered rows, on their own rows and densely). The
# rest are marked slow: every PP 4 (input-scattered, a cut at every layer) and every other PP 2
# and 3, post-norm's and MHC's (the designs whose state crosses a cut) among them.
FAST = {("dense", 3), ("moe-ep", 2)}
CASES = [
    pytest.param(
        family,
        pp,
        id=f"{family}-pp{pp}",
        marks=[pytest.mark.xdist_group(family)] + ([] if (family, pp) in FAST else [SLOW]),
    )
    for family in FAMILIES
    for pp in SPLITS
]


def _topology(family: str, pp: int = 1) -> bj.Topology:
    moe_ep = FAMILIES[family][1].get("moe_ep", 1)
    return bj.Topology(pp=pp, attn_tp=TP, moe_ep=moe_ep)


def _options(family: str) -> BuildOptions:
    return BuildOptions(**{k: v for k, v in FAMILIES[family][1].items() if k != "moe_ep"})


@functools.cache
def whole(family: str):
    """The one-program model (random weights, every shard different)."""
    config, _ = FAMILIES[family]
    return build_model(config, _topology(family), _options(family))


@functools.cache
def one_program_logits(family: str) -> np.ndarray:
    topology = _topology(family)
    return ShardedCausalLM(whole(family), bj.make_mesh(topology)).forward(PROMPTS)


@functools.cache
def pipeline(family: str, pp: int) -> PipelineCausalLM:
    config, _ = FAMILIES[family]
    sizes, microbatches, scattered = SPLITS[pp]
    topology = _topology(family, pp)
    mesh = bj.make_mesh(topology)
    stages = build_pipeline(
        config,
        topology,
        mesh,
        _options(family),
        split=PipelineSplit.of_sizes(sizes, config.num_layers),
        weights=whole(family),
    )
    return PipelineCausalLM(stages, mesh, microbatches=microbatches, input_scattered=scattered)


def _last_tokens(logits: np.ndarray) -> np.ndarray:
    """Each sequence's greedy next token (argmax at its last position)."""
    return np.asarray([logits[i, len(p) - 1].argmax() for i, p in enumerate(PROMPTS)])


@pytest.mark.parametrize("family,pp", CASES)
def test_every_family_split_into_stages_equals_the_one_program_model(family, pp):
    """Logits of every family cut into 2, 3 and 4 stages (at every layer boundary, each stage
    on its own devices with per-rank different weights) equal the one-program model's:
    bit-identical with one microbatch, within 1e-5 with two or input-scattered; the greedy
    tokens are the same."""
    want = one_program_logits(family)
    runner = pipeline(family, pp)
    got = runner.forward(PROMPTS)
    assert got.shape == want.shape
    if runner.microbatches == 1 and not runner.input_scattered:
        np.testing.assert_array_equal(got, want)
    else:
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    np.testing.assert_array_equal(_last_tokens(got), _last_tokens(want))
    for index, prompt in enumerate(PROMPTS):
        assert not np.any(got[index, len(prompt) :]), "logits past a sequence's end are zero"


@SLOW
@pytest.mark.xdist_group("moe-ep")
@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param({"attn_dp": 4}, id="attn_dp_ep-x-attn_dp"),
        pytest.param({"attn_tp": 4}, id="attn_tp_ep-x-attn_tp"),
    ],
)
def test_expert_parallelism_splitting_a_token_axis_runs_in_stages(tokens):
    """moe_ep 2 on a token axis of 4 splits it into two mesh axes: the stages' rows, handoffs
    and collected tokens take both, and two stages give the one-program model's logits and
    greedy tokens (such a mesh was refused, read as moe_ep 1)."""
    config = FAMILIES["moe-ep"][0]
    model = build_model(config, bj.Topology(**tokens, moe_ep=2), _options("moe-ep"))
    one_program = ShardedCausalLM(model, bj.make_mesh(bj.Topology(**tokens, moe_ep=2)))
    topology = bj.Topology(pp=2, **tokens, moe_ep=2)
    mesh = bj.make_mesh(topology)
    assert dict(mesh.shape)[f"{next(iter(tokens))}_ep"] == 2
    split = PipelineSplit.of_sizes((2, 2), config.num_layers)
    stages = build_pipeline(config, topology, mesh, _options("moe-ep"), split=split, weights=model)
    runner = PipelineCausalLM(stages, mesh, microbatches=2)
    want, got = one_program.forward(PROMPTS), runner.forward(PROMPTS)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    np.testing.assert_array_equal(runner.generate(PROMPTS, 3), one_program.generate(PROMPTS, 3))


@SLOW
@pytest.mark.xdist_group("dense")
def test_generation_through_the_stages_equals_the_one_program_model():
    """Greedy generation (GPipe prefill of two microbatches into every stage's caches, then
    decode steps through all four stages) gives the one-program model's tokens."""
    topology = _topology("dense")
    want = ShardedCausalLM(whole("dense"), bj.make_mesh(topology)).generate(PROMPTS, 3)
    np.testing.assert_array_equal(pipeline("dense", 4).generate(PROMPTS, 3), want)


@pytest.mark.xdist_group("dense")
def test_generation_streams_the_one_program_tokens_in_chunks():
    """generate_stream through two stages (two prefill microbatches) yields the prefill's token,
    then `chunk` decode steps at a time; together they are the tokens the one-program model
    samples for the same seed, and `generate`'s."""
    sampling = Sampling(1.0, top_k=20)
    one = ShardedCausalLM(whole("dense"), bj.make_mesh(_topology("dense")))
    want = one.generate(PROMPTS, 6, sampling=sampling, seed=1)
    runner = pipeline("dense", 2)
    pieces = list(runner.generate_stream(PROMPTS, 6, chunk=2, sampling=sampling, seed=1))
    assert [piece.shape[1] for piece in pieces] == [1, 2, 2, 1]
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), want)
    np.testing.assert_array_equal(runner.generate(PROMPTS, 6, sampling=sampling, seed=1), want)
    limit = runner.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"{limit + 1} tokens.*exceed max_position_embeddings"):
        runner.forward([*PROMPTS, [1] * (limit + 1)])
    for generate in (runner.generate, one.generate):
        with pytest.raises(ValueError, match="max_new_tokens must be at least 1; got 0"):
            generate(PROMPTS, 0)


@pytest.mark.xdist_group("dense")
@pytest.mark.parametrize("gloo", [False, True], ids=["one-process", "gloo"])
def test_programs_wait_for_each_other_only_where_gloo_carries_the_collectives(monkeypatch, gloo):
    """Where collectives between processes run on gloo (`transport.over_gloo`), every stage
    program and every handoff is waited for before the next is dispatched: two programs on one
    device group at once could take each other's gloo messages (the 2-process launch of
    test_multiprocess aborted on such a mismatch about one run in eight). Elsewhere nothing
    waits, and the logits are the same either way."""
    runner = pipeline("dense", 2)
    assert not transport.over_gloo(runner.stages[0].mesh), "one process never waits"
    want = runner.forward(PROMPTS)
    waited = []
    wait = jax.block_until_ready
    monkeypatch.setattr(transport, "over_gloo", lambda mesh: gloo)
    monkeypatch.setattr(jax, "block_until_ready", lambda tree: waited.append(tree) or wait(tree))
    np.testing.assert_array_equal(runner.forward(PROMPTS), want)
    stages, microbatches = len(runner.stages), runner.microbatches
    programs = stages * microbatches + (stages - 1) * microbatches
    assert len(waited) == (programs if gloo else 0)


def _dot_precisions(lowered) -> set[str]:
    dots = [line for line in lowered.as_text().splitlines() if "stablehlo.dot_general" in line]
    assert dots
    return {line.split("precision = [")[1].split("]")[0] for line in dots}


@pytest.mark.xdist_group("dense")
def test_stage_programs_multiply_in_float32():
    """A float32 pipeline traces its stages' matmuls at HIGHEST (true float32 where a GPU
    defaults to TF32), as the one-program runner does; asked for HIGH, at HIGH."""
    runner = pipeline("dense", 2)
    high = PipelineCausalLM(
        [stage.model for stage in runner.stages],
        runner.mesh,
        options=BuildOptions(matmul_precision=jax.lax.Precision.HIGH),
    )
    for piped, want in ((runner, "HIGHEST, HIGHEST"), (high, "HIGH, HIGH")):
        stage = piped.stages[0]
        rows, facts = piped.place(PROMPTS).placed[0][0]
        lowered = piped.forward_program(stage).lower(stage.leaves, {}, rows, facts)
        dots = [line for line in lowered.as_text().splitlines() if "dot_general" in line]
        assert dots and all(f"precision = [{want}]" in line for line in dots)


@pytest.mark.xdist_group("dense")
def test_plan_reports_each_stage_its_layers_collectives_and_handoff_bytes():
    """The plan of a pipeline names each stage's layers, the collectives of its compiled program
    per layer, and what it hands on per token (residual and completed output, hidden floats
    each; every attention-TP rank sends half); the bubble is (S - 1) / (M + S - 1)."""
    runner = pipeline("dense", 2)
    report = pipeline_plan_report(runner, PROMPTS)
    hidden = runner.config.hidden_size
    assert report["split"] == [2, 2] and report["bubble"] == pytest.approx(1 / 3)
    first, last = report["pipeline_stages"]
    assert first["layers"] == [0, 2] and last["layers"] == [2, 4]
    assert {s["layer"] for s in first["stages"]} == {0, 1}
    assert [c["layer"] for c in last["collectives_by_layer"]] == [2, 3]
    assert all(c["sequence"] for c in first["collectives_by_layer"] + last["collectives_by_layer"])
    assert first["handoff"] == {
        "tensors": {"hidden_states": [hidden], "residual": [hidden]},
        "bytes_per_token": 2 * hidden * 4,
        "bytes_per_token_per_attn_tp_rank": hidden * 4,
    }
    assert last["handoff"] is None


def test_stages_draw_the_weights_of_the_one_program_model():
    """build_pipeline creates each stage's weights in its shards on its devices, equal to the
    weights build_model draws for the same layers (the embedding and head included)."""
    config = dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=2)
    topology = bj.Topology(pp=2, attn_tp=TP)
    stages = build_pipeline(config, topology, bj.make_mesh(topology))
    want = dict(nnx.to_flat_state(nnx.state(build_model(config, bj.Topology(attn_tp=TP)))))
    devices = bj.make_mesh(topology).devices
    seen = set()
    for index, stage in enumerate(stages):
        for path, value in nnx.to_flat_state(nnx.state(stage)):
            if path[0] == "layers":
                model_path = ("layers", path[1] + stage.layer_range.start, *path[2:])
            else:
                model_path = path
            np.testing.assert_array_equal(np.asarray(value[...]), np.asarray(want[model_path][...]))
            assert value[...].devices() == set(devices[index].flat)
            seen.add(model_path)
    assert seen == set(want)


def test_the_gpipe_schedule_runs_each_microbatch_through_the_stages_in_order():
    """Stage s runs microbatch m at tick s + m; every pair runs once."""
    ticks = gpipe_ticks(3, 4)
    assert len(ticks) == 6 and bubble(3, 4) == pytest.approx(2 / 6)
    seen = [(stage, m, tick) for tick, pairs in enumerate(ticks) for stage, m in pairs]
    assert sorted((s, m) for s, m, _ in seen) == [(s, m) for s in range(3) for m in range(4)]
    assert all(tick == s + m for s, m, tick in seen)


TRAIN = {
    "dense": dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=2, tie_word_embeddings=False),
    # Mamba2, attention, relu^2 MLP and MoE layers: a stage's layers of every kind train.
    "hybrid": PRESETS["tiny-nemotron-h"],
    # xIELU's beta and eps are buffers: no update, and no share of the clipping's norm.
    "buffers": dataclasses.replace(PRESETS["tiny-apertus"], num_layers=2),
}
SEQUENCES = [[5, 7, 9, 11, 2, 4, 6], [3, 9, 1], [8, 8, 1, 4, 6, 2, 9, 3], [17, 4, 5]]


def _by_model_path(leaves, trainer: PipelineTrainer) -> dict[str, np.ndarray]:
    flat = {}
    for held, stage in zip(leaves, trainer.runner.stages, strict=True):
        for path, value in nnx.to_flat_state(stage.state_of(held)):
            path = list(path)
            if path[0] == "layers":
                path[1] += stage.layers.start
            flat[".".join(map(str, path))] = np.asarray(value[...])
    return flat


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TRAIN))
def test_a_training_step_under_two_stages_equals_one_program(family):
    """Under PP 2 (two microbatches), the loss, every gradient and every parameter after one
    AdamW step with global-norm clipping equal the one-program trainer's within 1e-5."""
    train = TrainConfig(learning_rate=1e-2, total_steps=10, warmup_steps=1, clip_norm=0.5)
    one = bj.Topology(attn_tp=TP)
    config = TRAIN[family]
    model = build_model(config, one)
    trainer = Trainer(build_model(config, one), bj.make_mesh(one), train.optimizer())
    batch = trainer.pack(SEQUENCES)
    loss, grads = trainer.gradients(batch)
    metrics = trainer.step(batch)
    topology = bj.Topology(pp=2, attn_tp=TP)
    mesh = bj.make_mesh(topology)
    piped = PipelineTrainer(
        build_pipeline(config, topology, mesh, weights=model), mesh, train, microbatches=2
    )
    piped_batch = piped.pack(SEQUENCES)
    piped_loss, piped_grads = piped.gradients(piped_batch)
    assert piped_loss == pytest.approx(loss, rel=1e-6)
    got = _by_model_path(piped_grads, piped)
    assert got.keys() == grads.keys()
    # A leaf's own scale, but no less than 1e-3 of the largest gradient (xIELU's alphas get
    # 3e-5 of it, where float32 summation order shows).
    floor = 1e-3 * max(float(np.max(np.abs(g))) for g in grads.values())
    for path, want in grads.items():
        scale = max(float(np.max(np.abs(want))), floor)
        assert np.max(np.abs(got[path] - np.asarray(want))) <= 1e-5 * scale, path
    piped_metrics = piped.step(piped_batch)
    assert piped_metrics["grad_norm"] > train.clip_norm, "the step must clip"
    assert piped_metrics["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    after = _by_model_path(piped.params, piped)
    for path, want in trainer.state.params.items():
        np.testing.assert_allclose(after[path], np.asarray(want), rtol=1e-5, atol=1e-6)


# -- bad input ------------------------------------------------------------------------------


def test_a_split_must_cover_the_layers_with_no_empty_stage():
    """Splits that do not cover or fill the layers are refused with the fix."""
    with pytest.raises(ValueError, match="need at least 5 layers.*at most 4 stages"):
        PipelineSplit.balanced(4, 5)
    with pytest.raises(ValueError, match="stage 1 holds 0"):
        PipelineSplit.of_sizes((4, 0), 4)
    with pytest.raises(ValueError, match="add up to 5"):
        PipelineSplit.of_sizes((2, 3), 4)
    with pytest.raises(ValueError, match="stage 1 holds range"):
        PipelineSplit((range(0, 2), range(3, 4)))
    assert PipelineSplit.of_sizes((10, 14, 8), 32).stages[1] == range(10, 24)
    config = PRESETS["tiny-qwen3"]
    with pytest.raises(ValueError, match="must have pp=2 stages"):
        pipeline_split(config, bj.Topology(pp=2), PipelineSplit.of_sizes((1, 1, 2), 4))


def test_the_default_split_gives_the_extra_layers_to_the_earlier_stages():
    """Without a split the stages differ by at most one layer, the earlier ones larger."""
    assert PipelineSplit.balanced(3, 2).sizes == (2, 1)
    assert PipelineSplit.balanced(5, 2).sizes == (3, 2)
    assert PipelineSplit.balanced(5, 4).stages == (
        range(0, 2),
        range(2, 3),
        range(3, 4),
        range(4, 5),
    )
    assert PipelineSplit.balanced(4, 3).sizes == (2, 1, 1)
    assert PipelineSplit.balanced(8, 4).sizes == (2, 2, 2, 2)
    assert pipeline_split(PRESETS["tiny-qwen3"], bj.Topology(pp=3), None).sizes == (2, 1, 1)


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory) -> pathlib.Path:
    """The Llama golden checkpoint's architecture grown to five layers, random weights (every
    shard different), saved as a Hugging Face checkpoint."""
    config = json.loads((LLAMA / "config.json").read_text())
    config = read_hf_config({**config, "num_hidden_layers": 5})
    _, state = nnx.split(build_model(config, bj.Topology()))
    directory = tmp_path_factory.mktemp("five") / "llama5"
    save_checkpoint(config, FlatParams(state).flatten(state), directory)
    return directory


def _forward(checkpoint: pathlib.Path, out: pathlib.Path, *mesh: str) -> np.ndarray:
    ids = str(LLAMA / "prompts.json")
    assert (
        main(
            [
                "forward",
                "--checkpoint",
                str(checkpoint),
                "--input-ids",
                ids,
                "--out",
                str(out),
                *mesh,
            ]
        )
        == 0
    )
    return np.load(out)


@pytest.mark.parametrize(
    "layers,pp,stages",
    [
        (3, 2, [[0, 2], [2, 3]]),
        pytest.param(5, 2, [[0, 3], [3, 5]], marks=SLOW),
        pytest.param(5, 4, [[0, 2], [2, 3], [3, 4], [4, 5]], marks=SLOW),
    ],
)
def test_mesh_pp_splits_a_checkpoint_without_a_split_option(
    tmp_path, capsys, five_layers, layers, pp, stages
):
    """`--mesh pp=N` alone splits a 3- or 5-layer checkpoint that N does not divide (the
    earlier stages hold the extra layer), `plan` says which layers each stage holds, and the
    logits equal the one-program model's (the 3-layer one: transformers' golden)."""
    checkpoint = LLAMA if layers == 3 else five_layers
    got = _forward(checkpoint, tmp_path / "pp.npy", "--mesh", f"pp={pp}")
    if layers == 3:
        want = np.load(LLAMA / "reference.npz")["logits"]
        tolerance = 1e-4
    else:
        want = _forward(checkpoint, tmp_path / "one.npy")
        tolerance = 1e-5
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= tolerance * np.max(np.abs(want))
    capsys.readouterr()
    assert main(["plan", "--checkpoint", str(checkpoint), "--mesh", f"pp={pp}", "--json"]) == 0
    report = json.loads(_last_line(capsys))
    assert [stage["layers"] for stage in report["pipeline_stages"]] == stages
    assert report["split"] == [b - a for a, b in stages]


def test_more_stages_than_layers_are_refused(tmp_path, capsys):
    """`--mesh pp=4` on a 3-layer checkpoint would leave a stage empty: one-line error, code 2."""
    ids = str(LLAMA / "prompts.json")
    args = ["forward", "--checkpoint", str(LLAMA), "--input-ids", ids, "--out", str(tmp_path / "x")]
    assert main([*args, "--mesh", "pp=4"]) == 2
    assert "4 pipeline stages need at least 4 layers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--mesh", "pp=2", "--pp-split", "1,1,2"],
            "--pp-split gives 3 stages but --mesh has pp=2",
        ),
        (["--mesh", "pp=2", "--pp-split", "4,0"], "stage 1 holds 0"),
        (["--mesh", "pp=5"], "need at least 5 layers"),
    ],
)
def test_the_command_line_refuses_a_bad_split(tmp_path, capsys, extra, message):
    """forward with a split that does not fit ends with a one-line error, exit code 2."""
    ids = tmp_path / "ids.json"
    ids.write_text("[[1, 2, 3]]")
    args = ["forward", "--preset", "tiny-qwen3", "--input-ids", str(ids)]
    assert main([*args, "--out", str(tmp_path / "x.npy"), *extra]) == 2
    assert message in capsys.readouterr().err


# -- the command line -----------------------------------------------------------------------

LLAMA = GOLDEN / "llama"
PIPELINE_OPTIONS = ["--mesh", "pp=2,attn_tp=2", "--pp-split", "1,2", "--microbatches", "2"]


def _last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_the_command_line_runs_a_checkpoint_in_pipeline_stages(tmp_path, capsys):
    """forward, generate and plan under --mesh pp=2 (an uneven split, two microbatches) load a
    checkpoint into two stages: transformers' logits (within 1e-4, input-scattered) and greedy
    tokens; the plan names each stage's layers and the microbatch its collectives are of."""
    reference = np.load(LLAMA / "reference.npz")
    prompts = str(LLAMA / "prompts.json")
    source = ["--checkpoint", str(LLAMA), *PIPELINE_OPTIONS]
    out = tmp_path / "logits.npy"
    forward = ["forward", *source, "--input-scattered", "--input-ids", prompts, "--out", str(out)]
    assert main(forward) == 0
    logits, want = np.load(out), reference["logits"]
    assert logits.shape == want.shape
    assert np.max(np.abs(logits - want)) <= 1e-4 * np.max(np.abs(want))
    assert main(["generate", *source, "--prompt-ids", prompts, "--max-new-tokens", "6"]) == 0
    assert json.loads(_last_line(capsys)) == reference["generated"].tolist()
    assert main(["plan", *source, "--json"]) == 0
    report = json.loads(_last_line(capsys))
    assert report["split"] == [1, 2] and report["microbatches"] == 2
    assert [stage["layers"] for stage in report["pipeline_stages"]] == [[0, 1], [1, 3]]
    # The plan's batch, 13 + 5 + 9 + 2 tokens, in two microbatches: the first holds 13 + 9.
    assert (report["batch_tokens"], report["batch_sequences"]) == (22, 2)
    console = Console(file=io.StringIO(), width=200)
    print_pipeline_plan(report, console)
    printed = console.file.getvalue()
    assert "stage 1: layers [1, 3], then the final norm and LM head" in printed
    assert "bytes for a batch of 22 tokens in 2 sequences" in printed


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["train", "--text", str(GOLDEN / "text" / "config.json"), "--steps", "1"],
            "train runs one program; --mesh pp=2 (pipeline stages) is for forward",
        ),
        (["plan", "--scan-layers"], "pipeline stages run their layers unrolled"),
        (["plan", "--quantize", "fp8"], "--quantize is not built for pipeline stages"),
    ],
)
def test_the_command_line_refuses_what_pipeline_stages_do_not_build(
    tmp_path, capsys, args, message
):
    """train, --scan-layers and FP8 quantization under --mesh pp=2 end with one line."""
    command, *rest = args
    preset = [] if "--preset" in rest else ["--preset", "tiny-qwen3"]
    out = ["--out", str(tmp_path / "o")] if command == "train" else []
    assert main([command, *preset, *rest, "--mesh", "pp=2", *out]) == 2
    assert message in capsys.readouterr().err
