"""Random models: every parameter drawn from the abstract state by its own key, the same values on
every mesh, without one and scanned; initialized as Hugging Face initializes the family; a fresh
preset's first training loss near ln(vocab)."""

import dataclasses
import json
import math
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import boundary_jax as bj
from models.build import build_model
from models.config import PRESETS, read_hf_config
from models.options import BuildOptions
from models.training.trainer import Trainer
from models.weights.initialization import param_draws, sharded_initializer

GOLDEN = Path(__file__).parents[1] / "golden"
RNG = np.random.default_rng(5)


def flat_values(model: nnx.Module) -> dict[tuple, np.ndarray]:
    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model))}


def golden_config(name: str):
    return read_hf_config(json.loads((GOLDEN / name / "config.json").read_text()))


def test_build_on_a_mesh_creates_sharded_weights_equal_to_the_plain_build():
    """build_model(mesh=) gives the same values as the one-device build, already sharded."""
    config = PRESETS["tiny-qwen3"]
    topology = bj.Topology(attn_tp=4)
    mesh = bj.make_mesh(topology)
    placed = nnx.state(build_model(config, topology, mesh=mesh))
    plain = dict(nnx.to_flat_state(nnx.state(build_model(config, topology))))
    for path, variable in nnx.to_flat_state(placed):
        value = variable[...]
        assert isinstance(value.sharding, jax.sharding.NamedSharding)
        # Bitwise equal on CPU today; the tolerance leaves XLA free to fuse the scaling apart.
        np.testing.assert_allclose(
            np.asarray(value), np.asarray(plain[path][...]), rtol=1e-6, atol=1e-7
        )
    table = placed["embed"]["embedding"][...]
    assert table.addressable_shards[0].data.shape[0] == table.shape[0] // 4


def test_a_seed_gives_the_same_values_on_every_topology_and_scanned():
    """Parameters are drawn at their global shapes, so the topology (experts over EP too) does
    not change them, nor does stacking a run of layers; another seed changes every draw."""
    config = dataclasses.replace(PRESETS["tiny-qwen3-moe"], num_layers=5)
    want = flat_values(build_model(config, bj.Topology()))
    split = flat_values(build_model(config, bj.Topology(attn_dp=2, attn_tp=2, moe_ep=4)))
    assert split.keys() == want.keys()
    for path, value in split.items():
        np.testing.assert_array_equal(value, want[path], err_msg=str(path))
    scanned = build_model(config, bj.Topology(), BuildOptions(scan_layers=True))
    for layers, block in scanned.blocks():
        state = flat_values(block.layer if isinstance(block, bj.StackedLayers) else block)
        for path, value in state.items():
            stack = value if isinstance(block, bj.StackedLayers) else value[None]
            for offset, layer in enumerate(layers):
                np.testing.assert_array_equal(stack[offset], want[("layers", layer, *path)])
    other = flat_values(build_model(config, bj.Topology(), seed=1))
    for path, value in other.items():
        if np.std(value) > 0:  # every random draw, not the norms' ones
            assert not np.array_equal(value, want[path]), path


def test_one_initializer_draws_each_unit_once_whatever_the_layer_count():
    """The sharded initializer holds one random draw per parameter shape (all layers' slices of
    it batched, under one optimization barrier), so its program does not grow with the layers:
    XLA cannot merge the layers' draws into a few kernels that compile slowly."""
    topology = bj.Topology(attn_tp=2)
    mesh = bj.make_mesh(topology)
    counts = []
    for layers in (2, 5):
        config = dataclasses.replace(PRESETS["tiny-mistral"], num_layers=layers)
        model = nnx.eval_shape(lambda config=config: build_model(config, topology))
        draws = param_draws(nnx.state(model), config.layer_blocks(False))
        traced = sharded_initializer(draws, mesh).trace(jax.random.key(0))
        units = len({(draw.unit, draw.unit_spec) for draw in draws})
        assert traced.lower().as_text().count("stablehlo.optimization_barrier") == units
        counts.append((len(draws), str(traced.jaxpr).count("random_bits")))
    (few, few_draws), (many, many_draws) = counts
    assert many > few and many_draws == few_draws > 0


@pytest.mark.slow
def test_draws_past_the_batch_bytes_come_in_smaller_batches_with_the_same_values():
    """Units larger than a share of `max_batch_bytes` are drawn in batches of fewer layers, one
    batch after another, so the initializer's temporaries stay within about one batch (they
    held every layer's expert units at once: more than an 80 GB GPU gives JAX for GPT-OSS-20B);
    the values are those of one batch per unit."""
    gpt_oss = PRESETS["tiny-gpt-oss"]
    config = dataclasses.replace(gpt_oss, num_layers=2, layer_types=gpt_oss.layer_types[:2])
    topology = bj.Topology(attn_tp=2)
    mesh = bj.make_mesh(topology)
    model = nnx.eval_shape(lambda: build_model(config, topology))
    draws = param_draws(nnx.state(model), config.layer_blocks(False))
    largest = max(int(np.prod(d.unit[0])) * np.dtype(d.dtype).itemsize for d in draws)
    lowered = [
        sharded_initializer(draws, mesh, cap).lower(jax.random.key(3))
        for cap in (64 * largest, largest)
    ]
    batches = [low.as_text().count("stablehlo.optimization_barrier") for low in lowered]
    units = len({(draw.unit, draw.unit_spec) for draw in draws})
    assert batches[0] == units < batches[1]
    whole, capped = (low.compile() for low in lowered)
    temp = [c.memory_analysis().temp_size_in_bytes for c in (whole, capped)]
    assert temp[1] < temp[0] / 2, temp
    for got, want in zip(capped(jax.random.key(3)), whole(jax.random.key(3)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_initializers_follow_hugging_face():
    """Projections and embeddings ~ N(0, initializer_range); norms ones (Gemma's `1 + w` norms
    zeros); q/k/v biases small but nonzero (a dropped bias shows); vocab padding zero."""
    qwen2 = golden_config("qwen2")
    model = build_model(qwen2, bj.Topology(attn_tp=4))
    real = qwen2.vocab_size  # 250 rows, padded to 252 to split over attention TP 4
    std = qwen2.initializer_range
    attn = model.layers[0].attn
    for weight in (attn.q_proj.kernel, attn.kv_proj.kernel, model.layers[0].mlp.down_proj.kernel):
        assert abs(float(np.std(weight[...])) / std - 1) < 0.15
    for bias in (attn.q_proj.bias, attn.kv_proj.bias):
        assert 0.5 * std < float(np.std(bias[...])) < 1.5 * std
    table = np.asarray(model.embed.embedding[...])
    assert table.shape[0] > real
    assert abs(float(np.std(table[:real])) / std - 1) < 0.15
    np.testing.assert_array_equal(table[real:], 0)
    np.testing.assert_array_equal(model.layers[0].input_norm.weight[...], 1)
    np.testing.assert_array_equal(model.final_norm.weight[...], 1)
    gemma = build_model(golden_config("gemma3"), bj.Topology())
    for norm in (gemma.layers[0].input_norm, gemma.layers[0].attn.q_norm, gemma.final_norm):
        np.testing.assert_array_equal(norm.weight[...], 0)


# By default a dense preset and an MoE with FP8 weights; the other presets (MLA, hybrids, the
# same families' initializers at other sizes, without FP8 or with sliding windows) under
# -m slow.
FRESH_DEFAULT = {"tiny-qwen3", "tiny-qwen3-moe-fp8"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[] if name in FRESH_DEFAULT else [pytest.mark.slow])
        for name in sorted(PRESETS)
    ],
)
def test_a_fresh_preset_starts_near_the_uniform_loss(name):
    """A fresh preset model predicts nearly uniformly: its first training loss is within 0.5 of
    ln(vocab size) (an N(0, 1) embedding tied to the head started tiny-qwen3 at 36)."""
    config = PRESETS[name]
    model = build_model(config, bj.Topology())
    trainer = Trainer(model, bj.make_mesh(bj.Topology()), optax.sgd(0.0))
    sequences = [list(RNG.integers(0, config.vocab_size, n)) for n in (24, 17, 9)]
    loss = trainer.loss(trainer.pack(sequences))
    assert abs(loss - math.log(config.vocab_size)) < 0.5, loss
