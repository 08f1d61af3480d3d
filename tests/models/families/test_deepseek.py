"""DeepSeek-V2 and DeepSeek-V3 decoders on boundaries equal transformers (golden files) under TP,
attention DP (the dense FFN fully data-parallel too), expert parallelism in both dispatch modes
and input-scattered rows; decode runs absorbed over a latent-only cache; mutants of the latent
norm, the RoPE slice, the correction bias and the data-parallel FFN's sum are caught; one optax
step on DP 2 x TP 2 with EP 4 equals one device's, the correction bias untouched; configs and
checkpoints read and write back; `plan` reports the latent cache."""

import dataclasses
import functools
import json
import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import boundary_jax as bj
import models.layers.moe.deepseek_router
from models.build import build_model, load_model
from models.cli.main import main
from models.config import PRESETS, hf_name_map, read_hf_config, write_hf_config
from models.families.deepseek import DeepseekV3ForCausalLM
from models.layers.attention.latent import LatentCache, MultiHeadLatentAttention
from models.layers.moe.routing import Routing
from models.options import BuildOptions
from models.pipeline import PipelineCausalLM, load_pipeline
from models.pipeline.split import PipelineSplit
from models.serving.runtime import ShardedCausalLM
from models.training.trainer import TrainConfig, Trainer
from models.weights import load_config, save_checkpoint
from tests.models import MoeLayout, randomize_norms
from tests.models.layers.attention.test_mla import golden as golden_modules
from tests.models.layers.attention.test_mla import hf_attention, run_attention
from tests.models.layers.moe.test_deepseek_moe import hf_moe

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
GATHER, ALL_TO_ALL = bj.MoeDispatch.GATHER, bj.MoeDispatch.ALL_TO_ALL


V3_LAYOUTS = (
    MoeLayout(1, 1),
    MoeLayout(1, 4, ep=4, scattered=True),
    MoeLayout(2, 2, ep=4, dispatch=ALL_TO_ALL),
    MoeLayout(2, 4, dense_ffn_dp=True),
)
"""The layouts of issue 21, joined where one run shows several: TP 1; input-scattered TP 4
with EP 4 gather; attention DP 2 x TP 2 with EP 4 all-to-all; attention DP 2 x TP 4 with the
dense FFN fully data-parallel (and each expert's width split over the 8 ranks)."""
V2_LAYOUTS = (
    MoeLayout(1, 1),
    MoeLayout(1, 4, ep=4),
    MoeLayout(2, 2, ep=4, dispatch=ALL_TO_ALL, scattered=True),
)
DEFAULT_CASES = {("deepseek_v3", layout) for layout in V3_LAYOUTS[2:]} | {
    ("deepseek_v2", V2_LAYOUTS[-1])
}
CASES = [
    pytest.param(
        name,
        layout,
        id=f"{name}-{layout}",
        marks=[] if (name, layout) in DEFAULT_CASES else [pytest.mark.slow],
    )
    for name, layouts in (
        ("deepseek_v3", V3_LAYOUTS),
        ("deepseek_v2", V2_LAYOUTS),
    )
    for layout in layouts
]
"""V3 (q LoRA, the correction bias, MTP tensors) on every layout; V2 (no q LoRA, softmax
routing, two shared experts) on TP 1, TP 4 with EP 4 gather (ordinary rows) and
input-scattered DP 2 x TP 2 with EP 4 all-to-all. By default V3 on its two attention-DP layouts
and V2 on the last; the rest under -m slow."""


@functools.cache
def golden(name: str) -> tuple[list[list[int]], dict[str, np.ndarray]]:
    prompts = json.loads((GOLDEN / name / "prompts.json").read_text())
    return prompts, dict(np.load(GOLDEN / name / "reference.npz"))


@functools.cache
def runner(name: str, layout: MoeLayout) -> ShardedCausalLM:
    mesh = layout.mesh()
    model = load_model(
        GOLDEN / name,
        mesh,
        BuildOptions(moe_dispatch=layout.dispatch, dense_ffn_dp=layout.dense_ffn_dp),
        moe_ep=layout.ep,
    )
    return ShardedCausalLM(model, mesh, input_scattered=layout.scattered)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def teacher_forced(name: str) -> list[list[int]]:
    """Each prompt followed by all but the last of transformers' greedy tokens: its logits at
    the prompt's rows are the reference logits, and its argmax from the prompt's last row on
    is the greedy continuation, in one forward."""
    prompts, reference = golden(name)
    return [p + list(g[:-1]) for p, g in zip(prompts, reference["generated"].tolist(), strict=True)]


def check_against_transformers(name: str, logits: np.ndarray) -> None:
    """`logits` of `teacher_forced(name)`: float32 logits within 1e-4 (relative to the largest)
    of HF's on the prompts, zero past each end, and HF's greedy tokens as argmax."""
    _, reference = golden(name)
    lengths, generated = reference["lengths"], reference["generated"]
    steps = generated.shape[1]
    want = reference["logits"]
    prompt_logits = np.stack([logits[i, : want.shape[1]] for i in range(len(lengths))])
    prompt_logits = np.where(
        np.arange(want.shape[1])[None, :, None] < lengths[:, None, None], prompt_logits, 0
    )
    assert relative_error(prompt_logits, want) <= 1e-4
    for index, length in enumerate(lengths):
        assert not np.any(logits[index, length + steps - 1 :])
        greedy = np.argmax(logits[index, length - 1 : length + steps - 1], axis=-1)
        np.testing.assert_array_equal(greedy, generated[index])


@pytest.mark.parametrize("name,layout", CASES)
def test_logits_and_greedy_tokens_match_transformers(name, layout):
    """HF's logits within 1e-4 and HF's greedy tokens (teacher-forced) on every layout."""
    check_against_transformers(name, runner(name, layout).forward(teacher_forced(name)))


@pytest.mark.parametrize(
    "name,sizes,ep",
    [
        pytest.param("deepseek_v3", (1, 3), 2, marks=pytest.mark.slow),
        pytest.param("deepseek_v2", (2, 2), 1, marks=pytest.mark.slow),
    ],
)
def test_pipeline_stages_match_transformers(name, sizes, ep):
    """Two pipeline stages on attention TP 2 (V3: the dense first layer alone, then the MoE
    layers with EP 2 all-to-all), two microbatches, each stage holding its own layers' latent
    caches: HF's logits and greedy tokens (teacher-forced), and `generate` over the stages'
    latent caches gives HF's tokens."""
    mesh = bj.make_mesh(bj.Topology(attn_tp=2, pp=2, moe_ep=ep))
    options = BuildOptions(moe_dispatch=ALL_TO_ALL if ep > 1 else GATHER)
    split = PipelineSplit.of_sizes(sizes, sum(sizes))
    stages = load_pipeline(GOLDEN / name, mesh, options, split=split, moe_ep=ep)
    run = PipelineCausalLM(stages, mesh, microbatches=2)
    check_against_transformers(name, run.forward(teacher_forced(name)))
    prompts, reference = golden(name)
    tokens = run.generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens, reference["generated"])


def test_greedy_decode_over_the_latent_cache_matches_transformers():
    """`generate` (expanded prefill, then absorbed decode steps over the latent cache) gives
    HF's greedy tokens (the sharded absorbed decode is `test_mla`'s)."""
    prompts, reference = golden("deepseek_v3")
    run = runner("deepseek_v3", MoeLayout(1, 1))
    tokens = run.generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens, reference["generated"])


def test_plan_reports_the_latent_cache_and_the_data_parallel_dense_ffn(capsys):
    """`plan --dense-ffn-dp` reports kv_lora_rank + qk_rope_head_dim values per token and
    layer, and every device's cache shard takes exactly that (no per-head key or value); the
    dense layer's FFN runs on each rank's own rows and its exit sums nothing."""
    config = load_config(GOLDEN / "deepseek_v3")
    mla = config.mla
    per_token = (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4
    assert per_token < 2 * mla.num_heads * mla.qk_head_dim * 4 // 4  # below even TP 4's KV
    args = ["plan", "--checkpoint", str(GOLDEN / "deepseek_v3"), "--mesh", "attn_dp=2,attn_tp=4"]
    assert main([*args, "--dense-ffn-dp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["decode_cache"] == {
        "kind": "LatentCache",
        "bytes_per_token_per_layer": per_token,
        "bytes_per_token": per_token * config.num_layers,
    }
    dense = next(s for s in report["stages"] if (s["layer"], s["stage"]) == (0, "ffn"))
    assert dense["compute_rows"] == "{ATTN_DP, ATTN_TP}"
    assert [option["runs"] for option in dense["exit_options"]] == ["nothing"]
    for layout in (MoeLayout(1, 4, ep=4, scattered=True), MoeLayout(2, 4, dense_ffn_dp=True)):
        caches = runner("deepseek_v3", layout).new_caches(slots_per_rank=3, max_len=16)
        assert all(isinstance(cache, LatentCache) for cache in caches)
        for cache in caches:
            for shard in cache.latent.addressable_shards:
                assert shard.data.nbytes == 3 * 16 * per_token


# --------------------------------------------------------------------------------------------
# Mutants
# --------------------------------------------------------------------------------------------


def attention_error(name: str) -> float:
    """Golden layer 1's MLA on one device against transformers' attention output."""
    _, _, modules = golden_modules(name)
    attn = hf_attention(name, bj.Topology())
    rows = len(modules["positions"])
    got = run_attention(attn, 1, 1, modules["attn_in_1"], modules["positions"], modules["segments"])
    assert got.shape[0] == rows
    return relative_error(np.asarray(got), modules["attn_out_1"])


def latent_with(*, norm_times: int = 1, rope_from_front: bool = False):
    """`MultiHeadLatentAttention._latent` with the kv norm applied `norm_times` times, or the
    rope key read from the front of kv_a's output instead of after the latent."""

    def latent(self, h, positions):
        compressed = self.kv_a_proj_with_mqa(h)
        rank, rope = self.config.kv_lora_rank, self.config.qk_rope_head_dim
        c = compressed[:, :rank]
        for _ in range(norm_times):
            c = self.kv_a_layernorm(c)
        key = compressed[:, :rope] if rope_from_front else compressed[:, rank:]
        k_rope = self._rope(key[:, None], positions)[:, 0]
        return jnp.concatenate([c, k_rope.astype(c.dtype)], axis=-1)

    return latent


def test_mutant_latent_is_caught(monkeypatch):
    """The latent norm skipped or applied twice, or the rope key taken from the wrong slice,
    moves the attention away from transformers'; the honest one stays on it."""
    assert attention_error("deepseek_v3") < 1e-5
    for mutant in ({"norm_times": 0}, {"norm_times": 2}, {"rope_from_front": True}):
        monkeypatch.setattr(MultiHeadLatentAttention, "_latent", latent_with(**mutant))
        assert attention_error("deepseek_v3") > 1e-2, mutant


def test_mutant_correction_bias_in_the_weights_is_caught(monkeypatch):
    """V3's bias only picks experts: weights taken from the biased scores move the MoE's
    output away from transformers'."""
    honest = models.layers.moe.deepseek_router.deepseek_route
    module = hf_moe("deepseek_v3")
    x, want = (golden_modules("deepseek_v3")[2][key] for key in ("moe_in_1", "moe_out_1"))

    def moe_error() -> float:
        return relative_error(np.asarray(jax.jit(lambda m, x: m.finalized(x))(module, x)), want)

    def biased(x, router, bias, rule):
        routing = honest(x, router, bias, rule)
        scores = jax.nn.sigmoid(x.astype(jnp.float32) @ router) + bias[None, :]
        weights = jnp.take_along_axis(scores, routing.experts, axis=-1)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True) * rule.scaling_factor
        return Routing(weights, routing.experts)

    assert moe_error() < 1e-5
    monkeypatch.setattr(models.layers.moe.deepseek_router, "deepseek_route", biased)
    assert moe_error() > 1e-2


def test_correction_bias_gets_no_gradient():
    """The bias only picks experts (an integer choice), so the routing weights, and any loss of
    them, have zero gradient in it, while the router's kernel has one."""
    module = hf_moe("deepseek_v3")
    x = golden_modules("deepseek_v3")[2]["moe_in_1"]

    def weighted(router, bias):
        routing = models.layers.moe.deepseek_router.deepseek_route(x, router, bias, module.rule)
        return jnp.sum(routing.weights * jnp.arange(1.0, 4.0)[None, :] ** 2)

    router_grad, bias_grad = jax.grad(weighted, argnums=(0, 1))(
        module.router[...], module.e_score_correction_bias[...]
    )
    assert not np.any(bias_grad) and np.max(np.abs(router_grad)) > 1e-3


class SummedDenseFfn(DeepseekV3ForCausalLM):
    """The mutant: dense layers built whole on every rank (data-parallel weights) but declared
    as an FFN over the TP group, so the boundary sums their complete outputs over TP."""

    def stage_facts(self, layer_index, stages=None):
        attn, ffn = super().stage_facts(layer_index, stages)
        if ffn.dense_tp_size == 1:
            ffn = (self.design.facts() if stages is None else stages).ffn.declare_ffn()
        return attn, ffn


def test_mutant_dense_ffn_summed_over_tp_is_caught():
    """A fully data-parallel dense FFN whose output is summed over TP (counted tp times)
    gives logits far from HF's."""
    layout = MoeLayout(2, 4, dense_ffn_dp=True)
    honest = runner("deepseek_v3", layout).model
    assert honest.layers[0].mlp.gate_up_proj.kernel.sharding.spec == jax.sharding.PartitionSpec(
        None, None, None
    )
    mesh = layout.mesh()
    graphdef, state = nnx.split(honest)
    abstract = nnx.eval_shape(
        lambda: SummedDenseFfn(
            honest.config, honest.topology, BuildOptions(dense_ffn_dp=True), rngs=nnx.Rngs(0)
        )
    )
    mutant = nnx.merge(nnx.split(abstract)[0], state)
    del graphdef
    logits = ShardedCausalLM(mutant, mesh).forward(golden("deepseek_v3")[0])
    assert relative_error(logits, golden("deepseek_v3")[1]["logits"]) > 1e-2


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

TRAIN_CONFIG = dataclasses.replace(PRESETS["tiny-deepseek-v3"], num_layers=2)
OPTIMIZER = TrainConfig(learning_rate=1e-2, total_steps=10, warmup_steps=0, eps=1e-3)
SEQUENCES = [list(np.random.default_rng(5).integers(0, 256, n)) for n in (13, 7, 9, 4, 11, 6)]


@functools.cache
def one_step(layout: MoeLayout) -> dict:
    """Initial and updated parameters and the loss of one step of the preset's first two layers
    (one dense, one sparse)."""
    topology = bj.Topology(attn_dp=layout.dp, attn_tp=layout.tp, moe_ep=layout.ep)
    model = build_model(
        TRAIN_CONFIG,
        topology,
        BuildOptions(moe_dispatch=layout.dispatch, dense_ffn_dp=layout.dense_ffn_dp),
    )
    randomize_norms(model, seed=3)
    trainer = Trainer(model, layout.mesh(), OPTIMIZER.optimizer())
    batch = trainer.pack(SEQUENCES)
    initial = jax.tree.map(np.asarray, trainer.state.params)
    metrics = trainer.step(batch)
    return {
        "frozen": trainer.frozen,
        "initial": initial,
        "loss": metrics["loss"],
        "params": jax.tree.map(np.asarray, trainer.state.params),
    }


@pytest.mark.slow
def test_one_step_on_dp2_tp2_ep4_equals_the_single_device_step():
    """DP 2 x TP 2, experts over EP 4 all-to-all and the dense FFN data-parallel: the loss and
    every updated parameter within 1e-5 of one device's; every parameter moved but the
    correction biases, which get no update (no weight decay either)."""
    got = one_step(MoeLayout(2, 2, ep=4, dispatch=ALL_TO_ALL, dense_ffn_dp=True))
    want = one_step(MoeLayout(1, 1))
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["frozen"] == want["frozen"] == {"layers.1.mlp.e_score_correction_bias"}
    for path, value in want["params"].items():
        error = relative_error(got["params"][path], value)
        assert error < 1e-5, (path, error)
        moved = relative_error(value, want["initial"][path])
        if path in want["frozen"]:
            assert moved == 0, path
        else:
            assert moved > 1e-3, path


# --------------------------------------------------------------------------------------------
# Configs, names and the command line
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_config_reads_writes_back_and_names_every_tensor(name, caplog):
    """The golden config reads as transformers runs it and writes back to itself; the name map
    covers every checkpoint tensor but the MTP layer's, which loading skips with one notice."""
    raw = json.loads((GOLDEN / name / "config.json").read_text())
    config = read_hf_config(raw)
    assert read_hf_config(write_hf_config(config)) == config
    assert config.moe.mlp_only_layers == (0,) and config.sparse_layers == (False, True, True, True)
    assert config.mla.q_lora_rank == raw["q_lora_rank"]
    shared = raw["n_shared_experts"] * raw["moe_intermediate_size"]
    assert config.moe.shared_expert_intermediate_size == shared
    names = {n for source in hf_name_map(config).values() for n in source.tensor_names()}
    stored = set(load_file(str(GOLDEN / name / "model.safetensors")))
    mtp = {n for n in stored if n.startswith("model.layers.4.")}
    assert names == stored - mtp
    assert bool(mtp) == (name == "deepseek_v3")
    with caplog.at_level(logging.WARNING):
        load_model(GOLDEN / name, MoeLayout(1, 1).mesh())
    notices = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.message]
    assert len(notices) == bool(mtp) and all("[4]" in n for n in notices)


@pytest.mark.slow
def test_trained_checkpoint_keeps_its_biases_and_reads_back(tmp_path):
    """The sharded step's parameters written as a Hugging Face checkpoint: its config reads
    back, its correction bias is the untrained one, its router the trained one."""
    trained = one_step(MoeLayout(2, 2, ep=4, dispatch=ALL_TO_ALL, dense_ffn_dp=True))
    save_checkpoint(TRAIN_CONFIG, trained["params"], tmp_path)
    assert load_config(tmp_path) == TRAIN_CONFIG
    saved = load_file(str(tmp_path / "model.safetensors"))
    bias = saved["model.layers.1.mlp.gate.e_score_correction_bias"]
    np.testing.assert_array_equal(bias, trained["initial"]["layers.1.mlp.e_score_correction_bias"])
    router = saved["model.layers.1.mlp.gate.weight"].T
    np.testing.assert_array_equal(router, trained["params"]["layers.1.mlp.router"])
