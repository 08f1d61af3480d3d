"""LongCat-Flash from Hugging Face: its config.json read and written, its tensor names, and what
transformers does not run rejected with the reason."""

import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open

import boundary_jax as bj
from models.build import build_model, load_model
from models.cli.main import main
from models.config import (
    PRESETS,
    MlaConfig,
    family_of,
    hf_name_map,
    read_hf_config,
    write_hf_config,
)
from models.families.longcat import LongcatDecoderLayer
from models.layers.moe import sparse as moe
from models.options import BuildOptions
from models.pipeline import PipelineCausalLM, load_pipeline
from models.serving.runtime import ShardedCausalLM
from models.training.trainer import TrainConfig, Trainer
from models.weights import load_config
from tests.models import MoeLayout

GOLDEN = Path(__file__).parents[2] / "golden" / "longcat_flash"
HF_CONFIG = json.loads((GOLDEN / "config.json").read_text())
GATHER, ALL_TO_ALL = bj.MoeDispatch.GATHER, bj.MoeDispatch.ALL_TO_ALL


def test_config_from_hf():
    """The golden config: 2 LongCat layers, MLA with LongCat's LoRA scales over interleaved
    RoPE pairs, 8 routed + 4 zero-computation experts under the softmax router with a
    correction bias, scaled by 6 and not renormalized; written back, it reads the same."""
    config = read_hf_config(HF_CONFIG)
    assert config.architecture == "LongcatFlashForCausalLM"
    assert (config.num_layers, config.intermediate_size, config.head_dim) == (2, 32, 16)
    mla = config.mla
    assert mla.lora_scaled and mla.rope_interleaved and mla.q_lora_rank == 24
    assert mla.q_lora_scale == pytest.approx((32 / 24) ** 0.5)
    assert mla.kv_lora_scale == pytest.approx((32 / 16) ** 0.5)
    moe = config.moe
    assert (moe.num_experts, moe.zero_experts, moe.top_k, moe.expert_intermediate_size) == (
        8,
        4,
        3,
        8,
    )
    rule = moe.routing
    assert rule.correction_bias and not rule.renormalize and rule.scaling_factor == 6.0
    assert rule.total_experts == 12 and moe.mlp_only_layers == ()
    assert config.sparse_layers == (True, True)
    assert read_hf_config(write_hf_config(config)) == config
    legacy = {k: v for k, v in HF_CONFIG.items() if k != "num_layers"} | {"num_hidden_layers": 4}
    assert read_hf_config(legacy) == config  # transformers' num_hidden_layers is 2 x layers
    preset = PRESETS["tiny-longcat-flash"]
    assert read_hf_config(write_hf_config(preset)) == preset and preset.moe.zero_experts == 4


HUB_STYLE = {  # LongCat-Flash-Chat's shapes, in the hub file's spelling (legacy rope_theta)
    "architectures": ["LongcatFlashForCausalLM"],
    "model_type": "longcat_flash",
    "attention_method": "MLA",
    "zero_expert_type": "identity",
    "hidden_size": 6144,
    "ffn_hidden_size": 12288,
    "moe_topk": 12,
    "expert_ffn_hidden_size": 2048,
    "n_routed_experts": 512,
    "zero_expert_num": 256,
    "num_layers": 28,
    "vocab_size": 131072,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "routed_scaling_factor": 6.0,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000000.0,
    "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True,
    "router_bias": False,
}


def test_config_from_hub_style_file():
    """A file in the hub's spelling (top-level rope_theta, no head_dim: transformers' default
    64 is the rope part) reads with LongCat-Flash-Chat's shapes."""
    config = read_hf_config(HUB_STYLE)
    assert (config.num_layers, config.head_dim, config.rope_theta) == (28, 192, 1e7)
    assert config.rope_scaling is None and config.mla.lora_scaled
    assert (config.moe.num_experts, config.moe.zero_experts, config.moe.top_k) == (512, 256, 12)
    assert read_hf_config(write_hf_config(config)) == config


@pytest.mark.parametrize(
    "change,match",
    [
        ({"router_bias": True}, "router_bias"),
        ({"zero_expert_type": "zero"}, "zero_expert_type"),
        ({"mla_scale_q_lora": False}, "mla_scale_q_lora"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 16}, "head_dim"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"model_type": "deepseek_v3"}, "model_type"),
    ],
)
def test_config_rejects_what_transformers_does_not_run(change, match):
    """Each option transformers computes otherwise (or that LongCat's own code reads another
    way) fails when the config is read, naming the key."""
    with pytest.raises(ValueError, match=match):
        read_hf_config(HF_CONFIG | change)


def longcat_skipped(name: str, config) -> bool:
    """Whether LongCat-Flash's family leaves checkpoint tensor `name` unread."""
    return bool(family_of(config).unread_tensors(config, [name])[0])


def test_name_map_reads_every_tensor_but_the_unread_ones():
    """Every parameter has a checkpoint tensor, and every tensor is read except the weights
    `save_pretrained` writes for the zero-computation experts (and a multi-token-prediction
    head), which the loader skips."""
    config = load_config(GOLDEN)
    names = hf_name_map(config)
    used = {name for tensor in names.values() for name in tensor.tensor_names()}
    with safe_open(GOLDEN / "model.safetensors", "np") as file:
        stored = set(file.keys())
    assert used <= stored
    unread = stored - used
    assert unread and all(longcat_skipped(name, config) for name in unread)
    assert {int(name.split(".")[5]) for name in unread} == {8, 9, 10, 11}
    assert longcat_skipped("model.mtp.layers.0.eh_proj.weight", config)
    assert not longcat_skipped("model.layers.0.mlp.experts.7.gate_proj.weight", config)
    assert names["layers.1.attn_1.kv_a_layernorm.weight"].name == (
        "model.layers.1.self_attn.1.kv_a_layernorm.weight"
    )
    assert names["layers.0.mlp.router"].name == "model.layers.0.mlp.router.classifier.weight"
    assert names["layers.0.mlps_1.gate_up_proj.kernel"].tensor_names() == (
        "model.layers.0.mlps.1.gate_proj.weight",
        "model.layers.0.mlps.1.up_proj.weight",
    )
    with pytest.raises(NotImplementedError, match="scan_layers"):
        hf_name_map(config, scan_layers=True)


# --------------------------------------------------------------------------------------------
# Parity with transformers
# --------------------------------------------------------------------------------------------


LAYOUTS = (
    MoeLayout(1, 1),
    MoeLayout(1, 4, defer=True),
    MoeLayout(2, 2),
    MoeLayout(1, 4, ep=4, dispatch=ALL_TO_ALL),
    MoeLayout(2, 2, ep=4),
)
"""TP 1, TP 4 (the MoE's finalize handed to the fusion provider, so the merge meets a
deferred finalize), attention DP 2 x TP 2, and EP 4 in both dispatch modes (all-to-all from
each TP 4 rank's own rows, its last MoE merging into the final read; gathered rows under
attention DP 2 x TP 2)."""
SLOW = {MoeLayout(1, 1), MoeLayout(1, 4, defer=True), MoeLayout(2, 2), MoeLayout(2, 2, ep=4)}
"""Under -m slow: every layout but EP 4 all-to-all on TP 4."""


@functools.cache
def golden() -> tuple[list[list[int]], dict[str, np.ndarray]]:
    prompts = json.loads((GOLDEN / "prompts.json").read_text())
    return prompts, dict(np.load(GOLDEN / "reference.npz"))


@functools.cache
def runner(layout: MoeLayout) -> ShardedCausalLM:
    mesh = layout.mesh()
    fusions = bj.fusions.FusionProvider(defer_finalize=True) if layout.defer else None
    model = load_model(
        GOLDEN,
        mesh,
        BuildOptions(moe_dispatch=layout.dispatch, fusions=fusions or bj.fusions.NO_FUSIONS),
        moe_ep=layout.ep,
    )
    return ShardedCausalLM(model, mesh)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def teacher_forced() -> list[list[int]]:
    """Each prompt followed by all but the last of transformers' greedy tokens."""
    prompts, reference = golden()
    return [p + list(g[:-1]) for p, g in zip(prompts, reference["generated"].tolist(), strict=True)]


def transformers_error(logits: np.ndarray) -> float:
    """Of `teacher_forced()`'s logits: the largest error on the prompts relative to the largest
    HF logit, after checking the rows past each end are zero and the argmax from each prompt's
    last row on is HF's greedy continuation."""
    _, reference = golden()
    lengths, generated = reference["lengths"], reference["generated"]
    steps, want = generated.shape[1], reference["logits"]
    prompt_logits = np.stack([logits[i, : want.shape[1]] for i in range(len(lengths))])
    prompt_logits = np.where(
        np.arange(want.shape[1])[None, :, None] < lengths[:, None, None], prompt_logits, 0
    )
    for index, length in enumerate(lengths):
        assert not np.any(logits[index, length + steps - 1 :])
        greedy = np.argmax(logits[index, length - 1 : length + steps - 1], axis=-1)
        np.testing.assert_array_equal(greedy, generated[index])
    return relative_error(prompt_logits, want)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(layout, id=str(layout), marks=[pytest.mark.slow] if layout in SLOW else [])
        for layout in LAYOUTS
    ],
)
def test_logits_and_greedy_tokens_match_transformers(layout):
    """HF's float32 logits within 1e-4 (relative to the largest) and HF's greedy tokens
    (teacher-forced) on every layout."""
    assert transformers_error(runner(layout).forward(teacher_forced())) <= 1e-4


@pytest.mark.slow
def test_pipeline_stages_match_transformers():
    """Two pipeline stages (a layer each) on attention TP 2 with EP 2 all-to-all, two
    microbatches, each stage holding its layer's two latent caches: HF's logits and greedy
    tokens (teacher-forced), and `generate` over the stages' caches gives HF's tokens."""
    mesh = bj.make_mesh(bj.Topology(attn_tp=2, pp=2, moe_ep=2))
    options = BuildOptions(moe_dispatch=ALL_TO_ALL)
    stages = load_pipeline(GOLDEN, mesh, options, moe_ep=2)
    run = PipelineCausalLM(stages, mesh, microbatches=2)
    assert [stage.layers for stage in run.stages] == [range(0, 1), range(1, 2)]
    assert transformers_error(run.forward(teacher_forced())) <= 1e-4
    prompts, reference = golden()
    tokens = run.generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens, reference["generated"])


def test_generate_over_the_latent_caches_matches_transformers():
    """`generate` (prefill, then absorbed decode steps over each attention's latent cache) under
    attention DP 2 x TP 2 gives HF's greedy tokens."""
    prompts, reference = golden()
    tokens = runner(MoeLayout(2, 2)).generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens, reference["generated"])


def test_captured_hidden_states_match_transformers():
    """`forward_captured` under attention DP 2 x TP 2 gives transformers' hidden states: the
    residual entering each layer (after the previous layer's merge) and the one the final norm
    reads, within 1e-4 of the largest."""
    prompts, reference = golden()
    with np.load(GOLDEN / "hidden_states.npz") as captured:
        want = captured["hidden_states"]
    layers = [2, 0, 1]
    logits, hidden = runner(MoeLayout(2, 2)).forward_captured(prompts, layers)
    for got, layer in zip(hidden, layers, strict=True):
        assert relative_error(got, want[layer]) <= 1e-4, layer
    assert relative_error(logits, reference["logits"]) <= 1e-4


@pytest.mark.slow
def test_generate_on_the_command_line_matches_transformers(capsys):
    """`generate` with the golden checkpoint on attention DP 2 x TP 2 with EP 4 all-to-all
    prints HF's greedy tokens."""
    _, reference = golden()
    args = ["generate", "--checkpoint", str(GOLDEN), "--mesh", "attn_dp=2,attn_tp=2"]
    args += ["--moe-ep", "4", "--moe-dispatch", "all-to-all"]
    args += ["--prompt-ids", str(GOLDEN / "prompts.json"), "--max-new-tokens", "6"]
    assert main(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == reference["generated"].tolist()


def test_plan_shows_the_branch_and_the_two_latent_caches(capsys):
    """`plan --json` lists each layer's main chain and its branch: the branch's first stage
    forks from the MoE's gathered input, moving nothing, its last merges onto the attention's
    rows; the decode cache is two latents per layer."""
    args = ["plan", "--checkpoint", str(GOLDEN), "--mesh", "attn_dp=2,attn_tp=2"]
    assert main([*args, "--moe-ep", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    mla = load_config(GOLDEN).mla
    per_layer = 2 * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4
    assert report["decode_cache"] == {
        "kind": "LongcatCache",
        "bytes_per_token_per_layer": per_layer,
        "bytes_per_token": 2 * per_layer,
    }
    names = ["attention", "moe", "branch ffn 0", "branch attention", "branch ffn 1"]
    assert [(s["layer"], s["stage"]) for s in report["stages"]] == [
        (layer, name) for layer in (0, 1) for name in names
    ]
    by_name = {s["stage"]: s for s in report["stages"] if s["layer"] == 1}
    assert by_name["branch ffn 0"]["entries"] == []
    fork = by_name["branch ffn 0"]["fork"]
    assert (fork["source_input_rows"], fork["moves_input"]) == ("{all rows}", "nothing")
    assert (fork["source_residual_rows"], fork["forks_residual"]) == ("{ATTN_DP}", "nothing")
    assert by_name["branch ffn 1"]["merge"]["into_residual_rows"] == "{ATTN_DP}"
    assert not {"fork", "merge"} & (by_name["moe"].keys() | by_name["branch attention"].keys())


# --------------------------------------------------------------------------------------------
# Mutants and what is not built
# --------------------------------------------------------------------------------------------


def mutant_error() -> float:
    """HF error of a fresh TP 1 program of the loaded golden model (so a monkeypatched module
    is traced anew)."""
    layout = MoeLayout(1, 1)
    run = ShardedCausalLM(runner(layout).model, layout.mesh())
    return relative_error(run.forward(golden()[0]), golden()[1]["logits"])


@pytest.mark.parametrize("mutant", ["no-lora-scales", "zero-experts-output-zero", "renormed"])
def test_mutants_are_caught(monkeypatch, mutant):
    """LongCat's LoRA scales dropped, zero-computation experts returning zero, or the dense
    branch normalizing the MoE's input again, each moves the logits away from HF's."""
    if mutant == "no-lora-scales":
        for scale in ("q_lora_scale", "kv_lora_scale"):
            monkeypatch.setattr(MlaConfig, scale, property(lambda self: 1.0))
    elif mutant == "zero-experts-output-zero":
        monkeypatch.setattr(moe, "zero_expert_output", lambda x, routing, num_experts: 0 * x)
    else:
        dense = LongcatDecoderLayer.run_stages

        def renormed(self, h, stream, rows, cache):
            call = type(self.mlps_0).__call__
            monkeypatch.setattr(
                type(self.mlps_0), "__call__", lambda m, g: call(m, self.post_attn_norm_0(g))
            )
            return dense(self, h, stream, rows, cache)

        monkeypatch.setattr(LongcatDecoderLayer, "run_stages", renormed)
    assert mutant_error() > 1e-2


def test_what_is_not_built_is_rejected():
    """Scanned layers and an input-scattered batch fail with the reason, the latter when its
    runtime is made (before anything compiles) and as the command line's one-line error."""
    config = load_config(GOLDEN)
    with pytest.raises(NotImplementedError, match="scan_layers"):
        build_model(config, bj.Topology(), BuildOptions(scan_layers=True))
    layout = MoeLayout(1, 4, defer=True)
    refused = "does not run input-scattered batches: layer 0's attention stage binds only .*branch"
    with pytest.raises(NotImplementedError, match=refused):
        ShardedCausalLM(runner(layout).model, layout.mesh(), input_scattered=True)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

OPTIMIZER = TrainConfig(learning_rate=1e-2, total_steps=10, warmup_steps=0, eps=1e-3)
SEQUENCES = [list(np.random.default_rng(5).integers(0, 250, n)) for n in (13, 7, 9, 4, 11, 6)]


def one_step(layout: MoeLayout) -> dict:
    """Initial and updated parameters and the loss of one optax step of the golden model."""
    mesh = layout.mesh()
    model = load_model(GOLDEN, mesh, BuildOptions(moe_dispatch=layout.dispatch), moe_ep=layout.ep)
    trainer = Trainer(model, mesh, OPTIMIZER.optimizer())
    initial = jax.tree.map(np.asarray, trainer.state.params)
    loss = trainer.step(trainer.pack(SEQUENCES))["loss"]
    params = jax.tree.map(np.asarray, trainer.state.params)
    return {"frozen": trainer.frozen, "initial": initial, "loss": loss, "params": params}


@pytest.mark.slow  # two train-step compiles, ~18 s on 2 cores: beyond the brief's budget
def test_one_step_on_dp2_tp2_ep4_equals_the_single_device_step():
    """Gradients through the branch (its fork, its own residual adds, the merge): one step on
    DP 2 x TP 2 with EP 4 gives the single-device loss and updated parameters within 1e-5;
    every parameter moved but the correction biases."""
    got, want = one_step(MoeLayout(2, 2, ep=4)), one_step(MoeLayout(1, 1))
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert (
        got["frozen"]
        == want["frozen"]
        == {f"layers.{i}.mlp.e_score_correction_bias" for i in (0, 1)}
    )
    for path, value in want["params"].items():
        assert relative_error(got["params"][path], value) < 1e-5, path
        moved = np.max(np.abs(value - want["initial"][path]))
        assert (moved == 0) == (path in want["frozen"]), path
