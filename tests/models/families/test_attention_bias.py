"""`attention_bias` as transformers reads it: a bias on the q, k, v and o projections alike in
the families whose attention takes that key (the o bias added once in its sum over attention
TP), ignored by those whose attention has fixed biases; random configs of each matched
transformers on TP 1, TP 2 and DP 2 x TP 2 (closing note of 2026-12-05)."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest

import boundary_jax as bj
from models.build import build_model
from models.config import PRESETS, hf_name_map, read_hf_config, write_hf_config
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

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


@pytest.mark.parametrize("name", ["llama", "arcee"])
def test_mlp_bias_is_refused_where_transformers_computes_it(name):
    with pytest.raises(ValueError, match="mlp_bias=true is not supported"):
        read_hf_config(golden_config(name) | {"mlp_bias": True})


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(read_hf_config(golden_config("llama") | {"attention_bias": True}), id="llama"),
        pytest.param(
            dataclasses.replace(PRESETS["tiny-qwen3-next"], qkv_bias=True, o_bias=True),
            id="qwen3-next-gated",
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
