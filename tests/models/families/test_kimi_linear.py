"""Kimi-Linear on boundaries equals Hugging Face transformers (golden files) under TP, attention
DP and expert parallelism (gathered rows and all-to-all): Kimi Delta Attention and NoPE latent
attention layers, a dense first layer and DeepSeek-style MoE layers; its config reads back as
written, in the checkpoint's keys too."""

import dataclasses
import functools
import json
import pathlib

import numpy as np
import pytest

import boundary_jax as bj
from models.build import build_model, load_model
from models.config import PRESETS, KimiDeltaSpec, read_hf_config
from models.families.kimi_linear import KimiLinearForCausalLM
from models.layers.attention.latent import LatentCache, MultiHeadLatentAttention
from models.layers.mixers.gated_deltanet import DeltaCache
from models.layers.mixers.kimi_delta import KimiDeltaAttention
from models.layers.moe.ffn import MoeFfn
from models.options import BuildOptions
from models.pipeline import PipelineCausalLM, load_pipeline
from models.pipeline.split import PipelineSplit
from models.serving.runtime import ShardedCausalLM
from models.weights import load_config
from tests.models import MoeLayout

CHECKPOINT = pathlib.Path(__file__).parents[2] / "golden" / "kimi_linear"
ALL_TO_ALL = bj.MoeDispatch.ALL_TO_ALL
# Attention DP 2 x TP 2 with the experts over EP 4 all-to-all runs by default; the rest under
# -m slow.
DEFAULT = MoeLayout(2, 2, ep=4, dispatch=ALL_TO_ALL)
LAYOUTS = [
    pytest.param(layout, id=str(layout), marks=[] if layout == DEFAULT else [pytest.mark.slow])
    for layout in (
        MoeLayout(1, 1),
        MoeLayout(1, 2),
        MoeLayout(1, 4),
        MoeLayout(2, 2),
        MoeLayout(1, 4, ep=4),
        MoeLayout(1, 2, ep=2, dispatch=ALL_TO_ALL),
        MoeLayout(8, 1, ep=8, dispatch=ALL_TO_ALL),
        DEFAULT,
    )
]


@functools.cache
def golden() -> tuple[list[list[int]], dict[str, np.ndarray]]:
    prompts = json.loads((CHECKPOINT / "prompts.json").read_text())
    return prompts, dict(np.load(CHECKPOINT / "reference.npz"))


@functools.cache
def runner(layout: MoeLayout) -> ShardedCausalLM:
    mesh = bj.make_mesh(bj.Topology(attn_dp=layout.dp, attn_tp=layout.tp, moe_ep=layout.ep))
    options = BuildOptions(moe_dispatch=layout.dispatch if layout.ep > 1 else None)
    return ShardedCausalLM(load_model(CHECKPOINT, mesh, options, moe_ep=layout.ep), mesh)


def check_against_transformers(run) -> None:
    """float32 logits within 1e-4 (relative to the largest) of HF's, zero past each end, and
    HF's greedy tokens through the sharded caches (latent and Kimi Delta Attention state)."""
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
    """HF's logits and tokens on every layout: each rank's heads of both mixers, its conv
    channels, gates and states, its experts."""
    check_against_transformers(runner(layout))


@pytest.mark.slow
def test_pipeline_stages_match_transformers():
    """Two stages (delta, delta | latent, latent, delta) on attention TP 2, two microbatches,
    each stage holding its own layers' latent caches and delta states: HF's logits and
    tokens."""
    mesh = bj.make_mesh(bj.Topology(attn_tp=2, pp=2))
    split = PipelineSplit.of_sizes((2, 3), 5)
    stages = load_pipeline(CHECKPOINT, mesh, BuildOptions(), split=split)
    check_against_transformers(PipelineCausalLM(stages, mesh, microbatches=2))


def test_model_layers_and_config():
    """The checkpoint builds KimiLinearForCausalLM with Kimi Delta Attention on layers 0, 1, 4
    and unrotated latent attention on 2, 3, a dense layer 0; its config reads back as written,
    and the checkpoint's own keys (`linear_attn_config`, 1-indexed layers) read alike; the LM
    head is its own whatever `tie_word_embeddings` says, as transformers reads it."""
    model = runner(DEFAULT).model
    assert isinstance(model, KimiLinearForCausalLM)
    mixers = [type(layer.attn) for layer in model.layers]
    latent = MultiHeadLatentAttention
    assert mixers == [KimiDeltaAttention] * 2 + [latent] * 2 + [KimiDeltaAttention]
    sparse = [isinstance(layer.mlp, MoeFfn) for layer in model.layers]
    assert sparse == [False, True, True, True, True]
    specs = [type(spec) for spec in model.cache_specs()]
    assert specs == [DeltaCache, DeltaCache, LatentCache, LatentCache, DeltaCache]
    config = load_config(CHECKPOINT)
    assert not config.mla.rotary and isinstance(config.linear_attention.spec, KimiDeltaSpec)
    assert PRESETS["tiny-kimi-linear"] == dataclasses.replace(config, vocab_size=256)
    written = KimiLinearForCausalLM.write_config(config)
    assert read_hf_config(written) == config
    spec = config.linear_attention.spec
    hub = {k: v for k, v in written.items() if k not in ("layer_types",) and "linear_" not in k}
    hub["linear_attn_config"] = {
        "kda_layers": [1, 2, 5],
        "full_attn_layers": [3, 4],
        "num_heads": spec.num_heads,
        "head_dim": spec.head_dim,
        "short_conv_kernel_size": spec.conv_kernel,
    }
    assert read_hf_config(hub) == config
    assert read_hf_config(written | {"tie_word_embeddings": True}) == config
    with pytest.raises(ValueError, match="never ties it"):
        dataclasses.replace(config, tie_word_embeddings=True)


@pytest.mark.slow
def test_mlp_layer_types_place_dense_layers_anywhere():
    """`mlp_layer_types` names each layer's FFN, as transformers reads it (a dense layer after
    a sparse one too; `first_k_dense_replace` only where the key is absent), and writes back;
    DeepSeek's format counts its dense layers, so a DeepSeek config keeps them first. The model
    with its dense layer second is one model on every mesh: DP 2 x TP 2 with the experts over
    EP 4 all-to-all equals one device (random weights of one seed)."""
    raw = json.loads((CHECKPOINT / "config.json").read_text())
    kinds = ["sparse", "dense", "sparse", "sparse", "dense"]
    config = read_hf_config(raw | {"mlp_layer_types": kinds})
    assert config.moe.mlp_only_layers == (1, 4)
    assert config.sparse_layers == (True, False, True, True, False)
    assert read_hf_config(KimiLinearForCausalLM.write_config(config)) == config
    bare = {k: v for k, v in raw.items() if k != "mlp_layer_types"} | {"first_k_dense_replace": 2}
    assert read_hf_config(bare).moe.mlp_only_layers == (0, 1)
    with pytest.raises(ValueError, match="names each of the 5 layers 'dense' or 'sparse'"):
        read_hf_config(raw | {"mlp_layer_types": ["dense", "moe", "sparse", "sparse", "sparse"]})
    deepseek = PRESETS["tiny-deepseek-v3"]
    moved = dataclasses.replace(deepseek.moe, mlp_only_layers=(1,))
    with pytest.raises(ValueError, match="dense layers are the first"):
        dataclasses.replace(deepseek, moe=moved)
    tiny = PRESETS["tiny-kimi-linear"]
    tiny = dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, mlp_only_layers=(1,)))
    prompts = [[5, 7, 9, 11, 2, 3, 4], [3], [8, 8, 1, 6]]
    outputs = []
    for layout in (MoeLayout(1, 1), DEFAULT):
        topology = bj.Topology(attn_dp=layout.dp, attn_tp=layout.tp, moe_ep=layout.ep)
        options = BuildOptions(moe_dispatch=layout.dispatch if layout.ep > 1 else None)
        model = build_model(tiny, topology, options)
        assert [isinstance(layer.mlp, MoeFfn) for layer in model.layers][:2] == [True, False]
        outputs.append(ShardedCausalLM(model, bj.make_mesh(topology)).forward(prompts))
    assert np.max(np.abs(outputs[0] - outputs[1])) <= 1e-5 * np.max(np.abs(outputs[0]))
