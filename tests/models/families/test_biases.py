"""`attention_bias` and `mlp_bias` as transformers reads them: a bias on the q, k, v and o
projections alike in the families whose attention takes that key (the o bias added once in its
sum over attention TP), biases on the MLP's projections in Llama and Arcee (the down bias added
once in its sum over full TP), both ignored by the families whose projections have fixed
biases. Llama and Arcee checkpoints with both biases equal transformers (and, with LoRA
adapters, peft) on every layout (`scripts/make_golden_biases.py`), and a training step on
DP 2 x TP 2 equals one device's."""

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
from models.build import build_model, load_model
from models.config import PRESETS, hf_name_map, read_hf_config, write_hf_config
from models.layers.fp8_linear import Fp8Quantization
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM
from models.training.trainer import Trainer
from models.weights import save_checkpoint
from tests.models.families.test_apertus_arcee import OPTIMIZER, SEQUENCES, adam_direction
from tests.models.families.test_decoder import golden, runner

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
BIASED = ("llama", "qwen3", "qwen3_moe", "olmo2", "gemma3", "apertus", "arcee", "qwen3_next")
FIXED = ("mistral", "mixtral", "qwen2", "qwen2_moe", "exaone4")
BIAS_TENSORS = (
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.bias",
)


def golden_config(name: str) -> dict:
    return json.loads((GOLDEN / name / "config.json").read_text())


@pytest.mark.parametrize("name", BIASED)
def test_attention_bias_biases_all_four_projections(name):
    """The config has q/k/v and o biases, reads each layer's four bias tensors and writes
    `attention_bias` back."""
    config = read_hf_config(golden_config(name) | {"attention_bias": True})
    assert config.qkv_bias and config.o_bias
    names = {
        tensor.name.format(part=part, expert=0)
        for tensor in hf_name_map(config, scan_layers=False).values()
        for part in tensor.parts or (None,)
    }
    attention = 3 if name == "qwen3_next" else 0  # its first full-attention layer
    for tensor in BIAS_TENSORS:
        assert f"model.layers.{attention}.{tensor}" in names
    assert write_hf_config(config)["attention_bias"] is True
    assert read_hf_config(write_hf_config(config)) == config


@pytest.mark.parametrize("name", FIXED)
def test_families_with_fixed_biases_ignore_the_keys(name):
    """Mistral, Mixtral, Qwen2, Qwen2-MoE and EXAONE 4.0 have no `attention_bias` or `mlp_bias`
    in transformers (their biases are fixed): the keys change nothing."""
    raw = golden_config(name)
    changed = raw | {"attention_bias": True, "mlp_bias": True}
    assert read_hf_config(changed) == read_hf_config(raw)


MLP_BIASES = {
    "llama": ("gate_proj", "up_proj", "down_proj"),
    "arcee": ("up_proj", "down_proj"),
}
BIASED = ("llama_biased", "arcee_biased")
# (name, attn_dp, attn_tp, input-scattered); Llama's on DP 2 x TP 2 by default (its down bias,
# counted once, is the one both placements share), the rest under -m slow.
LAYOUTS = (
    ("DP 2 x TP 2", 2, 2, False),
    ("TP 1", 1, 1, False),
    ("TP 4", 1, 4, False),
    ("input-scattered TP 4", 1, 4, True),
    ("DP 8", 8, 1, False),
)
CASES = [
    pytest.param(
        name,
        *layout[1:],
        id=f"{name}-{layout[0]}",
        marks=[pytest.mark.xdist_group(name)]
        + ([] if (name, layout) == (BIASED[0], LAYOUTS[0]) else [pytest.mark.slow]),
    )
    for name in BIASED
    for layout in LAYOUTS
]
LORA = GOLDEN / "lora" / "llama"
LORA_ADAPTERS = ["a1", "a2", None, "a1"]  # scripts/make_golden_biases.py's, prompt by prompt


@pytest.mark.parametrize("name", sorted(MLP_BIASES))
def test_mlp_bias_reads_and_writes_the_mlp_biases(name):
    """`mlp_bias` gives each layer's MLP its bias tensors (gate and up stacked as their
    projections are) and round trips through `config.json`."""
    config = read_hf_config(golden_config(name) | {"mlp_bias": True})
    assert config.mlp_bias
    names = {
        tensor.name.format(part=part)
        for tensor in hf_name_map(config, scan_layers=False).values()
        for part in tensor.parts or (None,)
    }
    for projection in MLP_BIASES[name]:
        assert f"model.layers.1.mlp.{projection}.bias" in names
    assert write_hf_config(config)["mlp_bias"] is True
    assert read_hf_config(write_hf_config(config)) == config
    assert not read_hf_config(golden_config(name)).mlp_bias


@pytest.mark.parametrize("name,dp,tp,scattered", CASES)
def test_biased_checkpoints_match_transformers(name, dp, tp, scattered):
    """Llama and Arcee with attention and MLP biases: float32 logits within 1e-4 of HF's and
    its greedy tokens through the sharded KV cache. Each kind of bias moves the logits by more
    than 2 (the fixture script's check), so a bias dropped, added on every rank of its sum or
    split with the wrong columns shows."""
    prompts, reference = golden(name)
    run = runner(name, dp, tp, scattered)
    logits = run.forward(prompts)
    scale = np.max(np.abs(reference["logits"]))
    assert np.max(np.abs(logits - reference["logits"])) <= 1e-4 * scale
    tokens = run.generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens, reference["generated"])


@functools.cache
def lora_runner(dp: int, tp: int) -> ShardedCausalLM:
    mesh = bj.make_mesh(bj.Topology(attn_dp=dp, attn_tp=tp))
    adapters = {a: LORA / a for a in ("a1", "a2")}
    model = load_model(GOLDEN / "llama_biased", mesh, BuildOptions(), adapters=adapters)
    return ShardedCausalLM(model, mesh)


@pytest.mark.parametrize(
    "dp,tp",
    [
        pytest.param(2, 2, id="DP 2 x TP 2"),
        pytest.param(1, 4, id="TP 4", marks=pytest.mark.slow),
    ],
)
def test_lora_adapters_over_mlp_biases_match_peft(dp, tp):
    """LoRA adapters on every projection of the biased Llama (the biases stay the base
    layer's; the down bias still counted once with the adapter's product in the same sum)
    give peft's logits, each prompt through its adapter or none."""
    prompts, reference = golden("llama_biased")
    logits = lora_runner(dp, tp).forward(prompts, adapters=LORA_ADAPTERS)
    want = reference["logits_lora"]
    scale = np.max(np.abs(want))
    assert np.max(np.abs(logits - want)) <= 1e-4 * scale
    assert np.max(np.abs(reference["logits"] - want)) > 0.1 * scale


def test_scanned_biased_layers_match_transformers():
    """A scanned run of biased layers (each bias stacked on the layer axis, the down bias's
    count taken inside the scan) gives HF's logits on DP 2 x TP 2."""
    prompts, reference = golden("llama_biased")
    mesh = bj.make_mesh(bj.Topology(attn_dp=2, attn_tp=2))
    model = load_model(GOLDEN / "llama_biased", mesh, BuildOptions(scan_layers=True))
    logits = ShardedCausalLM(model, mesh).forward(prompts)
    scale = np.max(np.abs(reference["logits"]))
    assert np.max(np.abs(logits - reference["logits"])) <= 1e-4 * scale


@pytest.mark.parametrize("name", BIASED)
def test_saved_biased_checkpoint_holds_every_tensor(name, tmp_path):
    """`save_checkpoint` of a model loaded over DP 2 x TP 2 writes the checkpoint's tensors,
    biases included (gate and up unstacked), with their values."""
    mesh = bj.make_mesh(bj.Topology(attn_dp=2, attn_tp=2))
    model = load_model(GOLDEN / name, mesh, BuildOptions())
    state = nnx.to_flat_state(nnx.state(model, nnx.Param))
    params = {".".join(map(str, path)): variable.get_value() for path, variable in state}
    save_checkpoint(model.config, params, tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    original = load_file(GOLDEN / name / "model.safetensors")
    assert saved.keys() == original.keys()
    for key, value in original.items():
        np.testing.assert_array_equal(saved[key], value, err_msg=key)


def test_mlp_biases_are_refused_where_they_are_not_built():
    """A family whose MLPs take no biases refuses `mlp_bias=True` when the config is made; an
    FP8 Llama refuses its down bias (FP8 row projections carry none) when built."""
    for preset in ("tiny-qwen3", "tiny-qwen3-moe", "tiny-nemotron-h"):
        with pytest.raises(ValueError, match="mlp_bias"):
            dataclasses.replace(PRESETS[preset], mlp_bias=True)
    fp8_widths = dataclasses.replace(
        PRESETS["tiny-qwen3-fp8"], architecture="LlamaForCausalLM", qk_norm=False, mlp_bias=True
    )
    with pytest.raises(NotImplementedError, match="FP8 row-parallel projection with a bias"):
        build_model(fp8_widths, bj.Topology(), BuildOptions(quantization=Fp8Quantization()))


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(read_hf_config(golden_config("llama") | {"attention_bias": True}), id="llama"),
        pytest.param(
            dataclasses.replace(PRESETS["tiny-qwen3-next"], qkv_bias=True, o_bias=True),
            id="qwen3-next-gated",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_biased_attention_is_the_same_model_on_every_mesh(config):
    """One seed's random model (every bias drawn nonzero) gives the same logits on DP 2 x TP 2
    as on one device: each rank's q/k/v bias columns go with its heads and the o bias is added
    once in the attention-TP sum (added on both ranks, the logits move by O(1))."""
    prompts = [[5, 7, 9, 11, 2, 3, 4], [3], [8, 8, 1, 6]]
    outputs = []
    for dp, tp in ((1, 1), (2, 2)):
        topology = bj.Topology(attn_dp=dp, attn_tp=tp)
        model = build_model(config, topology, BuildOptions())
        outputs.append(ShardedCausalLM(model, bj.make_mesh(topology)).forward(prompts))
    scale = np.max(np.abs(outputs[0]))
    assert np.max(np.abs(outputs[0] - outputs[1])) <= 1e-5 * scale


def one_biased_step(dp: int, tp: int) -> dict:
    """Metrics and the parameters before and after one training step of the biased Llama on
    attention DP x TP."""
    mesh = bj.make_mesh(bj.Topology(attn_dp=dp, attn_tp=tp))
    trainer = Trainer(load_model(GOLDEN / "llama_biased", mesh), mesh, OPTIMIZER.optimizer())
    initial = jax.tree.map(np.asarray, trainer.state.params)
    metrics = trainer.step(trainer.pack(SEQUENCES))
    params = jax.tree.map(np.asarray, trainer.state.params)
    return {"metrics": metrics, "initial": initial, "params": params}


@pytest.mark.slow
def test_one_biased_step_on_dp2_tp2_equals_one_device():
    """The loss, the gradients' norm and every updated parameter within 1e-5 (relative) of one
    device, and every bias trained: the down bias, added on one rank of its sum, still gets the
    whole gradient."""
    got, want = one_biased_step(2, 2), one_biased_step(1, 1)
    for key in ("loss", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5)
    for path, value in want["params"].items():
        scale = max(np.max(np.abs(value)), 1e-30)
        assert np.max(np.abs(got["params"][path] - value)) / scale < 1e-5, path
    biases = [path for path in got["params"] if path.endswith("mlp.down_proj.bias")]
    assert len(biases) == 3
    for path in biases:
        step = adam_direction(got["initial"][path], got["params"][path])
        assert np.all(np.abs(step) > 0.05), path
