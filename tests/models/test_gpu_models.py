"""Whole models on GPU, bf16: the GPU kernels the runtime picks against the reference paths.

Skipped without a GPU (the CPU suite covers the reference paths against the golden files). On the
GPU machine run with `JAX_PLATFORMS=cuda,cpu` (tests/conftest.py otherwise forces the CPU).
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import boundary_jax as bj
from models.build import load_model
from models.inputs.rows import pack_sequences
from models.layers.attention.self_attention import AttentionImpl
from models.options import BuildOptions
from models.serving import buckets, runtime
from models.serving.buckets import CUBLAS_DECODE_ROWS, DecodeLoop
from models.serving.runtime import ShardedCausalLM

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def _golden(name: str):
    prompts = json.loads((GOLDEN / name / "prompts.json").read_text())
    return prompts, np.load(GOLDEN / name / "reference.npz")


def _relative(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_cudnn_model_generates_the_reference_tokens(name, tp):
    """bf16 greedy tokens with cuDNN attention (packed prefill, cache decode) equal the jnp
    attention's, and both logits stay within bf16 rounding of transformers' bf16 logits."""
    if jax.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    prompts, reference = _golden(name)
    mesh = bj.make_mesh(bj.Topology(attn_tp=tp))
    tokens, logits = {}, {}
    for impl in (AttentionImpl.XLA, AttentionImpl.CUDNN):
        model = load_model(GOLDEN / name, mesh, BuildOptions(dtype=jnp.bfloat16, attention=impl))
        runner = ShardedCausalLM(model, mesh)
        logits[impl] = runner.forward(prompts)
        compiled = runner.lower_forward(prompts).compile().as_text()
        assert ("__cudnn$fmha" in compiled) == (impl is AttentionImpl.CUDNN)
        tokens[impl] = runner.generate(prompts, reference["generated"].shape[1])
    np.testing.assert_array_equal(tokens[AttentionImpl.CUDNN], tokens[AttentionImpl.XLA])
    for impl in logits:
        assert _relative(logits[impl], reference["logits_bf16"]) < 5e-2, impl


def test_cudnn_prefill_of_equal_sequences_runs_in_windows():
    """Prompts of one length, packed with that length as their bound, reach cuDNN as windows
    ([sequences, length] causal, not the ragged layout) and give the jnp attention's logits
    within bf16 rounding."""
    prompts, _ = _golden("llama")
    length = 5
    prompts = [p[:length] for p in prompts if len(p) >= length]
    mesh = bj.make_mesh(bj.Topology())
    logits = {}
    for impl in (AttentionImpl.XLA, AttentionImpl.CUDNN):
        runner = ShardedCausalLM(
            load_model(GOLDEN / "llama", mesh, BuildOptions(dtype=jnp.bfloat16, attention=impl)),
            mesh,
        )
        packed = pack_sequences(prompts, runner.topology, max_sequence_rows=length)
        assert packed.rows.window_rows == length
        rows, batch = runner.place(packed)
        logits[impl] = packed.unpack(np.asarray(runner.forward_placed(rows, batch)))
    compiled = jax.jit(runner.forward_placed).lower(rows, batch).compile().as_text()
    calls = [line for line in compiled.splitlines() if "__cudnn$fmha" in line]
    assert calls and all(f"[{len(prompts)},{length}," in line for line in calls)
    assert _relative(logits[AttentionImpl.CUDNN], logits[AttentionImpl.XLA]) < 5e-2


def test_moe_model_with_gpu_expert_kernels_matches_transformers():
    """bf16 Qwen3-MoE with the GPU grouped matmul the runtime picks (Pallas by routed rows) stays
    within bf16 rounding of transformers' bf16 logits, at TP 1 and (two GPUs) EP 2."""
    prompts, reference = _golden("qwen3_moe")
    for tp in (1, 2)[: jax.device_count()]:
        mesh = bj.make_mesh(bj.Topology(attn_tp=tp))
        model = load_model(GOLDEN / "qwen3_moe", mesh, BuildOptions(dtype=jnp.bfloat16), moe_ep=tp)
        got = ShardedCausalLM(model, mesh).forward(prompts)
        assert _relative(got, reference["logits_bf16"]) < 5e-2, tp


def test_graphed_decode_loop_gives_the_blocked_loops_tokens(monkeypatch):
    """On one GPU the decode loop runs inside CUDA graphs (`decode_loop`); its greedy
    tokens equal those of the same model decoding in blocks of static trip count under XLA's
    default options, over a step count that leaves a remainder past the blocks."""
    prompts, _ = _golden("llama")
    mesh = bj.make_mesh(bj.Topology())
    model = load_model(GOLDEN / "llama", mesh, BuildOptions(dtype=jnp.bfloat16))
    graphed = ShardedCausalLM(model, mesh).generate(prompts, 23)
    monkeypatch.setattr(
        runtime, "decode_loop", lambda platform, capacity, devices, rows: DecodeLoop(block=4)
    )
    blocked = ShardedCausalLM(model, mesh).generate(prompts, 23)
    np.testing.assert_array_equal(graphed, blocked)


def test_cublas_decode_gives_the_default_gemms_tokens(monkeypatch):
    """From CUBLAS_DECODE_ROWS rows a one-GPU decode program multiplies through cuBLAS with XLA's
    dot merger off (`decode_loop`); with float32 products its greedy tokens equal those of the
    same decode under XLA's default GEMMs."""
    prompts, _ = _golden("llama")
    prompts = (prompts * CUBLAS_DECODE_ROWS)[:CUBLAS_DECODE_ROWS]
    mesh = bj.make_mesh(bj.Topology())
    model = load_model(GOLDEN / "llama", mesh, BuildOptions(dtype=jnp.float32))
    with jax.default_matmul_precision("float32"):
        runner = ShardedCausalLM(model, mesh)
        cublas = runner.generate(prompts, 9)
        monkeypatch.setattr(buckets, "CUBLAS_DECODE_ROWS", 10**9)
        default = ShardedCausalLM(model, mesh).generate(prompts, 9)
    forms = [name[-1] for name in runner.compiled_shapes() if name[0] == "_decode_program"]
    assert [dict(form.options)["xla_gpu_enable_triton_gemm"] for form in forms] == [False]
    np.testing.assert_array_equal(cublas, default)


def _merged_width(config: dict) -> int:
    """The output width of the q and kv products of `config`'s attention joined into one."""
    heads = config["num_attention_heads"]
    if "kv_lora_rank" in config:  # latent attention: q (or q_a) beside kv_a
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        query = config["q_lora_rank"] or heads * (
            config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        )
        return query + latent
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return (heads + 2 * config["num_key_value_heads"]) * head_dim


@pytest.mark.parametrize("family", ["llama", "deepseek_v2", "deepseek_v3"])
def test_prefill_does_not_concatenate_the_q_and_kv_weights(family):
    """The prefill's q and kv products stay two products: merged by XLA's dot merger (they share
    their input), they would concatenate both weights on every call."""
    prompts, _ = _golden(family)
    config = json.loads((GOLDEN / family / "config.json").read_text())
    hidden, merged = config["hidden_size"], _merged_width(config)
    mesh = bj.make_mesh(bj.Topology())
    runner = ShardedCausalLM(
        load_model(GOLDEN / family, mesh, BuildOptions(dtype=jnp.bfloat16)), mesh
    )
    compiled = runner.lower_forward(prompts).compile().as_text()
    concatenated = [
        line
        for line in compiled.splitlines()
        if "concatenate(" in line
        and (f"[{hidden},{merged}]" in line or f"[{merged},{hidden}]" in line)
    ]
    assert not concatenated, concatenated[0]
