"""Training through the boundaries: one optax step on every simulated mesh equals the
single-device step (weights differ per rank, norms random), for a dense and an MoE decoder; the
loss equals the cross-entropy of the gathered logits without gathering them; the global norm
counts each parameter once; a train state saved on one mesh restores on another."""

import dataclasses
import functools
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
import pallas_kernels as pk
from models.build import build_model, load_model
from models.config import PRESETS
from models.families.qwen3_moe import Qwen3MoeForCausalLM
from models.inputs.rows import pack_sequences
from models.layers.attention.self_attention import AttentionImpl
from models.layers.hyper_connections import HyperConnections
from models.layers.moe.sparse import GroupedMatmulImpl
from models.options import BuildOptions, Remat
from models.serving.runtime import ShardedCausalLM
from models.training.trainer import TrainConfig, Trainer, next_token_labels
from tests.models import randomize_norms

GATHER, ALL_TO_ALL = bj.MoeDispatch.GATHER, bj.MoeDispatch.ALL_TO_ALL
MODELS = {
    "dense": (dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=2), BuildOptions()),
    "moe": (dataclasses.replace(PRESETS["tiny-qwen3-moe"], num_layers=3), BuildOptions()),
    "mhc": (
        dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=2),
        BuildOptions(hyper_connections=HyperConnections(hc_mult=2, sinkhorn_iters=3)),
    ),
}
"""The model families every layout trains: (config, build_model options)."""
# eps 1e-3: Adam's first step is ~sign(gradient) where |gradient| >> eps, so a float32
# rounding of a near-zero gradient would flip a weight's step; the larger eps keeps the step a
# smooth function of the gradient, so a relative tolerance can hold it.
OPTIMIZER = TrainConfig(learning_rate=1e-2, total_steps=10, warmup_steps=0, eps=1e-3)
RNG = np.random.default_rng(7)
SEQUENCES = [list(RNG.integers(0, 256, n)) for n in (13, 7, 9, 4, 11, 6)]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout to train on."""

    dp: int
    tp: int
    ep: int = 1
    dispatch: bj.MoeDispatch | None = None
    scattered: bool = False

    def __str__(self) -> str:
        parts = [f"DP{self.dp}xTP{self.tp}"]
        if self.dispatch is not None:
            parts += [f"EP{self.ep}", self.dispatch.value]
        return "-".join(parts + ["scattered"] * self.scattered)


SINGLE = Layout(1, 1)
SLOW = pytest.mark.slow
# By default one MoE layout that covers DP x TP, input-scattered rows and EP all-to-all at the
# largest EP (4) (the Pallas test below steps the MoE gathered on TP 2); the other layouts (the
# dense ones, EP gather, EP 2 all-to-all with each expert's width split, MHC) under -m slow.
CASES = [
    pytest.param("dense", Layout(1, 2), id="dense-TP2", marks=SLOW),
    pytest.param("dense", Layout(1, 4), id="dense-TP4", marks=SLOW),
    pytest.param("dense", Layout(1, 8), id="dense-TP8", marks=SLOW),
    pytest.param("dense", Layout(4, 2), id="dense-DP4xTP2", marks=SLOW),
    pytest.param("dense", Layout(2, 2, scattered=True), id="dense-DP2xTP2-scattered", marks=SLOW),
    pytest.param("dense", Layout(1, 4, scattered=True), id="dense-TP4-scattered", marks=SLOW),
    pytest.param("moe", Layout(1, 4, ep=4, dispatch=GATHER), id="moe-TP4-EP4-gather", marks=SLOW),
    pytest.param(
        "moe", Layout(2, 2, ep=2, dispatch=GATHER), id="moe-DP2xTP2-EP2-gather", marks=SLOW
    ),
    pytest.param(
        "moe", Layout(1, 4, ep=4, dispatch=ALL_TO_ALL), id="moe-TP4-EP4-all-to-all", marks=SLOW
    ),
    pytest.param(
        "moe",
        Layout(2, 2, ep=4, dispatch=ALL_TO_ALL, scattered=True),
        id="moe-DP2xTP2-EP4-all-to-all-scattered",
    ),
    pytest.param(
        "moe",
        Layout(2, 2, ep=2, dispatch=ALL_TO_ALL),
        id="moe-DP2xTP2-EP2-all-to-all-width",
        marks=SLOW,
    ),
    pytest.param("mhc", Layout(2, 2), id="mhc-DP2xTP2", marks=SLOW),
    pytest.param("mhc", Layout(1, 4, scattered=True), id="mhc-TP4-scattered", marks=SLOW),
]


def make_trainer(name: str, layout: Layout, **changes) -> Trainer:
    """A trainer of model `name` (its config with `changes`) on `layout`, its weights the same
    global values on every mesh (split differently per rank), its norms random."""
    topology = bj.Topology(attn_dp=layout.dp, attn_tp=layout.tp, moe_ep=layout.ep)
    config, options = MODELS[name]
    config = dataclasses.replace(config, **changes)
    model = build_model(config, topology, options.replace(moe_dispatch=layout.dispatch))
    randomize_norms(model, seed=3)
    mesh = bj.make_mesh(topology)
    return Trainer(model, mesh, OPTIMIZER.optimizer(), input_scattered=layout.scattered)


@functools.cache
def one_step(name: str, layout: Layout, max_sequence_rows: int | None = None) -> dict:
    """Initial and updated parameters, loss and gradient norm of one step on SEQUENCES."""
    trainer = make_trainer(name, layout)
    batch = trainer.pack(SEQUENCES, max_sequence_rows=max_sequence_rows)
    initial = jax.tree.map(np.asarray, trainer.state.params)
    metrics = trainer.step(batch)
    return {
        "initial": initial,
        "metrics": metrics,
        "params": jax.tree.map(np.asarray, trainer.state.params),
    }


def worst_relative(got: dict, want: dict) -> tuple[str, float]:
    """The parameter whose values differ most, relative to its largest magnitude."""
    assert got.keys() == want.keys()
    errors = {
        path: float(np.max(np.abs(got[path] - want[path])) / max(np.max(np.abs(want[path])), 1e-30))
        for path in want
    }
    return max(errors.items(), key=lambda item: item[1])


@pytest.mark.parametrize("name,layout", CASES)
def test_one_step_equals_single_device(name, layout):
    """The loss, the gradients' global norm (what clipping reads: every parameter counted
    once) and every updated parameter within 1e-5 (relative) of one device."""
    got, want = one_step(name, layout), one_step(name, SINGLE)
    assert got["metrics"]["loss"] == pytest.approx(want["metrics"]["loss"], rel=1e-5)
    assert got["metrics"]["grad_norm"] == pytest.approx(want["metrics"]["grad_norm"], rel=1e-5)
    path, error = worst_relative(got["params"], want["params"])
    assert error < 1e-5, (path, error)
    # The step moved every weight array, so the comparison above is not vacuous.
    for path in want["params"]:
        assert (
            worst_relative({path: want["params"][path]}, {path: want["initial"][path]})[1] > 1e-4
        ), path


@pytest.mark.slow
def test_a_sequence_bound_steps_like_the_unbounded_single_device():
    """Packed with `max_sequence_rows=13` (the longest sequence), the 52 rows attend in key
    blocks of 16 rows, two per query block; input-scattered TP 4 then steps like one device
    without the bound."""
    got, want = one_step("dense", Layout(1, 4, scattered=True), 13), one_step("dense", SINGLE)
    assert got["metrics"]["loss"] == pytest.approx(want["metrics"]["loss"], rel=1e-5)
    path, error = worst_relative(got["params"], want["params"])
    assert error < 1e-5, (path, error)


def test_loss_is_the_cross_entropy_of_the_gathered_logits():
    """The sharded loss (logits never gathered) equals log-softmax cross-entropy of the full
    logits of the serving forward, over every labelled row."""
    layout = Layout(2, 4)
    trainer = make_trainer("dense", layout)
    packed = pack_sequences(SEQUENCES, trainer.topology)
    runner = ShardedCausalLM(trainer.model, trainer.mesh)
    logits = np.asarray(runner.forward_rows(packed), np.float64)
    labels = next_token_labels(packed)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.flatnonzero(labels >= 0)
    want = -np.mean(log_probs[rows, labels[rows]])
    assert rows.size == sum(len(s) - 1 for s in SEQUENCES)
    assert trainer.loss(trainer.place(packed)) == pytest.approx(want, rel=1e-5)
    loss_hlo = jax.jit(trainer.sharded_loss).lower(trainer.state.params, trainer.place(packed))
    forward_hlo = runner.lower_forward(SEQUENCES)
    # The serving forward gathers [rows, 256] logits; the loss gathers nothing of vocab width.
    assert vocab_gathers(forward_hlo.compile().as_text())
    assert not vocab_gathers(loss_hlo.compile().as_text())


def vocab_gathers(hlo: str) -> list[str]:
    """The compiled HLO's all-gathers whose result is vocabulary-wide (256 columns)."""
    return [line for line in hlo.splitlines() if "all-gather(" in line and ",256]" in line]


@pytest.mark.slow
def test_remat_gives_the_same_gradients_with_less_memory():
    """Per-layer remat (FULL, DOTS) gives the gradients of no remat (float32, 1e-5) while the
    compiled backward's temporary memory shrinks."""
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    mesh = bj.make_mesh(topology)
    sequences = [list(RNG.integers(0, 256, 64)) for _ in range(4)]
    grads, temp = {}, {}
    for remat in Remat:
        model = build_model(MODELS["dense"][0], topology, BuildOptions(remat=remat))
        trainer = Trainer(model, mesh, OPTIMIZER.optimizer())
        batch = trainer.pack(sequences)
        compiled = (
            jax.jit(jax.value_and_grad(trainer.sharded_loss))
            .lower(trainer.state.params, batch)
            .compile()
        )
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
        grads[remat] = jax.tree.map(np.asarray, compiled(trainer.state.params, batch)[1])
    for remat in (Remat.FULL, Remat.DOTS):
        path, error = worst_relative(grads[remat], grads[Remat.NONE])
        assert error < 1e-5, (remat, path, error)
    # Measured (bytes, none / full / dots): JAX 0.12 on CPU, 4 layers, 8 x 128 tokens: 50.1M /
    # 18.8M / 24.8M. This test's shapes on JAX 0.11.2 (CPU): 2.46M / 1.43M / 2.06M.
    assert temp[Remat.FULL] < 0.8 * temp[Remat.NONE], temp
    assert temp[Remat.DOTS] < temp[Remat.NONE], temp


def test_labels_stop_at_sequence_ends_and_rank_blocks():
    """Each row's label is the next token of its own sequence; a sequence's last row, padding,
    and the last row of a DP rank's full block predict nothing."""
    packed = pack_sequences([[5, 6, 7], [8, 9], [1, 2, 3, 4, 5]], bj.Topology(attn_dp=2))
    np.testing.assert_array_equal(packed.rows.ids, [1, 2, 3, 4, 5, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(next_token_labels(packed), [2, 3, 4, 5, -1, 6, 7, -1, 9, -1])
    packed = pack_sequences([[5, 6, 7], [1, 2]], bj.Topology(attn_dp=2))
    np.testing.assert_array_equal(packed.rows.ids, [5, 6, 7, 1, 2, 0])
    np.testing.assert_array_equal(next_token_labels(packed), [6, 7, -1, 2, -1, -1])


def test_optimizer_state_is_sharded_like_the_parameters():
    """Adam's moments live split exactly as their parameters; the step count is replicated;
    a step donates (reuses) every buffer of the state."""
    trainer = make_trainer("dense", Layout(2, 2))
    params = trainer.state.params
    adam = trainer.state.opt_state[1][0]
    for moments in (adam.mu, adam.nu):
        for path, value in moments.items():
            assert value.sharding == params[path].sharding, path
    assert trainer.state.step.sharding.is_fully_replicated
    before = jax.tree.leaves(trainer.state)
    trainer.step(trainer.pack(SEQUENCES[:2]))
    assert all(leaf.is_deleted() for leaf in before)  # the step donated the whole state


@pytest.mark.slow
def test_saved_state_restores_on_another_mesh_and_continues(tmp_path):
    """A train state saved on DP2 x TP2 after two steps restores onto TP4 (and onto one
    device) and continues with the same losses as the run that never stopped. The vocabulary
    (250) pads to 250 rows on TP2 and to 252 on TP4: the tables are saved cut to 250."""
    first = make_trainer("dense", Layout(2, 2), vocab_size=250)
    sequences = [[t % 250 for t in s] for s in SEQUENCES]
    batch = first.pack(sequences)
    for _ in range(2):
        first.step(batch)
    first.save(tmp_path / "state")
    want = first.step(batch)["loss"]
    for layout in (Layout(1, 4), SINGLE):
        second = make_trainer("dense", layout, vocab_size=250)
        second.restore(tmp_path / "state")
        assert int(second.state.step) == 2
        embedding = np.asarray(second.state.params["embed.embedding"])
        assert embedding.shape[0] == (252 if layout.tp == 4 else 250)
        assert not np.any(embedding[250:])  # the padding rows stay zero
        got = second.step(second.pack(sequences))["loss"]
        assert got == pytest.approx(want, rel=1e-5), layout


def test_train_config_rejects_a_schedule_without_decay():
    with pytest.raises(ValueError, match="warmup_steps < total_steps"):
        TrainConfig(total_steps=2, warmup_steps=2)


def test_trainer_rejects_a_mismatched_mesh_and_cudnn_attention():
    topology = bj.Topology(attn_tp=2)
    model = build_model(MODELS["dense"][0], topology)
    with pytest.raises(ValueError, match="bound on"):
        Trainer(model, bj.make_mesh(bj.Topology(attn_tp=4)), OPTIMIZER.optimizer())
    cudnn = build_model(MODELS["dense"][0], topology, BuildOptions(attention=AttentionImpl.CUDNN))
    with pytest.raises(NotImplementedError, match="cuDNN attention"):
        Trainer(cudnn, bj.make_mesh(topology), OPTIMIZER.optimizer())


@dataclasses.dataclass(frozen=True)
class Taken:
    """A fusion candidate that records, by its kernel's name, each request it takes."""

    inner: object
    taken: list

    def __call__(self, request):
        result = self.inner(request)
        if result is not None:
            self.taken.append(type(self.inner).__name__)
        return result


@pytest.mark.slow
def test_a_step_with_the_pallas_kernels_bound_equals_the_step_without():
    """Trainer takes fusion candidates and Pallas expert kernels (check_vma stays on; each
    kernel differentiates as its reference). The MoE model on TP2 (gather, each expert's width
    split) with every Pallas kernel a model can bind, interpreted (the fused all-reduce / add /
    MoE-finalize + RMSNorm candidates, the Triton expert matmul), steps like the one-device
    model without them: loss, gradient norm and every updated parameter within 1e-5; and the
    kernels ran."""
    layout, taken = Layout(1, 2), []
    topology = bj.Topology(attn_tp=layout.tp)
    offered = bj.fusions.platform_fusions(
        topology, impl=pk.Impl.PALLAS_INTERPRET, moe_finalize=True
    )
    wrap = lambda candidates: tuple(Taken(c, taken) for c in candidates)  # noqa: E731
    fusions = dataclasses.replace(
        offered,
        attn_input=wrap(offered.attn_input),
        ffn_input=wrap(offered.ffn_input),
        final_input=wrap(offered.final_input),
    )
    model = Qwen3MoeForCausalLM(
        MODELS["moe"][0],
        topology,
        BuildOptions(grouped_matmul=GroupedMatmulImpl.PALLAS_INTERPRET, fusions=fusions),
        rngs=nnx.Rngs(0),
    )
    nnx.update(model, nnx.state(build_model(MODELS["moe"][0], topology)))  # make_trainer's draw
    randomize_norms(model, seed=3)
    trainer = Trainer(model, bj.make_mesh(topology), OPTIMIZER.optimizer())
    got = {"metrics": trainer.step(trainer.pack(SEQUENCES)), "params": trainer.state.params}
    got["params"] = jax.tree.map(np.asarray, got["params"])
    want = one_step("moe", SINGLE)
    assert got["metrics"]["loss"] == pytest.approx(want["metrics"]["loss"], rel=1e-5)
    assert got["metrics"]["grad_norm"] == pytest.approx(want["metrics"]["grad_norm"], rel=1e-5)
    path, error = worst_relative(got["params"], want["params"])
    assert error < 1e-5, (path, error)
    # Every input owes a TP sum here, so the plain add + RMSNorm candidate declines throughout
    # (it runs under check_vma in tests/boundary_jax/test_fusions.py).
    assert set(taken) == {"AllReduceAddRmsNorm", "MoeFinalizeAddRmsNorm"}, taken


def test_a_float32_step_multiplies_in_float32():
    """A float32 trainer traces its loss and gradient matmuls at HIGHEST (true float32 where a
    GPU defaults to TF32); the gradient's transposed dots keep the forward's precision."""
    trainer = make_trainer("dense", SINGLE)
    assert trainer.matmul_precision is jax.lax.Precision.HIGHEST
    batch = trainer.pack(SEQUENCES[:2])
    lowered = jax.jit(jax.grad(trainer.sharded_loss)).lower(trainer.state.params, batch)
    dots = [line for line in lowered.as_text().splitlines() if "stablehlo.dot_general" in line]
    assert dots and all("precision = [HIGHEST, HIGHEST]" in line for line in dots)


@pytest.mark.parametrize("golden", ["llama", pytest.param("qwen3", marks=SLOW)])
def test_the_pad_token_row_takes_no_gradient_from_lookups(golden, tmp_path):
    """A checkpoint's pad_token_id is transformers' `nn.Embedding(padding_idx)`: where it
    occurs, its lookups give its row no gradient (llama's untied row none at all), while
    a tied head's gradient still reaches it (qwen3); the rows of the other tokens train."""
    source = pathlib.Path(__file__).parents[2] / "golden" / golden
    checkpoint = tmp_path / golden
    shutil.copytree(source, checkpoint)
    settings = json.loads((checkpoint / "config.json").read_text())
    pad = 8
    (checkpoint / "config.json").write_text(json.dumps(settings | {"pad_token_id": pad}))
    mesh = bj.make_mesh(bj.Topology(attn_tp=2))
    trainer = Trainer(load_model(checkpoint, mesh), mesh, OPTIMIZER.optimizer())
    sequences = [[5, 7, pad, 11, 2, 30, pad], [3, pad, 1], [17, 4, 99, 12]]
    _, grads = trainer.gradients(trainer.pack(sequences))
    table = np.asarray(grads["embed.embedding"])
    assert np.all(table[[3, 5, 7, 11, 17]] != 0)
    if settings["tie_word_embeddings"]:
        plain = Trainer(load_model(source, mesh), mesh, OPTIMIZER.optimizer())
        with_lookups = np.asarray(plain.gradients(plain.pack(sequences))[1]["embed.embedding"])
        assert np.all(table[pad] != 0) and np.max(np.abs(table[pad] - with_lookups[pad])) > 1e-3
    else:
        assert not np.any(table[pad])
