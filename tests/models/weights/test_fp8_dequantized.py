"""A fine-grained FP8 checkpoint of a family that builds no FP8 projections (DeepSeek's, as
DeepSeek-V3 is released) loads dequantized: each device reads its block of the FP8 values and
the 128 x 128 scales covering it, wherever the block starts. The DeepSeek-V3 golden's
projections written as FP8 (partial blocks: its widths are under 128) load as the checkpoint of
their dequantized values, logit for logit, on attention DP 2 x TP 2 with EP 4 all-to-all."""

import json
import logging
import pathlib

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

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


def fp8_and_plain(golden_dir: pathlib.Path) -> tuple[dict, dict]:
    """A golden checkpoint's 2-D projections quantized (FP8 values and their scales), and the
    same checkpoint with those projections' dequantized values."""
    fp8, plain = {}, {}
    for name, value in load_file(golden_dir / "model.safetensors").items():
        if name.endswith("proj.weight") and value.ndim == 2:
            values, scales, dequantized = quantized(value)
            fp8[name], fp8[name.removesuffix(".weight") + ".weight_scale_inv"] = values, scales
            plain[name] = dequantized
        else:
            fp8[name] = plain[name] = value
    return fp8, plain


def write(folder: pathlib.Path, golden_dir: pathlib.Path, weights: dict, fp8: bool) -> pathlib.Path:
    """`weights` as a checkpoint with the golden's config (an FP8 `quantization_config` where
    `fp8`)."""
    folder.mkdir()
    config = json.loads((golden_dir / "config.json").read_text())
    if fp8:
        config["quantization_config"] = FP8_CONFIG
    (folder / "config.json").write_text(json.dumps(config))
    write_safetensors(weights, folder / "model.safetensors")
    return folder


def test_fp8_checkpoint_of_a_family_without_fp8_loads_dequantized(tmp_path):
    fp8, plain = fp8_and_plain(GOLDEN)
    assert sum(name.endswith("_scale_inv") for name in fp8) > 20
    folders = {
        "fp8": write(tmp_path / "fp8", GOLDEN, fp8, fp8=True),
        "plain": write(tmp_path / "plain", GOLDEN, plain, fp8=False),
    }
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


def test_fp8_checkpoint_whose_widths_fp8_layers_do_not_take_loads_dequantized(tmp_path, caplog):
    """Qwen3 builds FP8 projections, but not at the golden's widths (no multiple of 128), nor
    with LoRA adapters: its FP8 checkpoint loads dequantized, with a warning saying why, as the
    dequantized checkpoint, and with an adapter as that checkpoint with the adapter."""
    qwen3 = GOLDEN.parent / "qwen3"
    fp8, plain = fp8_and_plain(qwen3)
    folders = {
        "fp8": write(tmp_path / "fp8", qwen3, fp8, fp8=True),
        "plain": write(tmp_path / "plain", qwen3, plain, fp8=False),
    }
    mesh = bj.make_mesh(bj.Topology(attn_tp=2))
    prompts, reference = golden("qwen3")
    with caplog.at_level(logging.WARNING, logger="models.build"):
        model = load_model(folders["fp8"], mesh)
    assert "FP8 weights load dequantized to float32" in caplog.text
    assert "multiples of 128" in caplog.text
    got = ShardedCausalLM(model, mesh).forward(prompts)
    want = ShardedCausalLM(load_model(folders["plain"], mesh), mesh).forward(prompts)
    scale = np.max(np.abs(reference["logits"]))
    assert np.max(np.abs(got - want)) <= 1e-6 * scale
    assert np.max(np.abs(got - reference["logits"])) > 1e-3 * scale

    adapters = {"a1": GOLDEN.parent / "lora" / "qwen3" / "a1"}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="models.build"):
        model = load_model(folders["fp8"], mesh, adapters=adapters)
    assert "LoRA adapters are not built with quantization" in caplog.text
    names = ["a1"] * len(prompts)
    adapted = ShardedCausalLM(model, mesh).forward(prompts, adapters=names)
    plain_model = load_model(folders["plain"], mesh, adapters=adapters)
    want = ShardedCausalLM(plain_model, mesh).forward(prompts, adapters=names)
    assert np.max(np.abs(adapted - want)) <= 1e-6 * scale
    assert np.max(np.abs(adapted - got)) > 1e-2 * scale


def _retyped(path: pathlib.Path, name: str, code: str) -> None:
    """Rewrites the safetensors dtype code of tensor `name` in file `path` (a code of the same
    length and element size)."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header[name]["dtype"] = code
    encoded = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    assert len(encoded) == size
    path.write_bytes(data[:8] + encoded + data[8 + size :])


def test_a_malformed_fp8_checkpoint_is_refused_naming_the_tensor(tmp_path):
    """Where the weights are dequantized on load: scales on another grid than 128 x 128 blocks,
    an FP8 weight without its scales, and an FP8 format other than e4m3 are refused before any
    value is read (transformers' dequantization reads the first two as weights)."""
    fp8, _ = fp8_and_plain(GOLDEN)
    mesh = bj.make_mesh(bj.Topology())
    expert = "model.layers.1.mlp.experts.2.up_proj"
    grid = dict(fp8)
    grid[expert + ".weight_scale_inv"] = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match=rf"{expert}.weight_scale_inv must be \(1, 1\)"):
        load_model(write(tmp_path / "grid", GOLDEN, grid, fp8=True), mesh)
    missing = {k: v for k, v in fp8.items() if k != expert + ".weight_scale_inv"}
    with pytest.raises(ValueError, match=f"stores {expert}.weight in FP8 without its"):
        load_model(write(tmp_path / "missing", GOLDEN, missing, fp8=True), mesh)
    folder = write(tmp_path / "e5m2", GOLDEN, fp8, fp8=True)
    _retyped(folder / "model.safetensors", expert + ".weight", "F8_E5M2")
    with pytest.raises(ValueError, match=f"stores {expert}.weight as F8_E5M2"):
        load_model(folder, mesh)


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
