"""Qwen3, Llama, Mistral, Qwen2 and Ministral 3 on boundaries equal Hugging Face transformers
(golden files)."""

import functools
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from boundary_jax import make_mesh
from models.build import build_model, load_model
from models.config import PRESETS
from models.families.llama import LlamaForCausalLM
from models.families.qwen2 import Qwen2ForCausalLM
from models.families.qwen3 import Qwen3ForCausalLM
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
NAMES = ("qwen3", "llama", "mistral")
# (name, attn_dp, attn_tp, input-scattered)
LAYOUTS = (
    ("TP 1", 1, 1, False),
    ("TP 4", 1, 4, False),
    ("TP 8", 1, 8, False),
    ("DP 2 x TP 2", 2, 2, False),
    ("input-scattered TP 4", 1, 4, True),
)
# Each family runs its own layouts by default, together every layout once, the rest under -m
# slow: Qwen3 TP 8 and input-scattered TP 4, Llama DP 2 x TP 2 (its untied head and llama3 RoPE
# with rows split over DP), Mistral on one device, Qwen2 TP 4 (its q/k/v biases split with their
# heads, its 2 kv heads shared by ranks; the runner test_model_classes_check_their_architecture
# loads), Ministral 3 DP 2 x TP 2 (its queries scaled by position on each rank's rows).
DEFAULT_LAYOUTS = {
    "qwen3": {"TP 8", "input-scattered TP 4"},
    "llama": {"DP 2 x TP 2"},
    "mistral": {"TP 1"},
    "qwen2": {"TP 4"},
    "ministral3": {"DP 2 x TP 2"},
}
CASES = [
    pytest.param(
        name,
        *layout[1:],
        id=f"{name}-{layout[0]}",
        marks=[pytest.mark.xdist_group(name)]
        + ([] if layout[0] in DEFAULT_LAYOUTS[name] else [pytest.mark.slow]),
    )
    for name in (*NAMES, "qwen2", "ministral3")
    for layout in LAYOUTS
    if (name, layout[0]) != ("qwen2", "TP 8")
]
# Greedy decoding by default on the layouts that split rows (DP 2 x TP 2, input-scattered TP 4);
# the other default layouts decode under -m slow (their logits run by default).
GENERATION_SLOW = {"qwen3-TP 8", "qwen2-TP 4", "mistral-TP 1"}
GENERATION_CASES = [
    pytest.param(
        *case.values,
        id=case.id,
        marks=[*case.marks, pytest.mark.slow] if case.id in GENERATION_SLOW else case.marks,
    )
    for case in CASES
]


@functools.cache
def golden(name: str) -> tuple[list[list[int]], dict[str, np.ndarray]]:
    prompts = json.loads((GOLDEN / name / "prompts.json").read_text())
    return prompts, dict(np.load(GOLDEN / name / "reference.npz"))


@functools.cache
def runner(name: str, dp: int, tp: int, scattered: bool, dtype=jnp.float32) -> ShardedCausalLM:
    mesh = make_mesh(bj.Topology(attn_dp=dp, attn_tp=tp))
    return ShardedCausalLM(
        load_model(GOLDEN / name, mesh, BuildOptions(dtype=dtype)), mesh, input_scattered=scattered
    )


@pytest.mark.parametrize("name,dp,tp,scattered", CASES)
def test_logits_match_transformers(name, dp, tp, scattered):
    """float32 logits of ragged prompts are within 1e-4 (relative to the largest) of HF's."""
    prompts, reference = golden(name)
    logits = runner(name, dp, tp, scattered).forward(prompts)
    want = reference["logits"]
    assert logits.shape == want.shape
    assert np.max(np.abs(logits - want)) <= 1e-4 * np.max(np.abs(want))
    lengths = reference["lengths"]
    for index, length in enumerate(lengths):
        assert not np.any(logits[index, length:]), "logits past a sequence's end must be zero"


@pytest.mark.parametrize("name,dp,tp,scattered", GENERATION_CASES)
def test_greedy_generation_matches_transformers(name, dp, tp, scattered):
    """Greedy decoding with the sharded KV cache gives HF's tokens."""
    prompts, reference = golden(name)
    tokens = runner(name, dp, tp, scattered).generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens, reference["generated"])


# bfloat16 through Qwen3 by default; the other families' bf16 loads under -m slow.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n != "qwen3" else []) for n in NAMES]
)
def test_bfloat16_checkpoint_runs_close_to_transformers_bfloat16(name):
    """A bfloat16 load stays within bf16 rounding (5% of the largest logit) of HF in bf16."""
    prompts, reference = golden(name)
    logits = runner(name, 2, 2, False, jnp.bfloat16).forward(prompts)
    scale = np.max(np.abs(reference["logits"]))
    assert np.max(np.abs(logits - reference["logits_bf16"])) <= 0.05 * scale


def test_model_classes_check_their_architecture():
    """Each decoder class builds only its own architectures."""
    topology = bj.Topology()
    with pytest.raises(ValueError, match="LlamaForCausalLM builds LlamaForCausalLM"):
        LlamaForCausalLM(PRESETS["tiny-qwen3"], topology, rngs=nnx.Rngs(0))
    model = build_model(PRESETS["tiny-qwen3"], topology)
    assert isinstance(model, Qwen3ForCausalLM)
    model = runner("qwen2", 1, 4, False).model
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.layers[0].attn.q_proj.bias is not None


def test_random_weights_are_the_same_on_every_mesh():
    """One seed gives one model whatever the mesh: the layouts agree with one device."""
    config = PRESETS["tiny-mistral"]
    prompts = [[5, 7, 9, 11, 2], [3], [8, 8, 1]]
    outputs = []
    for dp, tp in ((1, 1), (2, 4)):
        topology = bj.Topology(attn_dp=dp, attn_tp=tp)
        model = build_model(config, topology, BuildOptions(reduction=bj.ReductionPolicy.RS_RSV))
        outputs.append(ShardedCausalLM(model, make_mesh(topology)).forward(prompts))
    assert np.max(np.abs(outputs[0] - outputs[1])) <= 1e-5 * np.max(np.abs(outputs[0]))


def test_generation_and_forward_reject_contexts_past_the_model_limit():
    """Prompt plus new tokens must fit max_position_embeddings, and so must a forward's
    sequences (past it, dynamic NTK RoPE would grow its base, which no runtime here does)."""
    topology = bj.Topology()
    config = PRESETS["tiny-qwen3"]
    model = build_model(config, topology)
    run = ShardedCausalLM(model, make_mesh(topology))
    with pytest.raises(ValueError, match="exceed max_position_embeddings"):
        run.generate([[1] * 120], 20)
    limit = config.max_position_embeddings
    with pytest.raises(ValueError, match=f"{limit + 1} tokens.*exceed max_position_embeddings"):
        run.forward([[1] * 3, [1] * (limit + 1)])
    assert run.forward([[1] * limit]).shape[1] == limit
