"""GPT-OSS on boundaries equals transformers (golden files) under TP, attention DP, input-scattered
rows, expert parallelism in both dispatch modes and pipeline stages: attention sinks, the o bias
counted once, alternating windows, YaRN, the biased router and the biased clamped-SwiGLU experts;
its layers add no collective; one optax step on DP 2 x TP 2 with EP equals one device's (the
sinks and every bias train); configs read, write back and refuse what GPT-OSS does not build; the
command line runs it."""

import dataclasses
import functools
import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import boundary_jax as bj
from models.build import abstract_model, build_model, load_model
from models.cli.main import main
from models.cli.plan import collective_report
from models.config import PRESETS, YarnRopeScaling, hf_name_map, read_hf_config, write_hf_config
from models.config.types import AttentionKind
from models.families.gpt_oss import GptOssForCausalLM
from models.layers.clamped_swiglu import ClampedSwiGlu
from models.layers.fp8_linear import Fp8Quantization
from models.layers.moe.ffn import MoeFfn
from models.options import BuildOptions
from models.pipeline import PipelineCausalLM, load_pipeline
from models.serving.runtime import ShardedCausalLM
from models.training.trainer import TrainConfig, Trainer
from models.weights import load_config, save_checkpoint
from tests.models import MoeLayout, randomize_norms

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
CHECKPOINT = GOLDEN / "gpt_oss"
GATHER, ALL_TO_ALL = bj.MoeDispatch.GATHER, bj.MoeDispatch.ALL_TO_ALL
SLOW = pytest.mark.slow

LAYOUTS = (
    MoeLayout(2, 2, ep=4, dispatch=ALL_TO_ALL),
    MoeLayout(1, 4),
    MoeLayout(1, 1),
    MoeLayout(2, 2),
    MoeLayout(1, 4, scattered=True),
    MoeLayout(8, 1),
    MoeLayout(1, 4, ep=4),
    MoeLayout(1, 8, ep=8, dispatch=ALL_TO_ALL),
)
"""The issue's layouts: attention DP 2 x TP 2 with EP 4 all-to-all, TP 4 (gathered rows, each
expert's width over the 4 ranks); then TP 1, attention DP 2 x TP 2, input-scattered TP 4,
attention DP 8, EP 4 gather, EP 8 all-to-all (on TP 8: each kv head shared by 4 ranks)."""
DEFAULT_LAYOUTS = LAYOUTS[:1]
CASES = [
    pytest.param(layout, id=str(layout), marks=[] if layout in DEFAULT_LAYOUTS else [SLOW])
    for layout in LAYOUTS
]


def topology(layout: MoeLayout, pp: int = 1) -> bj.Topology:
    return bj.Topology(pp=pp, attn_dp=layout.dp, attn_tp=layout.tp, moe_ep=layout.ep)


@functools.cache
def golden() -> tuple[list[list[int]], dict[str, np.ndarray]]:
    prompts = json.loads((CHECKPOINT / "prompts.json").read_text())
    return prompts, dict(np.load(CHECKPOINT / "reference.npz"))


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def load_runner(checkpoint: pathlib.Path, layout: MoeLayout) -> ShardedCausalLM:
    mesh = bj.make_mesh(topology(layout))
    options = BuildOptions(moe_dispatch=layout.dispatch)
    model = load_model(checkpoint, mesh, options, moe_ep=layout.ep)
    return ShardedCausalLM(model, mesh, input_scattered=layout.scattered)


def load_stages(checkpoint: pathlib.Path) -> PipelineCausalLM:
    """Two pipeline stages (one layer each) on attention TP 2, experts over EP 2 all-to-all,
    two microbatches."""
    layout = MoeLayout(1, 2, ep=2, dispatch=ALL_TO_ALL)
    mesh = bj.make_mesh(topology(layout, pp=2))
    options = BuildOptions(moe_dispatch=layout.dispatch)
    stages = load_pipeline(checkpoint, mesh, options, moe_ep=layout.ep)
    return PipelineCausalLM(stages, mesh, microbatches=2)


def check_against_transformers(run, logits_key: str = "logits", generate: bool = True) -> None:
    """float32 logits within 1e-4 (relative to the largest) of HF's, zero past each end, and
    HF's greedy tokens through the sharded KV cache."""
    prompts, reference = golden()
    logits = run.forward(prompts)
    want = reference[logits_key]
    assert logits.shape == want.shape
    assert relative_error(logits, want) <= 1e-4
    for index, length in enumerate(reference["lengths"]):
        assert not np.any(logits[index, length:])
    if generate:
        tokens = run.generate(prompts, reference["generated"].shape[1])
        np.testing.assert_array_equal(tokens, reference["generated"])


@pytest.mark.parametrize("layout", CASES)
def test_logits_and_greedy_tokens_match_transformers(layout):
    """HF's logits and greedy tokens on every layout: each rank's sinks and q/k/v biases are its
    heads', the o bias and the experts' down biases are counted once in their sums, and the
    experts' gate/up columns are de-interleaved from the fused tensor on each rank's slice."""
    check_against_transformers(load_runner(CHECKPOINT, layout))


@SLOW
def test_pipeline_stages_match_transformers():
    """Two stages (a sliding then a full layer), two microbatches: HF's logits and tokens."""
    check_against_transformers(load_stages(CHECKPOINT))


def test_model_classes_and_parameters():
    """The checkpoint builds GptOssForCausalLM: every layer a MoeFfn of the clamped SwiGLU with
    a router bias and expert biases, attention with sinks and all four biases, the sliding
    window on layer 0 only, YaRN without truncation."""
    config = load_config(CHECKPOINT)
    assert config.layer_types == (AttentionKind.SLIDING, AttentionKind.FULL)
    assert config.rope_scaling == YarnRopeScaling(
        factor=4.0, original_max_position_embeddings=64, truncate=False
    )
    model = abstract_model(config, bj.Topology(attn_tp=2), BuildOptions())
    assert isinstance(model, GptOssForCausalLM)
    for index, layer in enumerate(model.layers):
        assert isinstance(layer.mlp, MoeFfn)
        assert layer.mlp.activation == ClampedSwiGlu(1.25, 1.702)
        for bias in ("router_bias", "gate_up_proj_bias", "down_proj_bias"):
            assert getattr(layer.mlp, bias) is not None, bias
        attn = layer.attn
        assert attn.sinks.shape == (8,) and attn.o_proj.bias.shape == (64,)
        assert attn.q_proj.bias is not None and attn.kv_proj.bias is not None
        assert attn.spec.sliding_window == (4 if index == 0 else None)


# --------------------------------------------------------------------------------------------
# Collectives: the sinks and the biases add none
# --------------------------------------------------------------------------------------------

MOE_TABLE = pathlib.Path(__file__).parents[3] / "docs" / "collectives.md"
KINDS = {"AR": "all-reduce", "RS": "reduce-scatter", "AG": "all-gather", "A2A": "all-to-all"}


def documented_middle_sparse_layer(layout: MoeLayout) -> tuple[str, ...]:
    """The "MoE decoders" table's row of `layout` (finalize at exit) in docs/collectives.md."""
    text = MOE_TABLE.read_text().split("## MoE decoders", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in rows[0]]
    for row in rows[2:]:
        cells = dict(zip(header, (cell.strip() for cell in row), strict=True))
        key = (int(cells["dp"]), int(cells["tp"]), int(cells["ep"]), cells["dispatch"])
        batch = "input-scattered" if layout.scattered else "ordinary"
        wanted = (layout.dp, layout.tp, layout.ep, layout.dispatch.value)
        if key == wanted and (cells["batch"], cells["finalize"]) == (batch, "at exit"):
            return tuple(KINDS[kind] for kind in cells["middle sparse layer"].split())
    raise AssertionError(f"docs/collectives.md documents no row of {layout}")


@SLOW
@pytest.mark.parametrize(
    "layout",
    [
        MoeLayout(2, 2, ep=4, dispatch=ALL_TO_ALL),
        MoeLayout(1, 4, ep=4),
        MoeLayout(2, 2, ep=2, dispatch=ALL_TO_ALL),
    ],
    ids=str,
)
def test_a_middle_layer_runs_the_documented_moe_collectives(layout):
    """A middle layer of the 4-layer tiny-gpt-oss runs exactly the collectives docs/collectives.md
    documents for a plain MoE layer: the sinks, the o bias and the expert biases add none."""
    model = build_model(
        PRESETS["tiny-gpt-oss"], topology(layout), BuildOptions(moe_dispatch=layout.dispatch)
    )
    run = ShardedCausalLM(model, bj.make_mesh(topology(layout)), input_scattered=layout.scattered)
    assert collective_report(run).sequence(1) == documented_middle_sparse_layer(layout)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

TRAIN_CONFIG = dataclasses.replace(
    PRESETS["tiny-gpt-oss"],
    num_layers=2,
    layer_types=(AttentionKind.SLIDING, AttentionKind.FULL),
    sliding_window=4,
)
OPTIMIZER = TrainConfig(learning_rate=1e-2, total_steps=10, warmup_steps=0, eps=1e-3)
SEQUENCES = [list(np.random.default_rng(5).integers(0, 256, n)) for n in (13, 7, 9, 4, 11, 6)]


@functools.cache
def one_step(layout: MoeLayout) -> dict:
    """Initial and updated parameters and the loss of one step (random weights, norms random
    too; the sinks drawn large enough that they shape the attention)."""
    model = build_model(TRAIN_CONFIG, topology(layout), BuildOptions(moe_dispatch=layout.dispatch))
    randomize_norms(model, seed=3)
    for layer in model.layers:
        layer.attn.sinks[...] = layer.attn.sinks[...] * 100  # N(0, 4)
    trainer = Trainer(model, bj.make_mesh(topology(layout)), OPTIMIZER.optimizer())
    initial = jax.tree.map(np.asarray, trainer.state.params)
    metrics = trainer.step(trainer.pack(SEQUENCES))
    return {
        "initial": initial,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "params": jax.tree.map(np.asarray, trainer.state.params),
    }


@SLOW
def test_one_step_on_dp2_tp2_ep4_equals_the_single_device_step():
    """DP 2 x TP 2 with the experts over EP 4 all-to-all: the loss, the gradients' norm and every
    updated parameter within 1e-5 of one device's, and every parameter moved: the sinks, the
    router bias and the experts' biases get gradients."""
    got = one_step(MoeLayout(2, 2, ep=4, dispatch=ALL_TO_ALL))
    want = one_step(MoeLayout(1, 1))
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    trained = {"attn.sinks", "mlp.router_bias", "mlp.gate_up_proj_bias", "mlp.down_proj_bias"}
    seen = set()
    for path, value in want["params"].items():
        error = relative_error(got["params"][path], value)
        assert error < 1e-5, (path, error)
        assert np.max(np.abs(value - want["initial"][path])) > 1e-5, path
        seen |= {name for name in trained if path.endswith(name)}
    assert seen == trained


@SLOW
def test_trained_checkpoint_reads_back(tmp_path):
    """The sharded step's parameters written as a checkpoint (gate/up interleaved back into one
    tensor) load on another mesh to the same parameters."""
    trained = one_step(MoeLayout(2, 2, ep=4, dispatch=ALL_TO_ALL))
    save_checkpoint(TRAIN_CONFIG, trained["params"], tmp_path)
    assert load_config(tmp_path) == TRAIN_CONFIG
    layout = MoeLayout(1, 4, ep=2)
    model = load_model(tmp_path, bj.make_mesh(topology(layout)), moe_ep=layout.ep)
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(map(str, path))
        np.testing.assert_array_equal(np.asarray(value.get_value()), trained["params"][name])


# --------------------------------------------------------------------------------------------
# Configs and the command line
# --------------------------------------------------------------------------------------------

RELEASED_CONFIG = {  # openai/gpt-oss-20b's config.json, its keys as published
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}


def test_configs_read_and_write_back():
    """The golden config, the preset and the released 20B config read as transformers runs them
    and write back to themselves; the name map covers every checkpoint tensor."""
    released = read_hf_config(RELEASED_CONFIG)
    assert released.sliding_window == 128 and released.layer_types[:2] == (
        AttentionKind.SLIDING,
        AttentionKind.FULL,
    )
    assert released.rope_scaling == YarnRopeScaling(
        factor=32.0, original_max_position_embeddings=4096, truncate=False
    )
    assert released.moe.num_experts == 32 and released.moe.top_k == 4
    assert released.moe.swiglu_limit == 7.0 and released.moe.swiglu_alpha == 1.702
    assert released.head_dim == 64 and released.qkv_bias and released.o_bias
    for config in (released, load_config(CHECKPOINT), PRESETS["tiny-gpt-oss"]):
        assert read_hf_config(write_hf_config(config)) == config
    unlisted = read_hf_config({k: v for k, v in RELEASED_CONFIG.items() if k != "layer_types"})
    assert unlisted == released  # transformers' default alternation
    config = load_config(CHECKPOINT)
    names = {n for source in hf_name_map(config).values() for n in source.tensor_names()}
    assert names == set(load_file(str(CHECKPOINT / "model.safetensors")))


def test_keys_transformers_does_not_read_for_inference_leave_the_model_alone():
    """As in transformers, `hidden_act` (the experts compute the clamped SwiGLU) and
    `output_router_logits` (a training loss term; `train` refuses it) change nothing."""
    released = read_hf_config(RELEASED_CONFIG)
    unread = {"hidden_act": "gelu", "output_router_logits": True, "router_aux_loss_coef": 0.5}
    assert read_hf_config(RELEASED_CONFIG | unread) == released


def test_what_gpt_oss_does_not_build_is_refused():
    """FP8 experts and attention CP are refused, naming the fix."""
    config = PRESETS["tiny-gpt-oss"]
    with pytest.raises(NotImplementedError, match="FP8 quantization is built for"):
        build_model(config, bj.Topology(), BuildOptions(quantization=Fp8Quantization()))
    with pytest.raises(NotImplementedError, match="context parallelism"):
        build_model(config, bj.Topology(attn_cp=2))
    with pytest.raises(ValueError, match="attention sinks"):
        dataclasses.replace(config, attention_sinks=False)


@SLOW
def test_command_line_forward_generate_and_plan(tmp_path, capsys):
    """forward (attention DP 2 x TP 2, EP 4 all-to-all) gives HF's logits, generate (two pipeline
    stages) HF's greedy tokens, plan a middle layer's collectives."""
    prompts, reference = golden()
    ids = str(CHECKPOINT / "prompts.json")
    out = tmp_path / "logits.npy"
    args = ["forward", "--checkpoint", str(CHECKPOINT), "--mesh", "attn_dp=2,attn_tp=2"]
    args += ["--moe-ep", "4", "--moe-dispatch", "all-to-all", "--input-ids", ids, "--out", str(out)]
    assert main(args) == 0
    assert relative_error(np.load(out), reference["logits"]) <= 1e-4
    args = ["generate", "--checkpoint", str(CHECKPOINT), "--mesh", "pp=2,attn_tp=2"]
    assert main([*args, "--moe-ep", "2", "--prompt-ids", ids, "--max-new-tokens", "6"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == reference["generated"].tolist()
    args = ["plan", "--checkpoint", str(CHECKPOINT), "--mesh", "attn_tp=4", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["collectives_per_layer"]["all-reduce"] >= 2


def test_plan_shows_where_the_replicated_biases_are_added(capsys):
    """The o projection's bias and the experts' down biases are replicated parts their stages
    declare: `plan` shows each added on the first rank of its sum's group (the down bias over
    an expert's width group, here all of attention TP with moe_ep 1)."""
    args = ["plan", "--checkpoint", str(CHECKPOINT), "--mesh", "attn_tp=2", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    attention, ffn = report["stages"][:2]
    first = "added on the first rank of attn_tp only"
    assert attention["replicated"] == {"o_proj bias": first}
    assert ffn["replicated"] == {"expert down bias": first}
    assert main(args[:-1]) == 0
    assert f"layer 0 attention: o_proj bias {first}" in capsys.readouterr().out
