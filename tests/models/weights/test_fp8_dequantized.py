"""A fine-grained FP8 checkpoint of a family that builds no FP8 projections (DeepSeek's, as
DeepSeek-V3 is released) loads dequantized: each device reads its block of the FP8 values and
the 128 x 128 scales covering it, wherever the block starts. The DeepSeek-V3 golden's
projections written as FP8 (partial blocks: its widths are under 128) load as the checkpoint of
their dequantized values, logit for logit, on attention DP 2 x TP 2 with EP 4 all-to-all."""

import json
import pathlib
import shutil

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

import boundary_jax as bj
from models.build import load_model
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM
from models.weights.fp8 import BLOCK, Fp8Dequantized, write_safetensors
from tests.models.families.test_decoder import golden

GOLDEN = pathlib.Path(__file__).parents[2] / "golden" / "deepseek_v3"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_CONFIG = {
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
    "activation_scheme": "dynamic",
}


def quantized(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(FP8 values, float32 `weight_scale_inv` [ceil(out / 128), ceil(in / 128)], the values
    dequantized) of a 2-D weight, each block scaled to FP8's range."""
    rows, cols = -(-weight.shape[0] // BLOCK), -(-weight.shape[1] // BLOCK)
    scales = np.zeros((rows, cols), np.float32)
    values = np.zeros(weight.shape, FP8)
    for i in range(rows):
        for j in range(cols):
            block = weight[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            scales[i, j] = max(float(np.abs(block).max()), 1e-12) / 448.0
            values[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (
                block / scales[i, j]
            ).astype(FP8)
    dequantized = (
        values.astype(np.float32)
        * np.repeat(np.repeat(scales, BLOCK, 0), BLOCK, 1)[: weight.shape[0], : weight.shape[1]]
    )
    return values, scales, dequantized


def test_fp8_checkpoint_of_a_family_without_fp8_loads_dequantized(tmp_path):
    tensors = load_file(GOLDEN / "model.safetensors")
    fp8, plain = {}, {}
    for name, value in tensors.items():
        if name.endswith("proj.weight") and value.ndim == 2:
            values, scales, dequantized = quantized(value)
            fp8[name], fp8[name.removesuffix(".weight") + ".weight_scale_inv"] = values, scales
            plain[name] = dequantized
        else:
            fp8[name] = plain[name] = value
    assert sum(name.endswith("_scale_inv") for name in fp8) > 20
    folders = {}
    for kind, weights in (("fp8", fp8), ("plain", plain)):
        folders[kind] = tmp_path / kind
        folders[kind].mkdir()
        shutil.copy(GOLDEN / "prompts.json", folders[kind])
        config = json.loads((GOLDEN / "config.json").read_text())
        if kind == "fp8":
            config["quantization_config"] = FP8_CONFIG
            write_safetensors(weights, folders[kind] / "model.safetensors")
        else:
            save_file(weights, folders[kind] / "model.safetensors")
        (folders[kind] / "config.json").write_text(json.dumps(config))
    prompts, reference = golden("deepseek_v3")
    mesh = bj.make_mesh(bj.Topology(attn_dp=2, attn_tp=2, moe_ep=4))
    options = BuildOptions(moe_dispatch=bj.MoeDispatch.ALL_TO_ALL)
    logits = {
        kind: ShardedCausalLM(load_model(folder, mesh, options, moe_ep=4), mesh).forward(prompts)
        for kind, folder in folders.items()
    }
    scale = np.max(np.abs(reference["logits"]))
    assert np.max(np.abs(logits["fp8"] - logits["plain"])) <= 1e-6 * scale
    # FP8's rounding moves the logits off the unquantized golden's: the values were read.
    assert np.max(np.abs(logits["fp8"] - reference["logits"])) > 1e-2 * scale


def test_a_block_of_a_weight_dequantizes_with_the_scales_covering_it():
    """Any device block of a [300, 260] weight (starts mid-block, partial last blocks) reads as
    that block of the whole dequantized weight."""
    weight = np.random.default_rng(0).normal(size=(300, 260)).astype(np.float32)
    values, scales, dequantized = quantized(weight)
    stored = {"w.weight": values, "w.weight_scale_inv": scales}
    pairs = Fp8Dequantized.of(stored)
    assert pairs.names(stored) == ["w.weight"]
    for rows, cols in (
        (slice(0, 300), slice(0, 260)),
        (slice(75, 150), slice(130, 260)),
        (slice(200, 300), slice(0, 65)),
        (slice(127, 129), slice(255, 260)),
    ):
        block = pairs.read("w.weight", (rows, cols), lambda name, index: stored[name][index])
        np.testing.assert_array_equal(block, dequantized[rows, cols])
