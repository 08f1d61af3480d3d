"""LoRA training: optax on the adapter stacks only, the base frozen; one step on attention DP 2 x
TP 2 equals one device's; three steps from PEFT's start equal `peft` trained by torch's AdamW; the
adapter written in the PEFT layout loads back with the trained model's logits."""

import functools
import json
import pathlib

import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

import boundary_jax as bj
from models.build import load_model
from models.cli.lora import lora_training
from models.cli.main import main
from models.layers.lora import ATTENTION_TARGETS, LoraSpec, LoraTarget
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM
from models.training.trainer import TrainConfig, Trainer
from models.weights.peft import is_lora_parameter, is_lora_path, peft_start, write_peft_adapter

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
SPEC = LoraSpec(("trained",), 4, frozenset((*ATTENTION_TARGETS, LoraTarget.DOWN)))
ALPHA = 8.0
SEQUENCES = [[5, 7, 9, 11, 2, 30, 4], [3, 8, 1], [8, 8, 1, 4, 6, 2, 9, 40, 41], [17, 4, 99, 12]]
OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


@functools.cache
def stepped(dp: int, tp: int) -> Trainer:
    """A trainer of the tiny Qwen3 with random A and B (so both get gradients), one step on."""
    mesh = bj.make_mesh(bj.Topology(attn_dp=dp, attn_tp=tp))
    model = load_model(GOLDEN / "qwen3", mesh, BuildOptions(lora=SPEC))
    trainer = Trainer(model, mesh, OPTIMIZER, trainable=is_lora_parameter)
    trainer.metrics = trainer.step(trainer.pack(SEQUENCES, adapters=[1] * len(SEQUENCES)))
    return trainer


@pytest.mark.slow
def test_lora_step_trains_the_stacks_only_and_equals_one_device():
    """The optimizer holds the adapter stacks alone; one step on DP 2 x TP 2 gives one device's
    loss, gradient norm and updated A and B; the base parameters are untouched."""
    one, sharded = stepped(1, 1), stepped(2, 2)
    assert sharded.trainable and all(is_lora_parameter(p) for p in sharded.trainable)
    assert "layers.0.attn.q_proj.kernel" in sharded.fixed
    assert one.metrics == pytest.approx(sharded.metrics, rel=1e-5)
    for path, want in one.state.params.items():
        got = np.asarray(sharded.state.params[path])
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-6, err_msg=path)
    start = load_model(GOLDEN / "qwen3", bj.make_mesh(bj.Topology()), BuildOptions(lora=SPEC))
    moved = np.asarray(start.layers[1].attn.o_lora.a[...]) - np.asarray(
        one.state.params["layers.1.attn.o_lora.a"]
    )
    assert np.max(np.abs(moved)) > 1e-3
    np.testing.assert_array_equal(
        np.asarray(sharded.fixed["layers.1.attn.q_proj.kernel"]),
        np.asarray(start.layers[1].attn.q_proj.kernel[...]),
    )


@pytest.mark.slow
def test_written_peft_adapter_loads_back_with_the_trained_logits(tmp_path):
    """The trained adapter written in the PEFT layout (scaling taken out of B) and loaded as an
    adapter gives the trained model's logits; the base rows stay the base model's."""
    trainer = stepped(2, 2)
    write_peft_adapter(trainer.state.params, SPEC, tmp_path, alpha=ALPHA, base="qwen3")
    settings = json.loads((tmp_path / "adapter_config.json").read_text())
    assert settings["r"] == 4 and settings["lora_alpha"] == ALPHA
    mesh = bj.make_mesh(bj.Topology(attn_tp=2))
    # The trainer's stacks hold B scaled by alpha / r (as loaded); the written B is B / scaling.
    loaded = ShardedCausalLM(load_model(GOLDEN / "qwen3", mesh, adapters={"t": tmp_path}), mesh)
    trained = ShardedCausalLM(trainer.model, trainer.mesh)
    adapters = ["t", None, "t", "t"]
    want = trained.forward(SEQUENCES, adapters=[1, 0, 1, 1])
    got = loaded.forward(SEQUENCES, adapters=adapters)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_three_steps_from_peft_start_equal_peft_trained_by_torch(tmp_path):
    """From the adapter PEFT starts (B zero, A drawn by the golden script), three steps of
    `TrainConfig`'s optimizer on TP 2 give torch's losses, gradient norms and trained adapter
    (tests/golden/lora_train: alpha 16 over r 4, so B stepped with the scaling folded in
    differs)."""
    golden = GOLDEN / "lora_train"
    reference = json.loads((golden / "reference.json").read_text())
    lora = lora_training(reference["train_lora"])
    mesh = bj.make_mesh(bj.Topology(attn_tp=2))
    model = load_model(GOLDEN / "qwen3", mesh, BuildOptions(lora=lora.spec))
    start = load_model(GOLDEN / "qwen3", mesh, adapters={"trained": golden / "start"})
    nnx.update(model, nnx.state(start, is_lora_path))  # B is zero: no scaling folded in
    optimizer = TrainConfig(**reference["config"]).optimizer()
    trainer = Trainer(model, mesh, optimizer, trainable=is_lora_parameter)
    sequences = reference["sequences"]
    batch = trainer.pack(sequences, adapters=[1] * len(sequences))
    steps = [trainer.step(batch) for _ in reference["losses"]]
    np.testing.assert_allclose([m["loss"] for m in steps], reference["losses"], rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in steps], reference["grad_norms"], rtol=1e-5)
    write_peft_adapter(trainer.state.params, lora.spec, tmp_path, alpha=lora.alpha, base="qwen3")
    got = load_file(tmp_path / "adapter_model.safetensors")
    want = load_file(golden / "trained" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-3 * np.abs(value).max())


def test_peft_start_zeroes_b_and_draws_a_as_peft():
    """B zero (the model starts as its base), A uniform within PEFT's +-1 / sqrt(in)."""
    mesh = bj.make_mesh(bj.Topology(attn_tp=2))
    model = peft_start(load_model(GOLDEN / "qwen3", mesh, BuildOptions(lora=SPEC)), seed=3)
    q, o = model.layers[0].attn.q_lora, model.layers[0].attn.o_lora
    assert not np.any(np.asarray(q.b[...])) and not np.any(np.asarray(o.b[...]))
    for a in (np.asarray(q.a[...]), np.asarray(o.a[...])):
        bound = a.shape[0] ** -0.5
        assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound
        assert np.std(a) == pytest.approx(bound / 3**0.5, rel=0.15)


def test_train_command_writes_a_peft_adapter(tmp_path, capsys):
    """train --train-lora trains the adapter over a frozen preset and writes a PEFT folder that
    load_model reads; a bad --train-lora is refused."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["alpha beta gamma delta"] * 200))
    out = tmp_path / "adapter"
    args = ["train", "--preset", "tiny-qwen3", "--text", str(text), "--steps", "2"]
    args += ["--batch-tokens", "64", "--seq-len", "16", "--out", str(out)]
    assert main([*args, "--train-lora", "r=4,alpha=8,targets=q,v,down"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2
    settings = json.loads((out / "adapter_config.json").read_text())
    assert settings["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert main([*args, "--train-lora", "r=4,alpha=8,targets=lm_head"]) == 2
    assert "targets among" in capsys.readouterr().err


@pytest.mark.slow
def test_an_ungated_mlp_adapter_trains_and_round_trips(tmp_path):
    """Arcee's adapter on its attention and its ungated MLP's up and down: one step on DP 2 x
    TP 2 equals one device's, and the PEFT folder it writes loads back with its logits."""
    spec = LoraSpec(("t",), 4, frozenset((*ATTENTION_TARGETS, LoraTarget.UP, LoraTarget.DOWN)))
    trained = []
    for dp, tp in ((1, 1), (2, 2)):
        mesh = bj.make_mesh(bj.Topology(attn_dp=dp, attn_tp=tp))
        model = load_model(GOLDEN / "arcee", mesh, BuildOptions(lora=spec))
        trainer = Trainer(model, mesh, OPTIMIZER, trainable=is_lora_parameter)
        trainer.metrics = trainer.step(trainer.pack(SEQUENCES, adapters=[1] * len(SEQUENCES)))
        trained.append(trainer)
    one, sharded = trained
    assert one.metrics == pytest.approx(sharded.metrics, rel=1e-5)
    assert "layers.0.mlp.up_lora.a" in sharded.state.params
    for path, want in one.state.params.items():
        got = np.asarray(sharded.state.params[path])
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-6, err_msg=path)
    write_peft_adapter(sharded.state.params, spec, tmp_path, alpha=ALPHA, base="arcee")
    mesh = bj.make_mesh(bj.Topology(attn_tp=2))
    loaded = ShardedCausalLM(load_model(GOLDEN / "arcee", mesh, adapters={"t": tmp_path}), mesh)
    want = ShardedCausalLM(sharded.model, sharded.mesh).forward(SEQUENCES, adapters=[1, 0, 1, 1])
    got = loaded.forward(SEQUENCES, adapters=["t", None, "t", "t"])
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
