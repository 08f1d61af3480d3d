"""FP8 decoders: a Hugging Face FP8 checkpoint (written by scripts/make_fp8_checkpoint.py's
function) loads on every mesh, each device its blocks, and the FP8 model equals the same model
in float64 on the dequantized weights with the same activation quantization.

The reference quantizes its activations with this file's own quantizer, whose largest FP8 value
is ml_dtypes' float8_e4m3fn maximum, not the project's constant: a wrong maximum in the project
changes the FP8 model and not the reference."""

import dataclasses
import functools
import json
from pathlib import Path
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

import boundary_jax as bj
from models.build import build_model, load_model
from models.cli.main import main
from models.config import PRESETS
from models.layers.fp8_linear import VALUE_SPREAD, Fp8Linears, Fp8Quantization, Fp8Weights
from models.layers.hyper_connections import HyperConnections
from models.layers.mlp import SwiGLU
from models.layers.moe import fp8 as fp8_moe
from models.layers.moe.fp8 import Fp8MoeFfn
from models.layers.moe.routing import Routing
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM
from models.weights import save_checkpoint
from models.weights.fp8 import FP8_CONFIG, read_stored_fp8, write_fp8_checkpoint
from pallas_kernels.fp8_matmul import Fp8GroupedImpl, Fp8MatmulImpl
from pallas_kernels.quantize import (
    dequantize_token_groups_reference,
    quantize_token_groups_reference,
)
from pallas_kernels.quantize_rows import activated_reference
from tests.models import make_mesh

FAMILIES = {
    "dense": PRESETS["tiny-qwen3-fp8"],
    "moe": PRESETS["tiny-qwen3-moe-fp8"],
    # Two kv heads on attention TP 4: each pair of ranks shares one, and each rank cuts its
    # head's columns and block scales from the replicated kv projection.
    "shared-kv": dataclasses.replace(PRESETS["tiny-qwen3-fp8"], num_kv_heads=2),
}
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
"""The largest float8_e4m3fn value, from ml_dtypes (448), independent of the project."""
A2A = bj.MoeDispatch.ALL_TO_ALL
# (attn_dp, attn_tp, moe_ep, moe_dispatch)
MESHES = {
    "TP 1": (1, 1, 1, None),
    "TP 4": (1, 4, 1, None),  # MoE: each expert's width over 4 ranks, gathered rows
    "DP 2 x TP 2": (2, 2, 1, None),
    "EP 4": (1, 4, 4, A2A),  # MoE: 2 experts per rank, rows sent all-to-all
}
# Dense TP 4 runs in float32 below; the float64 reference itself runs on TP 1. By default dense
# DP 2 x TP 2 and MoE TP 4; under -m slow dense TP 1, shared-kv TP 4, MoE DP 2 x TP 2 (it repeats
# dense DP 2 x TP 2's attention and MoE TP 4's experts) and EP 4 (its experts run padded below).
CASES = [("dense", "TP 1"), ("dense", "DP 2 x TP 2"), ("moe", "TP 4")]
CASES += [("moe", "DP 2 x TP 2"), ("moe", "EP 4"), ("shared-kv", "TP 4")]
SLOW_CASES = {("dense", "TP 1"), ("moe", "DP 2 x TP 2"), ("moe", "EP 4"), ("shared-kv", "TP 4")}
FP8_FORMAT = Fp8Quantization().activations
SEQUENCES = ([3, 1, 4, 1, 5, 9, 2], [6, 5, 3], [5, 8, 9, 7, 9])


def _flat_params(model) -> dict[str, jax.Array]:
    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(state)}


@functools.cache
def checkpoints(family: str, root: str) -> tuple[str, str]:
    """(a float32 checkpoint of random weights, its FP8 form) under `root`."""
    config = FAMILIES[family]
    model = build_model(config, bj.Topology(), seed=7)
    source, target = f"{root}/{family}", f"{root}/{family}-fp8"
    save_checkpoint(config, _flat_params(model), source)
    write_fp8_checkpoint(source, target)
    return source, target


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("fp8"))


def _runner(directory: str, mesh_name: str, **options) -> ShardedCausalLM:
    dp, tp, ep, dispatch = MESHES[mesh_name]
    mesh = make_mesh(dp, tp)
    built = BuildOptions(moe_dispatch=dispatch, **options)
    model = load_model(directory, mesh, built, moe_ep=ep)
    return ShardedCausalLM(model, mesh)


@functools.cache
def reference_logits(family: str, root: str) -> np.ndarray:
    """The float64 model on the dequantized weights, its activations quantized by
    `independent_token_groups` (every projection's input, the quantized reads' too)."""
    _, fp8 = checkpoints(family, root)
    with (
        jax.enable_x64(True),
        mock.patch("models.layers.fp8_linear.quantize_rows", independent_rows),
        mock.patch(
            "boundary_jax.designs.quantized.quantize_token_groups_reference",
            independent_token_groups,
        ),
    ):
        dequantized = Fp8Quantization(Fp8Weights.DEQUANTIZED)
        runner = _runner(fp8, "TP 1", dtype=jnp.float64, quantization=dequantized)
        return runner.forward(SEQUENCES)


def independent_token_groups(x: jax.Array, group: int = 128) -> tuple[jax.Array, jax.Array]:
    """Hugging Face's fine-grained activation format, written here: per `group` features a
    float32 scale `max |x| / E4M3_MAX` (as the product with its float32 reciprocal, the
    checkpoints' arithmetic) and the values `x / scale` rounded to float8_e4m3fn."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group, group).astype(acc)
    scales = (jnp.max(jnp.abs(groups), axis=-1) * np.float32(1 / E4M3_MAX)).astype(jnp.float32)
    divisor = jnp.where(scales > 0, scales, 1)[..., None].astype(acc)
    values = jnp.clip(groups / divisor, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return values.reshape(x.shape), scales


def independent_rows(x, *, activation=None, group=128, impl=None):
    """`quantize_rows` with `independent_token_groups` (the activation applied as the model
    applies it)."""
    del impl
    return independent_token_groups(activated_reference(x, activation), group)


@pytest.mark.parametrize(
    ("family", "mesh"),
    [
        pytest.param(
            *case, id="-".join(case), marks=[pytest.mark.slow] if case in SLOW_CASES else []
        )
        for case in CASES
    ],
)
def test_fp8_model_equals_float64_on_dequantized_weights(family, mesh, root):
    """The FP8 checkpoint on this mesh (FP8 blocks and scales of every rank's own shard, FP8
    inputs into every projection and expert): logits within 1e-5 of the largest of the model
    on the dequantized weights with the same activation quantization.

    Both run in float64, so both quantize the same activations: in float32 an activation
    within a rounding of the midpoint between two FP8 values may round the other way, and one
    such element moves the logits by ~1e-2 (float32 is checked below, and the kernels' float32
    sums in tests/pallas_kernels/test_fp8.py)."""
    _, fp8 = checkpoints(family, root)
    with jax.enable_x64(True):
        runner = _runner(fp8, mesh, dtype=jnp.float64)
        assert runner.model.options.quantization.weights is Fp8Weights.FP8
        got = runner.forward(SEQUENCES)
    want = reference_logits(family, root)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_fp8_model_under_context_parallelism(root):
    """CP 2 x TP 2 (each sequence's rows in zigzag order over the CP ranks, keys and values
    all-gathered): the FP8 model equals the float64 reference as on the other meshes, since
    rows are quantized per token wherever they lie."""
    _, fp8 = checkpoints("dense", root)
    mesh = bj.make_mesh(bj.Topology(attn_cp=2, attn_tp=2))
    with jax.enable_x64(True):
        got = ShardedCausalLM(load_model(fp8, mesh, BuildOptions(dtype=jnp.float64)), mesh).forward(
            SEQUENCES
        )
    want = reference_logits("dense", root)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_float32_fp8_model(root):
    """In float32 (float32 sums around FP8 products) the dense FP8 model on TP 4 stays within a
    few FP8 roundings of the float64 reference. An activation within float32's error of an
    FP8 rounding boundary may round to the other neighbour, and which one turns on the float32
    summation order (it differs between meshes and JAX releases: 1-1.4% of the largest logit
    seen), so the bound is 5% of it; the float64 tests above hold every mesh to 1e-5, and a
    missing or doubled sum moves the logits by their own size."""
    _, fp8 = checkpoints("dense", root)
    got = _runner(fp8, "TP 4").forward(SEQUENCES)
    want = reference_logits("dense", root)
    np.testing.assert_allclose(got, want, atol=5e-2 * np.abs(want).max(), rtol=0)


def test_each_device_reads_its_blocks_and_their_scales(root):
    """On TP 4 a column-parallel FP8 weight's shard is its rows of the stored [out, in] values
    (and its scales' rows); a row-parallel one's its columns."""
    _, fp8 = checkpoints("dense", root)
    file = Path(fp8) / "model.safetensors"
    state = nnx.state(_runner(fp8, "TP 4").model)
    with safe_open(str(file), framework="numpy") as stored:
        scales = stored.get_tensor("model.layers.1.mlp.down_proj.weight_scale_inv")
    whole = (slice(None), slice(None))
    for param, want, axis in (
        (state["layers"][0]["attn"]["q_proj"]["weight"], _stored(file, "q_proj", whole), 0),
        (state["layers"][0]["attn"]["q_proj"]["weight_scale_inv"], None, 0),
        (state["layers"][1]["mlp"]["down_proj"]["weight_scale_inv"], scales, 1),
    ):
        value = param.get_value()
        if want is None:
            assert value.shape == (4, 2) and value.sharding.spec[0] is not None
            continue
        for shard in value.addressable_shards:
            assert shard.data.shape[axis] == want.shape[axis] // 4
            np.testing.assert_array_equal(
                np.asarray(shard.data, np.float32), want[shard.index].astype(np.float32)
            )


def _stored(file: Path, projection: str, index) -> np.ndarray:
    return read_stored_fp8(file, f"model.layers.0.self_attn.{projection}.weight", index)


def test_quantizing_on_load_equals_the_fp8_checkpoint(root):
    """`--quantize fp8` on the float32 checkpoint gives the FP8 checkpoint's parameters, bit for
    bit, each device quantizing its own blocks."""
    source, fp8 = checkpoints("moe", root)
    mesh = make_mesh(2, 2)
    quantized = load_model(source, mesh, BuildOptions(quantization=Fp8Quantization()))
    stored = load_model(fp8, mesh)
    chex.assert_trees_all_equal(nnx.state(quantized), nnx.state(stored))
    values = nnx.state(stored)["layers"][0]["mlp"]["gate_up_proj"].get_value()
    assert values.dtype == jnp.float8_e4m3fn


def test_a_split_across_a_block_edge_is_rejected(root):
    """Attention DP 2 x TP 4 would split the MLP's 512 columns over 8 ranks: 64 each, half a
    block."""
    _, fp8 = checkpoints("dense", root)
    with pytest.raises(ValueError, match=r"whole blocks.*\(512\) over 8 ranks gives 64"):
        load_model(fp8, make_mesh(2, 4))


def test_fp8_checkpoint_blocks_reach_the_e4m3_maximum(root):
    """Each quantized 128 x 128 block of the written checkpoint reaches ml_dtypes'
    float8_e4m3fn maximum (its scale is max |w| / 448, as Hugging Face's FP8 checkpoints), and
    values times scales give the float32 weights back within e4m3's rounding."""
    source, fp8 = checkpoints("dense", root)
    name = "model.layers.0.mlp.down_proj.weight"
    with safe_open(str(Path(source) / "model.safetensors"), framework="numpy") as stored:
        weight = stored.get_tensor(name)
    file = Path(fp8) / "model.safetensors"
    values = read_stored_fp8(file, name, (slice(None), slice(None))).astype(np.float64)
    with safe_open(str(file), framework="numpy") as stored:
        scales = stored.get_tensor(name + "_scale_inv").astype(np.float64)
    blocks = values.reshape(values.shape[0] // 128, 128, values.shape[1] // 128, 128)
    np.testing.assert_array_equal(np.abs(blocks).max(axis=(1, 3)), E4M3_MAX)
    scale = np.repeat(np.repeat(scales, 128, axis=0), 128, axis=1)
    # e4m3 keeps 3 mantissa bits (a relative half-step of 2^-4) down to its subnormals (a step
    # of 2^-9 of the scale).
    error = np.abs(values * scale - weight)
    assert np.all(error <= 2**-4 * np.abs(weight) + 2**-9 * scale), error.max()


def test_fp8_checkpoint_layout(root):
    """The written checkpoint has Hugging Face's FP8 layout: float8 [out, in] weights with
    float32 [out / 128, in / 128] weight_scale_inv; embeddings, norms and routers unquantized."""
    _, fp8 = checkpoints("moe", root)
    config = json.loads((Path(fp8) / "config.json").read_text())
    assert config["quantization_config"] == FP8_CONFIG
    expert = "model.layers.0.mlp.experts.3.down_proj"
    with safe_open(str(Path(fp8) / "model.safetensors"), framework="numpy") as stored:
        layout = {
            name: (stored.get_slice(name).get_dtype(), stored.get_slice(name).get_shape())
            for name in stored.keys()  # noqa: SIM118 - safe_open has no __iter__
        }
    assert layout[f"{expert}.weight"] == ("F8_E4M3", [256, 512])
    assert layout[f"{expert}.weight_scale_inv"] == ("F32", [2, 4])
    assert layout["model.embed_tokens.weight"][0] == "F32"
    assert layout["model.layers.0.mlp.gate.weight"][0] == "F32"
    assert not any(name.startswith("model.layers.0.mlp.gate.weight_") for name in layout)


@pytest.mark.slow
def test_random_fp8_weights_are_drawn_from_the_abstract_state():
    """build_model draws FP8 values and their block scales through the one initializer: the
    same on a mesh as without one, the scales varying by block, and a DEQUANTIZED model of the
    seed holds exactly the FP8 model's values times their scales."""
    config = PRESETS["tiny-qwen3-moe-fp8"]
    topology = bj.Topology(attn_tp=2)
    fp8 = Fp8Quantization()
    plain = _flat_params(build_model(config, topology, BuildOptions(quantization=fp8)))
    placed = _flat_params(
        build_model(config, topology, BuildOptions(quantization=fp8), mesh=bj.make_mesh(topology))
    )
    chex.assert_trees_all_equal(placed, plain)
    dequantized = _flat_params(
        build_model(
            config, topology, BuildOptions(quantization=Fp8Quantization(Fp8Weights.DEQUANTIZED))
        )
    )
    std = config.initializer_range
    for values_path, scales_path in (
        ("layers.0.attn.kv_proj.weight", "layers.0.attn.kv_proj.weight_scale_inv"),
        ("layers.0.mlp.gate_up_proj", "layers.0.mlp.gate_up_proj_scale_inv"),
        ("layers.1.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight_scale_inv"),
    ):
        values, scales = plain[values_path], plain[scales_path]
        assert values.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float32
        assert set(np.unique(np.asarray(scales) * VALUE_SPREAD / std).round(6)) == {0.5, 1, 2}
        blocks = np.asarray(scales).repeat(128, axis=-2).repeat(128, axis=-1)
        want = np.asarray(values, np.float32) * blocks
        np.testing.assert_array_equal(np.asarray(dequantized[values_path]), want)
    assert "layers.0.attn.q_proj.weight_scale_inv" not in dequantized
    assert plain["embed.embedding"].dtype == jnp.float32  # the embedding stays unquantized


def test_families_without_fp8_projections_refuse_quantization():
    """DeepSeek's latent attention (like Nemotron-H's mixers) makes its projections without
    `linears`: an FP8 build is refused when it starts, naming the fix."""
    with pytest.raises(NotImplementedError, match="Build it without quantization"):
        build_model(
            PRESETS["tiny-deepseek-v3"], bj.Topology(), BuildOptions(quantization=Fp8Quantization())
        )


def test_mhc_reads_cannot_quantize():
    """An MHC read mixes its streams before the norm: an FP8 model with hyper-connections is
    refused when it is built."""
    with pytest.raises(NotImplementedError, match="quantized read requires an add \\+ norm"):
        nnx.eval_shape(
            lambda: build_model(
                PRESETS["tiny-qwen3-fp8"],
                bj.Topology(),
                BuildOptions(
                    hyper_connections=HyperConnections(hc_mult=2), quantization=Fp8Quantization()
                ),
            )
        )


def test_plan_quantizes_on_load_and_reports_bytes_per_device(root, capsys):
    """`plan --quantize fp8` on a float32 checkpoint: the stages read FP8 input and each device
    holds its share of one byte per projection weight, a float32 scale per block and the
    unquantized rest."""
    source, _ = checkpoints("dense", root)
    args = ["plan", "--checkpoint", source, "--quantize", "fp8", "--mesh", "attn_tp=2"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {stage["input_format"] for stage in report["stages"]} == {FP8_FORMAT.name}
    abstract = nnx.eval_shape(
        lambda: build_model(
            PRESETS["tiny-qwen3-fp8"],
            bj.Topology(attn_tp=2),
            BuildOptions(quantization=Fp8Quantization()),
        )
    )
    state = nnx.state(abstract, nnx.Param)
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    want = 0
    for path, variable in nnx.to_flat_state(state):
        split = any(entry is not None for entry in specs[path].get_value())
        want += variable.size * variable.dtype.itemsize // (2 if split else 1)
    assert report["weight_bytes_per_device"] == [want, want]
    # Per layer: q, k|v, o, gate|up, down in FP8 (458,752 bytes per rank) and their scales.
    assert abstract.layers[0].attn.q_proj.weight.dtype == jnp.float8_e4m3fn
    assert want < 1.1e6


def _dequantized_rows(x: jax.Array) -> np.ndarray:
    values, scales = quantize_token_groups_reference(x)
    return np.asarray(dequantize_token_groups_reference(values, scales, x.dtype))


@pytest.mark.slow
def test_fp8_ffns_quantize_their_gated_activation():
    """An FP8 MLP and an FP8 expert compute down(q(silu(gate(q(x))) * up(q(x)))), q the
    token-group quantization, gate the first of the stacked parts: both equal that formula on
    their dequantized float64 weights."""
    config = PRESETS["tiny-qwen3-moe-fp8"]
    hidden, width, tokens = config.hidden_size, config.moe.expert_intermediate_size, 5
    silu_product = lambda g, u: jax.nn.silu(jnp.asarray(g)) * u  # noqa: E731
    with jax.enable_x64(True):
        quantization = Fp8Quantization(Fp8Weights.DEQUANTIZED)
        x = jax.random.normal(jax.random.key(1), (tokens, hidden), jnp.float64)
        rows = _dequantized_rows(x)
        mlp = SwiGLU(
            hidden,
            width,
            topology=bj.Topology(),
            dtype=jnp.float64,
            linears=Fp8Linears(quantization),
            rngs=nnx.Rngs(0),
        )
        gate, up = np.asarray(mlp.gate_up_proj.weight[...])  # [2, width, hidden]
        activated = _dequantized_rows(silu_product(rows @ gate.T, rows @ up.T))
        want = activated @ np.asarray(mlp.down_proj.weight[...]).T
        got = jax.jit(lambda x: mlp(x))(x)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)

        experts = Fp8MoeFfn(
            hidden,
            config.moe,
            bj.Topology(),
            quantization=quantization,
            dtype=jnp.float64,
            rngs=nnx.Rngs(0),
        )
        top_k, count = config.moe.top_k, config.moe.num_experts
        chosen = (np.arange(tokens)[:, None] * 3 + np.arange(top_k)[None]) % count
        routing = Routing(jnp.full((tokens, top_k), 1 / top_k), jnp.asarray(chosen, jnp.int32))
        got = np.asarray(jax.jit(lambda x, routing: experts.routed(x, routing))(x, routing))
        gate_up, down = np.asarray(experts.gate_up_proj[...]), np.asarray(experts.down_proj[...])
        gate, up = (np.einsum("th,tkwh->tkw", rows, gate_up[chosen, part]) for part in (0, 1))
        activated = _dequantized_rows(silu_product(gate, up).reshape(tokens * top_k, width))
        want = np.einsum("tkw,tkhw->tkh", activated.reshape(tokens, top_k, width), down[chosen])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# Three sequences of 70 tokens: with top-2 of 8 experts an even share of 52 rows, capacity
# buckets of 72 and 80, which the busiest expert's rows fit on every mesh below.
LONG_SEQUENCES = tuple(
    [int(t) for t in np.random.default_rng(seed).integers(0, 256, 70)] for seed in range(3)
)


@pytest.mark.parametrize("mesh", ["EP 4", pytest.param("TP 4", marks=pytest.mark.slow)])
def test_fp8_experts_padded_to_capacity_inside_the_sharded_model(mesh, root, monkeypatch):
    """The experts padded to capacity buckets inside the sharded model, in float64, equal the
    grouped products: on EP 4 all-to-all (each rank its two experts' received rows) and TP 4
    (each rank a slice of every expert's width). The products' float64 reference stands in
    for the wgmma kernel, which tests/models/layers/moe/test_fp8_moe.py runs in the Mosaic GPU
    interpreter (one device at a time). The grouped fallback is poisoned in the padded model,
    so every layer runs a bucket."""
    _, fp8 = checkpoints("moe", root)
    reference = functools.partial(fp8_moe.fp8_batched_matmul, impl=Fp8MatmulImpl.XLA)
    monkeypatch.setattr(
        fp8_moe, "fp8_batched_matmul", lambda *args, impl, **kw: reference(*args, **kw)
    )
    with jax.enable_x64(True):
        want = _runner(fp8, mesh, dtype=jnp.float64).forward(LONG_SEQUENCES)
        grouped = fp8_moe.fp8_grouped_matmul
        monkeypatch.setattr(
            fp8_moe,
            "fp8_grouped_matmul",
            lambda *args, **kw: jnp.full_like(grouped(*args, **kw), jnp.nan),
        )
        padded = Fp8Quantization(grouped=Fp8GroupedImpl.PADDED_GPU_INTERPRET)
        got = _runner(fp8, mesh, dtype=jnp.float64, quantization=padded).forward(LONG_SEQUENCES)
    np.testing.assert_allclose(got, want, atol=1e-10 * np.abs(want).max(), rtol=0)
