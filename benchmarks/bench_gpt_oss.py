"""A GPT-OSS-20B-shaped model end to end: boundary-jax against one `jax.jit` with GSPMD, and the
roofline.

The model is GPT-OSS-20B's shape (24 layers alternating a 128-token sliding window and full
attention, hidden 2880, 64 query heads over 8 kv heads of width 64 with a sink logit per head
and q/k/v/o biases, YaRN RoPE; every layer an MoE of 32 biased clamped-SwiGLU experts of width
2880, top-4 by a biased router; vocab 201088), bf16, random weights (about 21B parameters, 42 GB:
one H200 holds it). The baseline is the same model written as one jitted function over global
arrays with the project's weights (the same buffers), XLA's GSPMD placing anything that needs
placing: attention with sinks through the project's cuDNN kernels on a GPU (cuDNN's output scaled
by the sink's share of each row's denominator; `jnp` elsewhere), and the project's own
router and grouped expert matmuls (`route`, `finalized_expert_outputs`), so "project / GSPMD"
isolates what the boundaries and packed rows cost or gain. With `--attn-tp` / `--moe-ep` both
run over several GPUs, the baseline with the project's shardings. Before timing, the last-row
prefill logits of the baseline are compared with the project's forward.

Cases (`gspmd_baseline.compare_with_baseline`): decode of 8 and 64 sequences over a 1024-token
KV cache (`--cache`; a jitted loop of `STEPS` greedy steps, time per step), and prefill of 4096
tokens (8 x 512 and 1 x 4096) writing the cache and sampling each last row. Roofline: decode,
the bytes a step must read per GPU (the attention and router weights, the experts its tokens
reach under even routing, the LM head and the KV cache, each sliding layer's up to its window)
over the HBM bandwidth; prefill, its matmul and attention FLOPs over the dense bf16 peak (both
`benchmarks.common`'s H200 figures).

Measured in `benchmarks/RESULTS.md` (runs 31 and 32). Run on the GPU machine from the repository
root:
  python3 -m benchmarks.bench_gpt_oss                      # one H200
  python3 -m benchmarks.bench_gpt_oss --attn-tp 2 --moe-ep 2
  python3 -m benchmarks.bench_gpt_oss --smoke              # a tiny config: the CPU check
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

import boundary_jax as bj
from models.build import build_model
from models.config import DecoderConfig, YarnRopeScaling, read_hf_config
from models.layers.attention.cudnn import decode_cache_cudnn, prefill_attention_cudnn
from models.layers.attention.kv_cache import KVCache
from models.layers.attention.rope import apply_rope, rope_inv_freq
from models.layers.clamped_swiglu import ClampedSwiGlu
from models.layers.moe.experts import ExpertBiases, finalized_expert_outputs
from models.layers.moe.routing import route
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

from .common import (
    PEAK_FLOPS,
    attention_kernel,
    hbm_bytes_per_s,
    header,
    print_table,
    profile_into,
)
from .gspmd_baseline import JitBaseline, auto_mesh, compare_with_baseline, path_params, rms_norm

STEPS = 32
CACHE = 1024
REPEATS = 15
"""Timed calls of each program, project and baseline in turn."""
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "tie_word_embeddings": False,
}
"""GPT-OSS-20B's `config.json` (the keys the reader takes; `layer_types` alternate by default)."""
SMOKE = GPT_OSS_20B | {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
}
"""A tiny model of the same structure, for a CPU check of the script."""


# -- the GSPMD baseline: the same model over global arrays, one jax.jit ----------------------


def softmax_with_sinks(scores: jax.Array, visible: jax.Array, sinks: jax.Array) -> jax.Array:
    """float32 [batch, kv, group, queries, keys] scores' softmax over the visible keys (a mask
    of the same rank), each head's sink logit ([kv, group]) in the denominator."""
    scores = jnp.where(visible, scores, -jnp.inf)
    sink = sinks.astype(jnp.float32).reshape(1, *sinks.shape, 1, 1)
    peak = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
    weights = jnp.exp(scores - peak)
    return weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink - peak))


def make_baseline(config: DecoderConfig, impl):
    """(last-row logits of prefill, prefill, decode), jitted over global arrays; the caches
    (k, v: [sequences, cache, kv heads, head_dim] per layer) are donated. On a GPU the attention
    runs through the project's cuDNN kernels with sinks (the same kernels as the project's),
    elsewhere in `jnp`."""
    heads, kv, d, eps = config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps
    group, moe = heads // kv, config.moe
    cudnn = attention_kernel() == "cudnn"
    activation = ClampedSwiGlu(moe.swiglu_limit, moe.swiglu_alpha)

    def rope(x, positions, layer_index):
        attention = config.layer_attention(layer_index)
        scaling = attention.rope_scaling
        factor = scaling.attention_factor if isinstance(scaling, YarnRopeScaling) else 1.0
        inv_freq = rope_inv_freq(d, attention.rope_theta, scaling)
        return apply_rope(x, positions, inv_freq, attention_factor=factor)

    def qkv(layer, index, h, positions):
        q = h @ layer["attn/q_proj/kernel"] + layer["attn/q_proj/bias"]
        kv_kernel = layer["attn/kv_proj/kernel"].reshape(h.shape[1], -1)
        k_v = h @ kv_kernel + layer["attn/kv_proj/bias"].reshape(-1)
        k, v = jnp.split(k_v, 2, axis=-1)
        q = rope(q.reshape(-1, heads, d), positions, index)
        k = rope(k.reshape(-1, kv, d), positions, index)
        return q, k, v.reshape(-1, kv, d)

    def attention_out(layer, out):
        return out.reshape(out.shape[0], -1) @ layer["attn/o_proj/kernel"] + layer[
            "attn/o_proj/bias"
        ].astype(out.dtype)

    def ffn(layer, x):
        h = rms_norm(x, layer["post_attn_norm/weight"], eps)
        routing = route(
            h, layer["mlp/router"], top_k=moe.top_k, renormalize=True, bias=layer["mlp/router_bias"]
        )
        biases = ExpertBiases(layer["mlp/gate_up_proj_bias"], layer["mlp/down_proj_bias"])
        out = finalized_expert_outputs(
            h,
            routing,
            layer["mlp/gate_up_proj"],
            layer["mlp/down_proj"],
            impl=impl,
            activation=activation,
            biases=biases,
        )
        return x + out

    def logits(params, x):
        x = rms_norm(x, params["final_norm"], eps)
        return (x @ params["lm_head"])[..., : config.vocab_size].astype(jnp.float32)

    def prefill(params, ids, caches):
        batch, length = ids.shape
        positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)
        distance = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
        x = params["embed"][ids.reshape(-1)]
        updated = []
        for index, layer in enumerate(params["layers"]):
            h = rms_norm(x, layer["input_norm/weight"], eps)
            q, k, v = qkv(layer, index, h, positions)
            if caches is not None:
                k_cache, v_cache = caches[index]
                put = lambda c, new: lax.dynamic_update_slice(  # noqa: E731
                    c, new.reshape(batch, length, kv, d).astype(c.dtype), (0, 0, 0, 0)
                )
                updated.append((put(k_cache, k), put(v_cache, v)))
            window = config.layer_attention(index).sliding_window
            if cudnn:
                out = prefill_attention_cudnn(
                    q,
                    k.astype(q.dtype),
                    v.astype(q.dtype),
                    jnp.repeat(jnp.arange(batch, dtype=jnp.int32), length),
                    max_segments=batch,
                    scale=d**-0.5,
                    window_rows=length,
                    sliding_window=window,
                    sinks=layer["attn/sinks"],
                )
                x = x + attention_out(layer, out)
                x = ffn(layer, x)
                continue
            visible = distance >= 0
            if window is not None:
                visible &= distance < window
            q = q.reshape(batch, length, kv, group, d)
            scores = jnp.einsum(
                "blkgd,bskd->bkgls",
                q,
                k.reshape(batch, length, kv, d),
                preferred_element_type=jnp.float32,
            )
            probs = softmax_with_sinks(
                scores * d**-0.5, visible[None, None, None], layer["attn/sinks"].reshape(kv, group)
            )
            out = jnp.einsum(
                "bkgls,bskd->blkgd", probs.astype(v.dtype), v.reshape(batch, length, kv, d)
            )
            x = x + attention_out(layer, out.reshape(batch * length, heads, d))
            x = ffn(layer, x)
        last = logits(params, x.reshape(batch, length, -1)[:, -1])
        return jnp.argmax(last, axis=-1).astype(jnp.int32), last, updated

    @jax.jit
    def logits_of_prefill(params, ids):
        return prefill(params, ids, None)[1]

    def prefill_step(params, ids, caches):
        tokens, _, caches = prefill(params, ids, caches)
        return tokens, caches

    def decode(params, tokens, positions, caches, steps):
        rows = jnp.arange(tokens.shape[0])
        keys_at = jnp.arange(caches[0][0].shape[1])

        def step(_, carry):
            tokens, positions, caches = carry
            x = params["embed"][tokens]
            updated = []
            for index, layer in enumerate(params["layers"]):
                h = rms_norm(x, layer["input_norm/weight"], eps)
                q, k, v = qkv(layer, index, h, positions)
                k_cache = caches[index][0].at[rows, positions].set(k.astype(jnp.bfloat16))
                v_cache = caches[index][1].at[rows, positions].set(v.astype(jnp.bfloat16))
                updated.append((k_cache, v_cache))
                window = config.layer_attention(index).sliding_window
                if cudnn:
                    out = decode_cache_cudnn(
                        q,
                        KVCache(k_cache, v_cache),
                        positions,
                        d**-0.5,
                        sliding_window=window,
                        sinks=layer["attn/sinks"],
                    )
                    x = x + attention_out(layer, out)
                    x = ffn(layer, x)
                    continue
                distance = positions[:, None] - keys_at[None, :]
                visible = distance >= 0
                if window is not None:
                    visible &= distance < window
                q = q.reshape(-1, kv, group, d)
                scores = jnp.einsum(
                    "bkgd,bskd->bkgs", q, k_cache, preferred_element_type=jnp.float32
                )
                probs = softmax_with_sinks(
                    scores[..., None, :] * d**-0.5,
                    visible[:, None, None, None, :],
                    layer["attn/sinks"].reshape(kv, group),
                )[..., 0, :]
                out = jnp.einsum("bkgs,bskd->bkgd", probs.astype(v_cache.dtype), v_cache)
                x = x + attention_out(layer, out.reshape(-1, heads, d))
                x = ffn(layer, x)
            tokens = jnp.argmax(logits(params, x), axis=-1).astype(jnp.int32)
            return tokens, positions + 1, updated

        tokens, _, caches = lax.fori_loop(0, steps, step, (tokens, positions, list(caches)))
        return tokens, caches

    return (
        logits_of_prefill,
        jax.jit(prefill_step, donate_argnums=(2,)),
        jax.jit(decode, static_argnums=4, donate_argnums=3),
    )


# -- the roofline ----------------------------------------------------------------------------


def _weights(config: DecoderConfig) -> tuple[int, int]:
    """Per layer: (attention and router elements, one expert's elements)."""
    h, d, moe = config.hidden_size, config.head_dim, config.moe
    attention = h * d * (2 * config.num_heads + 2 * config.num_kv_heads) + h * moe.num_experts
    return attention, 3 * h * moe.expert_intermediate_size


def decode_bytes(config: DecoderConfig, sequences: int, context: float, gpus: int) -> float:
    """Bytes one decode step must read per GPU (bf16): attention and router weights, the experts
    its tokens reach (expected under even routing), the LM head and the KV cache (a sliding
    layer's up to its window), all split evenly over `gpus`."""
    moe = config.moe
    attention, expert = _weights(config)
    reached = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** sequences)
    elements = config.num_layers * (attention + reached * expert)
    elements += config.hidden_size * config.vocab_size
    for index in range(config.num_layers):
        window = config.layer_attention(index).sliding_window
        seen = context if window is None else min(context, window)
        elements += sequences * seen * 2 * config.num_kv_heads * config.head_dim
    return 2 * elements / gpus


def prefill_flops(config: DecoderConfig, sequences: int, length: int, gpus: int) -> float:
    """Matmul and attention FLOPs of a prefill per GPU (the LM head on each last row only)."""
    moe = config.moe
    attention, expert = _weights(config)
    tokens = sequences * length
    flops = 2 * tokens * config.num_layers * (attention + moe.top_k * expert)
    for index in range(config.num_layers):
        window = config.layer_attention(index).sliding_window
        pairs = sum(min(i + 1, window or length) for i in range(length)) * sequences
        flops += 2 * 2 * config.num_heads * config.head_dim * pairs
    return (flops + 2 * sequences * config.hidden_size * config.vocab_size) / gpus


# -- the cases -------------------------------------------------------------------------------


def run(
    config: DecoderConfig,
    topology: bj.Topology,
    *,
    cache: int,
    prefills,
    decodes,
    steps: int,
    fusions: str = "none",
) -> list[tuple]:
    mesh = bj.make_mesh(topology)
    provider = bj.fusions.platform_fusions(topology) if fusions == "auto" else bj.fusions.NO_FUSIONS
    options = BuildOptions(dtype=jnp.bfloat16, moe_dispatch=bj.MoeDispatch.GATHER, fusions=provider)
    model = build_model(config, topology, options, mesh=mesh)
    impl = model.grouped_matmul
    runner = ShardedCausalLM(model, mesh)
    del model
    gspmd = auto_mesh(mesh)
    params = path_params(runner, gspmd)
    cache_sharding = NamedSharding(gspmd, KVCache.partition_spec(topology))
    gpus = topology.attn_dp * topology.attn_tp

    def zero_caches(sequences, length):
        shape = KVCache.global_shape(config, topology, slots=sequences, max_len=length)
        zeros = lambda: jnp.zeros(shape, jnp.bfloat16, device=cache_sharding)  # noqa: E731
        return [(zeros(), zeros()) for _ in params["layers"]]

    return compare_with_baseline(
        runner,
        JitBaseline(params, *make_baseline(config, impl), zero_caches),
        prefills=prefills,
        decodes=decodes,
        cache=cache,
        steps=steps,
        repeats=REPEATS,
        prefill_roof_ms=lambda s, n: prefill_flops(config, s, n, gpus) / PEAK_FLOPS * 1e3,
        decode_roof_ms=lambda s, c: decode_bytes(config, s, c, gpus) / hbm_bytes_per_s() * 1e3,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny config and its own cases (CPU check)"
    )
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than 24")
    parser.add_argument("--attn-tp", type=int, default=1, help="attention TP over this many GPUs")
    parser.add_argument("--moe-ep", type=int, default=1, help="experts over this many of them")
    parser.add_argument("--profile", default=None, help="trace each case here, print kernels")
    parser.add_argument("--cache", type=int, default=CACHE, help="decode's KV cache length")
    parser.add_argument("--only", choices=("prefill", "decode"), default=None, help="one kind")
    parser.add_argument(
        "--prefills",
        nargs="+",
        default=["8x512", "1x4096"],
        help="prefill cases as SEQUENCESxLENGTH (4096 tokens each by default)",
    )
    parser.add_argument(
        "--fusions",
        choices=("none", "auto"),
        default="none",
        help="the project's boundary fusions (auto: the platform's, e.g. the Pallas add + norm)",
    )
    args = parser.parse_args()
    if args.profile:
        profile_into(args.profile)
    print(header("bench_gpt_oss"))
    config = read_hf_config(SMOKE if args.smoke else GPT_OSS_20B)
    if args.layers is not None:
        kinds = config.layer_types[: args.layers] if config.layer_types else None
        config = dataclasses.replace(config, num_layers=args.layers, layer_types=kinds)
    topology = bj.Topology(attn_tp=args.attn_tp, moe_ep=args.moe_ep)
    if args.smoke:
        shape = dict(cache=64, prefills=((2, 16), (1, 32)), decodes=(2, 8), steps=4)
    else:
        cases = tuple(tuple(int(n) for n in case.split("x")) for case in args.prefills)
        shape = dict(cache=args.cache, prefills=cases, decodes=(8, 64), steps=STEPS)
    if args.only:
        shape["decodes" if args.only == "prefill" else "prefills"] = ()
    results = run(config, topology, **shape, fusions=args.fusions)
    print(
        f"\n## GPT-OSS-20B shape ({config.num_layers} layers), bf16, attention TP "
        f"{args.attn_tp}, EP {args.moe_ep}, fusions {args.fusions}: project vs one-jit GSPMD "
        "(ms; ratio: GSPMD / project)"
    )
    print_table(
        ("case", "project ms", "GSPMD ms", "speedup", "project roofline", "logit err"), results
    )


if __name__ == "__main__":
    main()
