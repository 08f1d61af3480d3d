"""Qwen3-Next and Qwen3.5 (dense and MoE) on boundaries equal Hugging Face transformers (golden
files) under TP, attention DP, expert parallelism (gathered rows and all-to-all) and pipeline
stages: Gated DeltaNet and gated-attention layers, each before an MoE and a dense MLP; their
configs read back as written, and unbuilt options are refused."""

import dataclasses
import functools
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import boundary_jax as bj
import pallas_kernels as pk
from boundary_jax.fusions import MoeFinalizeAddRmsNorm, platform_fusions
from models.build import load_model
from models.config import PRESETS, DeltaProjections, read_hf_config
from models.families.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
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

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
CHECKPOINT = GOLDEN / "qwen3_next"
ALL_TO_ALL = bj.MoeDispatch.ALL_TO_ALL

# Per golden, its layouts. By default Qwen3-Next on EP 4 over gathered rows on attention TP 4
# (one key head and its 2 value heads per rank, the 2 kv heads shared by ranks; attention DP and
# the all-to-all dispatch after a delta-rule mixer run by default in test_kimi_linear.py); the
# rest, Qwen3.5 among them, under -m slow.
DENSE = (MoeLayout(1, 1), MoeLayout(1, 2), MoeLayout(1, 4), MoeLayout(2, 2))
SPARSE = DENSE + (
    MoeLayout(1, 4, ep=4),
    MoeLayout(1, 2, ep=2, dispatch=ALL_TO_ALL),
    MoeLayout(1, 2, ep=2, dispatch=ALL_TO_ALL, scattered=True),
    MoeLayout(8, 1, ep=8, dispatch=ALL_TO_ALL),
)
GOLDENS = {"qwen3_next": SPARSE, "qwen3_5": DENSE, "qwen3_5_moe": SPARSE}
DEFAULT = {("qwen3_next", MoeLayout(1, 4, ep=4))}
CASES = [
    pytest.param(
        name,
        layout,
        id=f"{name}-{layout}",
        marks=[] if (name, layout) in DEFAULT else [pytest.mark.slow],
    )
    for name, layouts in GOLDENS.items()
    for layout in layouts
]
# Two stages: (DeltaNet, DeltaNet, attention | attention, DeltaNet) and (DeltaNet, attention |
# attention, DeltaNet).
PIPELINE_SPLITS = {"qwen3_next": (3, 2), "qwen3_5": (2, 2), "qwen3_5_moe": (2, 2)}


@functools.cache
def golden(name: str) -> tuple[list[list[int]], dict[str, np.ndarray]]:
    prompts = json.loads((GOLDEN / name / "prompts.json").read_text())
    return prompts, dict(np.load(GOLDEN / name / "reference.npz"))


@functools.cache
def runner(name: str, layout: MoeLayout) -> ShardedCausalLM:
    mesh = bj.make_mesh(bj.Topology(attn_dp=layout.dp, attn_tp=layout.tp, moe_ep=layout.ep))
    options = BuildOptions(moe_dispatch=layout.dispatch if layout.ep > 1 else None)
    model = load_model(GOLDEN / name, mesh, options, moe_ep=layout.ep)
    return ShardedCausalLM(model, mesh, input_scattered=layout.scattered)


def check_against_transformers(name: str, run) -> None:
    """float32 logits within 1e-4 (relative to the largest) of HF's, zero past each end, and
    HF's greedy tokens through the sharded caches (KV and Gated DeltaNet state)."""
    prompts, reference = golden(name)
    logits = run.forward(prompts)
    want = reference["logits"]
    assert logits.shape == want.shape
    assert np.max(np.abs(logits - want)) <= 1e-4 * np.max(np.abs(want))
    for index, length in enumerate(reference["lengths"]):
        assert not np.any(logits[index, length:])
    tokens = run.generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens, reference["generated"])


@pytest.mark.parametrize("name,layout", CASES)
def test_logits_and_greedy_tokens_match_transformers(name, layout):
    """HF's logits and greedy tokens on every layout: each rank's key and value heads, its
    conv channels and per-slot states, its attention heads and their output gates, its
    experts."""
    check_against_transformers(name, runner(name, layout))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_pipeline_stages_match_transformers(name):
    """Two stages on attention TP 2, two microbatches, each stage holding its own layers'
    caches (KV or Gated DeltaNet state): HF's logits and tokens."""
    mesh = bj.make_mesh(bj.Topology(attn_tp=2, pp=2))
    split = PipelineSplit.of_sizes(PIPELINE_SPLITS[name], sum(PIPELINE_SPLITS[name]))
    stages = load_pipeline(GOLDEN / name, mesh, BuildOptions(), split=split)
    check_against_transformers(name, PipelineCausalLM(stages, mesh, microbatches=2))


def test_model_layers_and_config():
    """The checkpoint builds Qwen3NextForCausalLM with Gated DeltaNet on layers 0, 1, 4 and gated
    attention (partial RoPE) on 2, 3, MoEs on 0, 2, 4; its config.json reads back as written."""
    model = runner("qwen3_next", MoeLayout(1, 4, ep=4)).model
    assert isinstance(model, Qwen3NextForCausalLM)
    mixers = [type(layer.attn) for layer in model.layers]
    assert mixers == [GatedDeltaNet, GatedDeltaNet, Attention, Attention, GatedDeltaNet]
    sparse = [isinstance(layer.mlp, MoeFfn) for layer in model.layers]
    assert sparse == [True, False, True, False, True]
    assert model.layers[2].attn.spec.rotary_dim == 4 and model.layers[2].attn.spec.output_gate
    assert model.layers[0].mlp.shared_expert.expert_gate is not None
    specs = model.cache_specs()
    assert [isinstance(spec, DeltaCache) for spec in specs] == [True, True, False, False, True]
    # Per device at TP 4: 2 attention layers of 1 kv head of 16 (keys and values, float32);
    # 3 DeltaNet layers of 3 conv rows of 32 channels and 2 value heads' 8 x 8 states.
    assert model.cache_bytes_per_token(jnp.float32) * model.token_cache_layers() == 2 * 128
    assert model.state_bytes_per_slot(jnp.float32) == 3 * (3 * 32 + 2 * 64) * 4
    config = load_config(CHECKPOINT)
    assert config.unit_offset_norms and config.attention_output_gate
    written = Qwen3NextForCausalLM.write_config(config)
    assert read_hf_config(written) == config
    assert read_hf_config(Qwen3NextForCausalLM.write_config(TINY)) == TINY


def test_qwen3_5_families():
    """Qwen3.5's checkpoints build its two families, Gated DeltaNet from separate projections;
    the dense one has no experts, the MoE one renormalizes its top k; both configs read back
    as written."""
    dense = runner("qwen3_5", MoeLayout(2, 2)).model
    assert isinstance(dense, Qwen3_5ForCausalLM) and dense.config.moe is None
    assert dense.layers[0].attn.spec.projections is DeltaProjections.SEPARATE
    assert not any(isinstance(layer.mlp, MoeFfn) for layer in dense.layers)
    for name, family in (("qwen3_5", Qwen3_5ForCausalLM), ("qwen3_5_moe", Qwen3_5MoeForCausalLM)):
        config = load_config(GOLDEN / name)
        assert config.linear_attention.spec.projections is DeltaProjections.SEPARATE
        assert read_hf_config(family.write_config(config)) == config
    moe = load_config(GOLDEN / "qwen3_5_moe").moe
    assert moe.renormalize and moe.shared_expert_gate and moe.mlp_only_layers == ()
    for name in ("qwen3_5", "qwen3_5_moe"):  # the presets are the goldens' configs
        preset = PRESETS["tiny-" + name.replace("_", "-")]
        assert preset == dataclasses.replace(load_config(GOLDEN / name), vocab_size=256)


def test_refuses_what_it_does_not_build():
    """Scanned layers and bad layer types are refused; layer kinds default to every
    `full_attention_interval`-th layer attending; a Qwen3-Next without experts (transformers
    builds its FFNs dense) reads and writes back."""
    with pytest.raises(NotImplementedError, match="scanned runs"):
        TINY.layer_blocks(True)
    written = Qwen3NextForCausalLM.write_config(TINY)
    with pytest.raises(ValueError, match="layer_types must name"):
        read_hf_config(written | {"layer_types": ["linear_attention"]})
    dense = read_hf_config(written | {"num_experts": 0})
    assert dense == dataclasses.replace(TINY, moe=None)
    assert read_hf_config(Qwen3NextForCausalLM.write_config(dense)) == dense
    kinds = read_hf_config(
        {k: v for k, v in written.items() if k != "layer_types"}
        | {"full_attention_interval": 5, "mlp_only_layers": []}
    ).linear_attention.layers
    assert kinds == (True, True, True, True, False)


def fused_finalize_runner() -> tuple[ShardedCausalLM, list[bool]]:
    """Qwen3-Next on attention TP 2 with `platform_fusions(moe_finalize=True)` interpreted, the
    fused-finalize candidate offered to the final norm alone (the other MoEs' finalize, handed
    to the next input, completes unfused there), and the list that candidate appends to
    (whether it took the read)."""
    mesh = bj.make_mesh(bj.Topology(attn_tp=2))
    provider = platform_fusions(
        bj.Topology(attn_tp=2), platform="cpu", impl=pk.Impl.PALLAS_INTERPRET, moe_finalize=True
    )
    moe, *rest = provider.final_input
    assert isinstance(moe, MoeFinalizeAddRmsNorm)
    taken: list[bool] = []

    def counted(request):
        result = moe(request)
        taken.append(result is not None)
        return result

    provider = dataclasses.replace(
        provider, attn_input=tuple(rest), ffn_input=tuple(rest), final_input=(counted, *rest)
    )
    model = load_model(CHECKPOINT, mesh, BuildOptions(fusions=provider))
    return ShardedCausalLM(model, mesh), taken


@pytest.mark.slow
@pytest.mark.parametrize("mutant", [None, "summed twice"])
def test_terminal_finalize_fused_into_the_unit_offset_final_norm(monkeypatch, mutant):
    """The last MoE hands its finalize to the final norm (`1 + w`), where the fused finalize +
    all-reduce + add + norm kernel takes it: HF's logits; a kernel that sums the finalize twice
    is caught."""
    if mutant is not None:
        honest = pk.moe_finalize_add_rms_norm

        def twice(outputs, weights, residual, norm_weight, **options):
            return honest(2 * outputs, weights, residual, norm_weight, **options)

        monkeypatch.setattr(pk, "moe_finalize_add_rms_norm", twice)
    run, taken = fused_finalize_runner()
    prompts, reference = golden("qwen3_next")
    logits = run.forward(prompts)
    assert taken and all(taken)
    error = np.max(np.abs(logits - reference["logits"])) / np.max(np.abs(reference["logits"]))
    assert error <= 1e-4 if mutant is None else error > 1e-2
