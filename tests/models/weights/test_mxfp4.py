"""MXFP4 checkpoints and fused, interleaved expert tensors: the dequantization is transformers'
(its output on random packed bytes), quantizing rounds each value to the nearest e2m1 step of
its group's scale, a device reads only the blocks and scales of its shard, and interleaved parts
read per shard; a GPT-OSS checkpoint written by `scripts/make_mxfp4_checkpoint.py` in the
released layout loads on every mesh to the checkpoint it was made from, dequantized, and gives
transformers' logits of it."""

import json
import pathlib
import runpy
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import boundary_jax as bj
from models.build import load_model
from models.config.tensors import HFTensor
from models.options import BuildOptions
from models.pipeline import PipelineCausalLM, load_pipeline
from models.serving.runtime import ShardedCausalLM
from models.weights import load_tensor
from models.weights.mxfp4 import (
    FP4_VALUES,
    MXFP4_CONFIG,
    Mxfp4Tensors,
    dequantize_mxfp4,
    quantize_mxfp4,
    write_mxfp4_checkpoint,
)
from tests.models import MoeLayout

ROOT = pathlib.Path(__file__).parents[3]
CHECKPOINT = ROOT / "tests" / "golden" / "gpt_oss"
GATHER, ALL_TO_ALL = bj.MoeDispatch.GATHER, bj.MoeDispatch.ALL_TO_ALL
SLOW = pytest.mark.slow


def test_dequantization_is_transformers():
    """Random packed bytes and scales dequantize exactly as transformers'
    `convert_moe_packed_tensors` did (`mxfp4_sample.npz`, made by the golden script)."""
    sample = np.load(CHECKPOINT / "mxfp4_sample.npz")
    got = dequantize_mxfp4(sample["blocks"], sample["scales"])
    assert got.shape == sample["dequantized"].shape == (3, 64, 5)
    np.testing.assert_array_equal(got, sample["dequantized"])


def test_quantization_rounds_to_the_nearest_step_and_reads_back():
    """Each value comes back as the nearest e2m1 value times its group's power-of-two scale
    (which brings the group's largest magnitude within 6); what came back, quantized again,
    comes back exactly."""
    rng = np.random.default_rng(4)
    values = (rng.standard_normal((2, 96, 5)) * np.exp(rng.standard_normal((2, 1, 5)))).astype(
        np.float32
    )
    blocks, scales = quantize_mxfp4(values)
    assert blocks.shape == (2, 5, 3, 16) and scales.shape == (2, 5, 3)
    back = dequantize_mxfp4(blocks, scales)
    groups = np.swapaxes(values, 1, 2).reshape(2, 5, 3, 32)
    scale = np.ldexp(1.0, scales.astype(np.int32) - 127)[..., None]
    assert np.all(np.max(np.abs(groups), -1, keepdims=True) <= 6 * scale)
    steps = scale[..., None] * FP4_VALUES[:8]  # each group's e2m1 magnitudes
    nearest = np.min(np.abs(np.abs(groups)[..., None] - steps), axis=-1)
    error = np.abs(np.swapaxes(back, 1, 2).reshape(groups.shape) - groups)
    np.testing.assert_allclose(error, nearest, atol=1e-6)
    np.testing.assert_array_equal(dequantize_mxfp4(*quantize_mxfp4(back)), back)
    with pytest.raises(ValueError, match="groups 32 finite values"):
        quantize_mxfp4(np.zeros((2, 40, 3), np.float32))


def test_a_block_reads_only_its_rows_and_groups():
    """Any block of the encoded [lead, columns, rows] tensor (columns not on group edges)
    equals that slice of the whole, reading only the blocks' and scales' rows it needs and the
    groups covering its columns."""
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (4, 6, 3, 16), dtype=np.uint8)
    scales = rng.integers(120, 132, (4, 6, 3), dtype=np.uint8)
    stored = {"x_blocks": blocks, "x_scales": scales, "y": np.zeros(2)}
    tensors = Mxfp4Tensors.of(stored)
    assert tensors.names(stored) == ["y", "x"]
    assert tensors.shape("x", lambda name: stored[name].shape) == (4, 96, 6)
    reads = []

    def read(name, index):
        reads.append((name, index))
        return stored[name][index]

    whole = dequantize_mxfp4(blocks, scales)
    index = (slice(1, 3), slice(40, 70), slice(2, 5))
    np.testing.assert_array_equal(tensors.read("x", index, read), whole[index])
    assert [(n, i[:3]) for n, i in reads] == [
        ("x_blocks", (slice(1, 3), slice(2, 5), slice(1, 3))),
        ("x_scales", (slice(1, 3), slice(2, 5), slice(1, 3))),
    ]


@pytest.mark.parametrize("dp,tp", [(1, 4), (2, 2)])
def test_interleaved_parts_read_per_shard(tmp_path, dp, tp):
    """A fused [experts, hidden, 2 x width] tensor with gate and up interleaved reads as
    [experts, hidden, 2, width], experts over DP, each expert's width over TP: every device's
    block is its experts' gate and up columns."""
    rng = np.random.default_rng(6)
    fused = rng.standard_normal((4, 6, 16)).astype(np.float32)
    save_file({"experts.gate_up": fused}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    source = HFTensor("experts.gate_up", parts=("gate", "up"), part_axis=2, interleaved=True)
    mesh = bj.make_mesh(bj.Topology(attn_dp=dp, attn_tp=tp))
    spec = P("attn_dp", None, None, "attn_tp")
    got = load_tensor(tmp_path, source, (4, 6, 2, 8), mesh, spec, np.float32)
    want = np.stack([fused[..., 0::2], fused[..., 1::2]], axis=2)
    np.testing.assert_array_equal(np.asarray(got), want)
    for shard in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


# --------------------------------------------------------------------------------------------
# The GPT-OSS checkpoint in MXFP4, on every mesh
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """The golden checkpoint written in MXFP4 by the script, and in float32 with its experts
    quantized and dequantized (what the MXFP4 checkpoint means)."""
    mxfp4 = tmp_path_factory.mktemp("mxfp4")
    script = ROOT / "scripts" / "make_mxfp4_checkpoint.py"
    with pytest.MonkeyPatch.context() as patch:  # the script as its command line runs it
        patch.setattr(sys, "argv", [str(script), str(CHECKPOINT), str(mxfp4)])
        runpy.run_path(str(script), run_name="__main__")
    rounded = tmp_path_factory.mktemp("rounded")
    write_mxfp4_checkpoint(CHECKPOINT, rounded)  # the same bytes, then dequantized back
    stored = load_file(str(rounded / "model.safetensors"))
    tensors = Mxfp4Tensors.of(stored)
    floats = {name: value for name, value in stored.items() if name in tensors.names(stored)}
    for name, (blocks, scales) in tensors.pairs.items():
        floats[name] = dequantize_mxfp4(stored[blocks], stored[scales])
    save_file(floats, str(rounded / "model.safetensors"))
    config = json.loads((CHECKPOINT / "config.json").read_text())
    (rounded / "config.json").write_text(json.dumps(config))
    return mxfp4, rounded


def test_the_script_writes_the_released_layout(checkpoints):
    """Every expert projection is uint8 blocks [experts, out, in / 32, 16] and e8m0 scales
    [experts, out, in / 32] holding the float values rounded (each within a third of its group's
    largest magnitude); biases, router and attention stay float; config.json says mxfp4."""
    mxfp4, _ = checkpoints
    stored = load_file(str(mxfp4 / "model.safetensors"))
    experts = "model.layers.1.mlp.experts."
    assert stored[experts + "gate_up_proj_blocks"].shape == (8, 64, 2, 16)
    assert stored[experts + "gate_up_proj_scales"].shape == (8, 64, 2)
    assert stored[experts + "down_proj_blocks"].shape == (8, 64, 1, 16)
    assert stored[experts + "down_proj_scales"].dtype == np.uint8
    assert stored[experts + "down_proj_bias"].dtype == np.float32
    assert experts + "gate_up_proj" not in stored
    original = load_file(str(CHECKPOINT / "model.safetensors"))
    for name in ("gate_up_proj", "down_proj"):  # each value within its group's rounding
        name = experts + name
        back = dequantize_mxfp4(stored[name + "_blocks"], stored[name + "_scales"])
        groups = np.swapaxes(original[name], 1, 2).reshape(8, 64, -1, 32)
        error = np.swapaxes(back, 1, 2).reshape(groups.shape) - groups
        assert np.all(np.abs(error) <= np.max(np.abs(groups), axis=-1, keepdims=True) / 3), name
    config = json.loads((mxfp4 / "config.json").read_text())
    assert config["quantization_config"] == MXFP4_CONFIG


def parameters(model) -> dict[str, np.ndarray]:
    return {
        ".".join(map(str, path)): np.asarray(value.get_value())
        for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


MESHES = (
    MoeLayout(1, 4),
    MoeLayout(1, 1),
    MoeLayout(2, 2, ep=4, dispatch=ALL_TO_ALL),
    MoeLayout(2, 2),
    MoeLayout(1, 4, scattered=True),
    MoeLayout(8, 1),
    MoeLayout(1, 4, ep=4),
    MoeLayout(1, 8, ep=8, dispatch=ALL_TO_ALL),
)


@pytest.mark.parametrize(
    "layout",
    [pytest.param(m, marks=[] if m == MESHES[0] else [SLOW]) for m in MESHES],
    ids=str,
)
def test_the_mxfp4_checkpoint_loads_dequantized_on_every_mesh(checkpoints, layout):
    """Each device dequantizes its shard (its experts, a slice of their width: down_proj's
    groups cut at TP 4): every parameter equals the float checkpoint with the experts rounded,
    and the logits are transformers' of the MXFP4 checkpoint (within 1e-4)."""
    mxfp4, rounded = checkpoints
    topology = bj.Topology(attn_dp=layout.dp, attn_tp=layout.tp, moe_ep=layout.ep)
    mesh = bj.make_mesh(topology)
    options = BuildOptions(moe_dispatch=layout.dispatch)
    model = load_model(mxfp4, mesh, options, moe_ep=layout.ep)
    want = parameters(load_model(rounded, mesh, options, moe_ep=layout.ep))
    got = parameters(model)
    assert got.keys() == want.keys()
    for path, value in want.items():
        np.testing.assert_array_equal(got[path], value, err_msg=path)
    prompts = json.loads((CHECKPOINT / "prompts.json").read_text())
    reference = np.load(CHECKPOINT / "reference.npz")["logits_mxfp4"]
    logits = ShardedCausalLM(model, mesh, input_scattered=layout.scattered).forward(prompts)
    assert np.max(np.abs(logits - reference)) <= 1e-4 * np.max(np.abs(reference))


@SLOW
def test_the_mxfp4_checkpoint_loads_into_pipeline_stages(checkpoints):
    """Two stages, each reading its layer's blocks: transformers' logits of the checkpoint."""
    mxfp4, _ = checkpoints
    mesh = bj.make_mesh(bj.Topology(pp=2, attn_tp=2, moe_ep=2))
    options = BuildOptions(moe_dispatch=ALL_TO_ALL)
    run = PipelineCausalLM(load_pipeline(mxfp4, mesh, options, moe_ep=2), mesh, microbatches=2)
    prompts = json.loads((CHECKPOINT / "prompts.json").read_text())
    reference = np.load(CHECKPOINT / "reference.npz")["logits_mxfp4"]
    logits = run.forward(prompts)
    assert np.max(np.abs(logits - reference)) <= 1e-4 * np.max(np.abs(reference))


def test_bf16_models_load_the_experts_dequantized_exactly(checkpoints):
    """Dequantized in bfloat16, the experts hold the same values (every e2m1 value times a
    power of two is a bfloat16)."""
    mxfp4, _ = checkpoints
    model = load_model(mxfp4, bj.make_mesh(bj.Topology()), BuildOptions(dtype=jnp.bfloat16))
    layer = model.layers[0].mlp
    assert layer.gate_up_proj[...].dtype == jnp.bfloat16
    stored = load_file(str(mxfp4 / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj"
    want = dequantize_mxfp4(stored[name + "_blocks"], stored[name + "_scales"])
    np.testing.assert_array_equal(np.asarray(layer.down_proj[...], np.float32), want)
