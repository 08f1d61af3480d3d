"""Apertus (xIELU) and Arcee AFM (relu^2, YaRN) on boundaries equal transformers; their configs
round trip, and what they do not compute is refused; one Apertus training step on DP 2 x TP 2
equals one device's, its xIELU alphas trained."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import boundary_jax as bj
from models.build import build_model, load_model
from models.cli.plan import collective_report
from models.config import (
    PRESETS,
    Activation,
    YarnRopeScaling,
    family_of,
    hf_name_map,
    read_hf_config,
    write_hf_config,
)
from models.families.apertus import ApertusForCausalLM
from models.families.arcee import ArceeForCausalLM
from models.layers.activations import Xielu
from models.layers.fp8_linear import Fp8Quantization
from models.layers.ungated_mlp import UngatedMlp
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM
from models.training.trainer import TrainConfig, Trainer
from models.weights import save_checkpoint
from tests.boundary_jax.test_collectives import expected_layers
from tests.models.families.test_decoder import golden, runner

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
FAMILIES = ("apertus", "arcee")
# (name, attn_dp, attn_tp, input-scattered)
LAYOUTS = (
    ("TP 1", 1, 1, False),
    ("TP 4", 1, 4, False),
    ("DP 2 x TP 2", 2, 2, False),
    ("input-scattered TP 4", 1, 4, True),
    ("DP 8", 8, 1, False),
)
# By default each family on attention DP 2 x TP 2 (its weights split over 4 ranks, its rows over
# 2, the MLP's columns over both); the other layouts under -m slow.
DEFAULT_LAYOUT = "DP 2 x TP 2"
CASES = [
    pytest.param(
        name,
        *layout[1:],
        id=f"{name}-{layout[0]}",
        marks=[pytest.mark.xdist_group(name)]
        + ([] if layout[0] == DEFAULT_LAYOUT else [pytest.mark.slow]),
    )
    for name in FAMILIES
    for layout in LAYOUTS
]


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def golden_config(name: str) -> dict:
    return json.loads((GOLDEN / name / "config.json").read_text())


@pytest.mark.parametrize("name,dp,tp,scattered", CASES)
def test_logits_and_greedy_tokens_match_transformers(name, dp, tp, scattered):
    """float32 logits of ragged prompts within 1e-4 (relative to the largest) of HF's, zero past
    each end, and HF's greedy tokens through the sharded KV cache."""
    prompts, reference = golden(name)
    run = runner(name, dp, tp, scattered)
    logits = run.forward(prompts)
    assert logits.shape == reference["logits"].shape
    assert relative_error(logits, reference["logits"]) <= 1e-4
    for index, length in enumerate(reference["lengths"]):
        assert not np.any(logits[index, length:]), "logits past a sequence's end must be zero"
    tokens = run.generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens, reference["generated"])


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_load_stays_close_to_transformers_bfloat16(name):
    """A bfloat16 load (xIELU's coefficients in bf16 as in transformers) stays within bf16
    rounding (5% of the largest logit) of HF in bf16."""
    prompts, reference = golden(name)
    logits = runner(name, 2, 2, False, jnp.bfloat16).forward(prompts)
    scale = np.max(np.abs(reference["logits"]))
    assert np.max(np.abs(logits - reference["logits_bf16"])) <= 0.05 * scale


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_context_parallel_equals_transformers(name):
    """Under attention CP 2 x TP 2 (each sequence's rows in zigzag order over the CP ranks)
    the logits and greedy tokens are HF's."""
    prompts, reference = golden(name)
    mesh = bj.make_mesh(bj.Topology(attn_cp=2, attn_tp=2))
    run = ShardedCausalLM(load_model(GOLDEN / name, mesh), mesh)
    assert relative_error(run.forward(prompts), reference["logits"]) <= 1e-4
    tokens = run.generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens, reference["generated"])


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n == "apertus" else []) for n in FAMILIES]
)
def test_each_layer_runs_the_dense_tables_collectives(name):
    """On attention DP 2 x TP 2 every layer runs docs/collectives.md's dense rows and nothing
    else: the ungated MLP (xIELU's replicated coefficients included) adds no collective (Arcee
    by default, Apertus under -m slow)."""
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    model = build_model(PRESETS[f"tiny-{name}"], topology)
    report = collective_report(ShardedCausalLM(model, bj.make_mesh(topology)))
    policy = model.options.reduction
    for index, want in enumerate(expected_layers(2, 2, False, policy, model.config.num_layers)):
        assert report.sequence(index) == want, f"layer {index}"
    assert report.sequence(None) == ("all-gather",)  # the LM head's logits over attention TP


def test_configs_read_what_the_checkpoints_hold_and_round_trip():
    """Apertus reads xIELU, per-head q/k norms and llama3 RoPE; Arcee relu^2 and YaRN (factor
    4 over 32 positions); each writes a config.json that reads back to the same config."""
    apertus, arcee = (read_hf_config(golden_config(name)) for name in FAMILIES)
    assert [family_of(apertus), family_of(arcee)] == [ApertusForCausalLM, ArceeForCausalLM]
    assert apertus.activation is Activation.XIELU and apertus.qk_norm
    assert not apertus.qk_norm_whole and apertus.rope_scaling.factor == 8
    assert arcee.activation is Activation.RELU2 and not arcee.qk_norm and arcee.head_dim == 16
    assert arcee.rope_scaling == YarnRopeScaling(factor=4.0, original_max_position_embeddings=32)
    for config in (apertus, arcee):
        written = write_hf_config(config)
        assert read_hf_config(written) == config
    assert write_hf_config(apertus)["hidden_act"] == "xielu"
    assert write_hf_config(arcee)["rope_parameters"]["rope_type"] == "yarn"


def test_tensor_names_are_the_checkpoints():
    """Apertus's norms come from attention_layernorm / feedforward_layernorm and its xIELU
    coefficients from mlp.act_fn.*; both MLPs are up_proj / down_proj; scanned runs stack them."""
    apertus = read_hf_config(golden_config("apertus"))
    names = {path: tensor.name for path, tensor in hf_name_map(apertus, scan_layers=False).items()}
    assert names["layers.1.input_norm.weight"] == "model.layers.1.attention_layernorm.weight"
    assert names["layers.1.post_attn_norm.weight"] == "model.layers.1.feedforward_layernorm.weight"
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        assert names[f"layers.2.mlp.act_fn.{name}"] == f"model.layers.2.mlp.act_fn.{name}"
    scanned = hf_name_map(apertus, scan_layers=True)  # layers 0 and 2 alone, a run of layer 1
    assert scanned["layers.1.layer.mlp.act_fn.beta"].layers == (1,)
    arcee = hf_name_map(read_hf_config(golden_config("arcee")), scan_layers=False)
    assert arcee["layers.0.mlp.up_proj.kernel"].name == "model.layers.0.mlp.up_proj.weight"
    assert not any("gate" in path for path in arcee)


@pytest.mark.parametrize(
    "name,changes,error",
    [
        ("apertus", {"hidden_act": "relu2"}, "MLP here computes xIELU only"),
        (
            "apertus",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}},
            "RoPE type 'longrope' is not supported",
        ),
        ("arcee", {"hidden_act": "silu"}, "MLP here computes relu\\^2 only"),
        (
            "arcee",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            "RoPE type 'longrope' is not supported",
        ),
    ],
)
def test_configs_refuse_what_the_families_do_not_compute(name, changes, error):
    """Another activation or another RoPE type is refused when the config is read, naming the
    key."""
    with pytest.raises(ValueError, match=error):
        read_hf_config(golden_config(name) | changes)


def test_families_refuse_configs_and_options_they_do_not_build():
    """A config with another activation or q/k norms is refused when made; FP8 (the ungated
    MLP's projections take no `linears`) and MoE options when the model is built."""
    apertus = read_hf_config(golden_config("apertus"))
    arcee = read_hf_config(golden_config("arcee"))
    with pytest.raises(ValueError, match="ApertusForCausalLM config has xIELU"):
        dataclasses.replace(apertus, activation=Activation.SILU)
    with pytest.raises(ValueError, match="ArceeForCausalLM config has relu"):
        dataclasses.replace(arcee, qk_norm=True)
    for config in (apertus, arcee):
        with pytest.raises(NotImplementedError, match="Build it without quantization"):
            build_model(config, bj.Topology(), BuildOptions(quantization=Fp8Quantization()))
        with pytest.raises(ValueError, match="has no experts"):
            build_model(config, bj.Topology(), BuildOptions(moe_dispatch=bj.MoeDispatch.GATHER))


def test_models_hold_an_ungated_mlp_with_the_checkpoints_xielu():
    """Each Apertus layer holds its own xIELU with the checkpoint's coefficients (off
    transformers' starting values); an Arcee layer a relu^2 ungated MLP."""
    apertus = runner("apertus", 2, 2, False).model
    alphas = []
    for layer in apertus.layers:
        assert isinstance(layer.mlp, UngatedMlp) and isinstance(layer.mlp.act_fn, Xielu)
        alphas.append(float(jax.nn.softplus(layer.mlp.act_fn.alpha_p[0])))
    assert len(set(alphas)) == len(alphas) and 0.8 not in alphas
    assert isinstance(runner("arcee", 2, 2, False).model.layers[0].mlp, UngatedMlp)


@pytest.mark.slow
def test_scanned_layers_equal_transformers():
    """With scanned layers (each run's parameters, xIELU's included, stacked on a layer axis)
    Apertus on TP 2 still gives HF's logits (by default the scanned load is checked by the
    saved-checkpoint test below)."""
    prompts, reference = golden("apertus")
    mesh = bj.make_mesh(bj.Topology(attn_tp=2))
    model = load_model(GOLDEN / "apertus", mesh, BuildOptions(scan_layers=True))
    assert isinstance(model.layers[1], bj.StackedLayers)  # layer 1 (0 and 2 alone)
    logits = ShardedCausalLM(model, mesh).forward(prompts)
    assert relative_error(logits, reference["logits"]) <= 1e-4


def test_saved_checkpoint_holds_the_goldens_tensors(tmp_path):
    """A loaded Apertus (scanned layers: a run's xIELU stacked) saves the golden's tensors
    as they were: every name, shape (beta and eps scalars, the alphas [1]) and value."""
    mesh = bj.make_mesh(bj.Topology())
    model = load_model(GOLDEN / "apertus", mesh, BuildOptions(scan_layers=True))
    state = nnx.to_flat_state(nnx.state(model, nnx.Param))
    params = {".".join(map(str, path)): variable.get_value() for path, variable in state}
    save_checkpoint(model.config, params, tmp_path / "saved", scan_layers=True)
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    want = load_file(GOLDEN / "apertus" / "model.safetensors")
    assert saved.keys() == want.keys()
    for name, value in want.items():
        assert saved[name].shape == value.shape, name
        np.testing.assert_array_equal(saved[name], value, err_msg=name)
    assert want["model.layers.1.mlp.act_fn.beta"].shape == ()


# --------------------------------------------------------------------------------------------
# Training: the xIELU alphas train through the same Trainer
# --------------------------------------------------------------------------------------------

# eps 1e-3 as in tests/models/training/test_train.py: Adam's first step stays a smooth
# function of the gradient, so a relative tolerance holds it.
OPTIMIZER = TrainConfig(learning_rate=1e-2, total_steps=10, warmup_steps=0, eps=1e-3)
SEQUENCES = [list(np.random.default_rng(5).integers(1, 250, n)) for n in (13, 7, 9, 4, 11, 6)]


def one_step(dp: int, tp: int) -> dict:
    """Metrics, the frozen paths, and the parameters before and after one step of the Apertus
    golden on attention DP x TP."""
    mesh = bj.make_mesh(bj.Topology(attn_dp=dp, attn_tp=tp))
    trainer = Trainer(load_model(GOLDEN / "apertus", mesh), mesh, OPTIMIZER.optimizer())
    initial = jax.tree.map(np.asarray, trainer.state.params)
    metrics = trainer.step(trainer.pack(SEQUENCES))
    return {
        "metrics": metrics,
        "frozen": trainer.frozen,
        "initial": initial,
        "params": jax.tree.map(np.asarray, trainer.state.params),
    }


def adam_direction(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """What AdamW's first step took besides its weight decay: `after = before - lr * (d +
    weight_decay * before)` with `d = g / (|g| + eps)` for the (clipped) gradient g, so d is 0
    exactly where the gradient is, and |d| > 0.05 where |g| > 5e-5."""
    lr, decay = OPTIMIZER.learning_rate, OPTIMIZER.weight_decay
    return (before - after) / lr - decay * before


@pytest.mark.slow
def test_one_apertus_step_on_dp2_tp2_equals_one_device_and_trains_the_alphas():
    """The loss, the gradients' norm and every updated parameter within 1e-5 (relative) of one
    device; each layer's alphas get a gradient (their step is more than the weight decay),
    beta and eps are buffers the step leaves as they are."""
    got, want = one_step(2, 2), one_step(1, 1)
    for key in ("loss", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5)
    for path, value in want["params"].items():
        scale = max(np.max(np.abs(value)), 1e-30)
        assert np.max(np.abs(got["params"][path] - value)) / scale < 1e-5, path
    for layer in range(3):
        prefix = f"layers.{layer}.mlp.act_fn."
        for name in ("alpha_p", "alpha_n"):
            step = adam_direction(got["initial"][prefix + name], got["params"][prefix + name])
            assert np.all(np.abs(step) > 0.05), (prefix + name, step)
        for name in ("beta", "eps"):
            assert prefix + name in got["frozen"]
            want_value = got["initial"][prefix + name]
            np.testing.assert_array_equal(got["params"][prefix + name], want_value)
    assert not any(".alpha_" in path for path in got["frozen"])


@pytest.mark.slow
def test_the_step_clips_and_reports_a_norm_without_the_buffers_gradients():
    """beta and eps get gradients (`Trainer.gradients`), but the step's `grad_norm`, which the
    clipping scales by, is the norm of the parameters' alone, as transformers' buffers have no
    gradient."""
    mesh = bj.make_mesh(bj.Topology())
    trainer = Trainer(load_model(GOLDEN / "apertus", mesh), mesh, OPTIMIZER.optimizer())
    batch = trainer.pack(SEQUENCES)
    _, grads = trainer.gradients(batch)
    squares = {path: float(np.sum(np.square(np.asarray(g)))) for path, g in grads.items()}
    buffers = sum(squares[path] for path in trainer.frozen)
    parameters = sum(value for path, value in squares.items() if path not in trainer.frozen)
    assert buffers > 1e-3 * parameters  # enough to show in the norm
    assert trainer.step(batch)["grad_norm"] == pytest.approx(parameters**0.5, rel=1e-6)


def test_fresh_apertus_starts_at_transformers_xielu():
    """A fresh Apertus model's xIELU in every layer starts where transformers' does:
    softplus(alpha_p) = 0.8 and beta + softplus(alpha_n) = 0.8."""
    model = build_model(PRESETS["tiny-apertus"], bj.Topology(), seed=2)
    for layer in model.layers:
        act = layer.mlp.act_fn
        assert float(jax.nn.softplus(act.alpha_p[0])) == pytest.approx(0.8, rel=1e-6)
        alpha_n = act.beta[...] + jax.nn.softplus(act.alpha_n[0])
        assert float(alpha_n) == pytest.approx(0.8, rel=1e-6)
