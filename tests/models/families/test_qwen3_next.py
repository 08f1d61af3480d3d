"""Qwen3-Next on boundaries equals Hugging Face transformers (golden files) under TP, attention DP,
expert parallelism and pipeline stages: Gated DeltaNet and gated-attention layers, each before
an MoE and a dense MLP; its config reads back as written, and unbuilt options are refused."""

import functools
import json
import pathlib

import numpy as np
import pytest

import boundary_jax as bj
from models.build import load_model
from models.config import read_hf_config
from models.families.qwen3_next import TINY, Qwen3NextForCausalLM
from models.layers.attention.self_attention import Attention
from models.layers.mixers.gated_deltanet import DeltaCache, GatedDeltaNet
from models.layers.moe.ffn import MoeFfn
from models.options import BuildOptions
from models.pipeline import PipelineCausalLM, load_pipeline
from models.pipeline.split import PipelineSplit
from models.serving.runtime import ShardedCausalLM
from models.weights import load_config
from tests.models import MoeLayout

CHECKPOINT = pathlib.Path(__file__).parents[2] / "golden" / "qwen3_next"

# EP 4 over gathered rows on attention TP 4 (one key head and its 2 value heads per rank, the 2
# kv heads shared by ranks) runs by default; the other layouts under -m slow.
DEFAULT = MoeLayout(1, 4, ep=4)
LAYOUTS = [
    pytest.param(layout, id=str(layout), marks=[] if layout == DEFAULT else [pytest.mark.slow])
    for layout in (MoeLayout(1, 1), MoeLayout(1, 2), MoeLayout(1, 4), MoeLayout(2, 2), DEFAULT)
]


@functools.cache
def golden() -> tuple[list[list[int]], dict[str, np.ndarray]]:
    prompts = json.loads((CHECKPOINT / "prompts.json").read_text())
    return prompts, dict(np.load(CHECKPOINT / "reference.npz"))


@functools.cache
def runner(layout: MoeLayout) -> ShardedCausalLM:
    mesh = bj.make_mesh(bj.Topology(attn_dp=layout.dp, attn_tp=layout.tp, moe_ep=layout.ep))
    return ShardedCausalLM(load_model(CHECKPOINT, mesh, moe_ep=layout.ep), mesh)


def check_against_transformers(run) -> None:
    """float32 logits within 1e-4 (relative to the largest) of HF's, zero past each end, and
    HF's greedy tokens through the sharded caches (KV and Gated DeltaNet state)."""
    prompts, reference = golden()
    logits = run.forward(prompts)
    want = reference["logits"]
    assert logits.shape == want.shape
    assert np.max(np.abs(logits - want)) <= 1e-4 * np.max(np.abs(want))
    for index, length in enumerate(reference["lengths"]):
        assert not np.any(logits[index, length:])
    tokens = run.generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens, reference["generated"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_greedy_tokens_match_transformers(layout):
    """HF's logits and greedy tokens on every layout: each rank's key and value heads, its
    conv channels and per-slot states, its attention heads and their output gates."""
    check_against_transformers(runner(layout))


@pytest.mark.slow
def test_pipeline_stages_match_transformers():
    """Two stages (DeltaNet, DeltaNet, attention | attention, DeltaNet) on attention TP 2, two
    microbatches, each stage holding its own layers' caches: HF's logits and tokens."""
    mesh = bj.make_mesh(bj.Topology(attn_tp=2, pp=2))
    split = PipelineSplit.of_sizes((3, 2), TINY.num_layers)
    stages = load_pipeline(CHECKPOINT, mesh, BuildOptions(), split=split)
    check_against_transformers(PipelineCausalLM(stages, mesh, microbatches=2))


def test_model_layers_and_config():
    """The checkpoint builds Qwen3NextForCausalLM with Gated DeltaNet on layers 0, 1, 4 and gated
    attention (partial RoPE) on 2, 3, MoEs on 0, 2, 4; its config.json reads back as written."""
    model = runner(DEFAULT).model
    assert isinstance(model, Qwen3NextForCausalLM)
    mixers = [type(layer.attn) for layer in model.layers]
    assert mixers == [GatedDeltaNet, GatedDeltaNet, Attention, Attention, GatedDeltaNet]
    sparse = [isinstance(layer.mlp, MoeFfn) for layer in model.layers]
    assert sparse == [True, False, True, False, True]
    assert model.layers[2].attn.spec.rotary_dim == 4 and model.layers[2].attn.spec.output_gate
    assert model.layers[0].mlp.shared_expert.expert_gate is not None
    specs = model.cache_specs()
    assert [isinstance(spec, DeltaCache) for spec in specs] == [True, True, False, False, True]
    config = load_config(CHECKPOINT)
    assert config.unit_offset_norms and config.attention_output_gate
    written = Qwen3NextForCausalLM.write_config(config)
    assert read_hf_config(written) == config
    assert read_hf_config(Qwen3NextForCausalLM.write_config(TINY)) == TINY


def test_refuses_what_it_does_not_build():
    """The all-to-all dispatch, scanned layers and bad layer types are refused; layer kinds
    default to every `full_attention_interval`-th layer attending."""
    mesh = bj.make_mesh(bj.Topology(attn_tp=2, moe_ep=2))
    with pytest.raises(NotImplementedError, match="gathered rows"):
        load_model(CHECKPOINT, mesh, BuildOptions(moe_dispatch=bj.MoeDispatch.ALL_TO_ALL), moe_ep=2)
    with pytest.raises(NotImplementedError, match="scanned runs"):
        TINY.layer_blocks(True)
    written = Qwen3NextForCausalLM.write_config(TINY)
    with pytest.raises(ValueError, match="layer_types must name"):
        read_hf_config(written | {"layer_types": ["linear_attention"]})
    kinds = read_hf_config(
        {k: v for k, v in written.items() if k != "layer_types"}
        | {"full_attention_interval": 5, "mlp_only_layers": []}
    ).linear_attention.layers
    assert kinds == (True, True, True, True, False)
