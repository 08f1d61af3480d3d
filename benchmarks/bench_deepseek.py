"""A DeepSeek-V2-Lite-shaped model end to end: boundary-jax against one `jax.jit` with GSPMD, and
the roofline.

The model is DeepSeek-V2-Lite's shape (27 layers, hidden 2048, 16 heads of latent attention with
kv_lora_rank 512 and a 64-wide rope key, no q LoRA; layer 0 a dense SwiGLU of width 10944, the
other 26 an MoE of 64 routed experts of width 1408, top-6 by softmax, and 2 shared experts; vocab
102400), bf16, random weights. The baseline is the same model written as one jitted function
over global arrays with the project's weights (the same buffers), XLA's GSPMD placing anything
that needs placing: expanded latent attention over a [sequences, length] batch in prefill,
absorbed attention over the same latent cache in decode, and the project's own router and
grouped expert matmuls (`deepseek_route`, `finalized_expert_outputs`), so "project / GSPMD"
isolates what the boundaries and packed rows cost or gain. Before timing, the last-row prefill
logits of the baseline are compared with the project's forward.

Cases: decode of 8 and 64 sequences over a 4096-token latent cache (a jitted loop of `STEPS` greedy
steps; time per step), and prefill of 4096 tokens (8 x 512 and 1 x 4096) writing the cache and
sampling each last row. Roofline: decode, the bytes a step must read per GPU (every dense weight,
the experts the step's tokens route to, in expectation under even routing, the LM head, and the
latent cache up to each sequence's position) over the bandwidth a device copy reaches
(`common.hbm_bytes_per_s`); prefill, its matmul and causal attention FLOPs over the dense bf16 peak
(990 TFLOP/s).

Run on the GPU machine from the repository root (one H200):
  python3 -m benchmarks.bench_deepseek
  python3 -m benchmarks.bench_deepseek --smoke   # a tiny config: the CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj
from models.build import build_model
from models.config import DecoderConfig, read_hf_config
from models.families.deepseek import DeepseekCausalLM
from models.layers.attention.latent import LATENT_NORM_EPS
from models.layers.attention.rope import apply_rope, rope_inv_freq
from models.layers.moe.deepseek_router import deepseek_route
from models.layers.moe.experts import finalized_expert_outputs
from models.layers.moe.sparse import shared_expert
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
CACHE = 4096
REPEATS = 15
"""Timed calls of each program, project and baseline in turn."""
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "tie_word_embeddings": False,
}
"""DeepSeek-V2-Lite's `config.json` (the keys the reader takes)."""
SMOKE = DEEPSEEK_V2_LITE | {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}
"""A tiny model of the same structure, for a CPU check of the script."""


# -- the GSPMD baseline: the same model over global arrays, one jax.jit ----------------------


def make_baseline(config: DecoderConfig, impl):
    """(last-row logits of prefill, prefill, decode), jitted over global arrays; the caches
    ([sequences, cache, kv_lora_rank + rope] per layer) are donated."""
    mla, moe = config.mla, config.moe
    nope, rope, rank = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
    v_dim = mla.v_head_dim
    heads, eps = mla.num_heads, config.rms_norm_eps
    inv_freq = rope_inv_freq(rope, mla.rope_theta, mla.rope_scaling)
    neox = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])  # interleaved pairs

    def rotate(x, positions):  # [R, heads, rope]
        return apply_rope(
            x[..., neox], positions, inv_freq, attention_factor=mla.rope_attention_factor
        )

    def queries(layer, h, positions):
        if mla.q_lora_rank is None:
            q = h @ layer["attn/q_proj/kernel"]
        else:
            q_latent = h @ layer["attn/q_a_proj/kernel"]
            q_latent = rms_norm(q_latent, layer["attn/q_a_layernorm/weight"], LATENT_NORM_EPS)
            q = q_latent @ layer["attn/q_b_proj/kernel"]
        q = q.reshape(h.shape[0], heads, nope + rope)
        return q[..., :nope], rotate(q[..., nope:], positions)

    def latent(layer, h, positions):
        compressed = h @ layer["attn/kv_a_proj_with_mqa/kernel"]
        c = rms_norm(compressed[:, :rank], layer["attn/kv_a_layernorm/weight"], LATENT_NORM_EPS)
        k_rope = rotate(compressed[:, None, rank:], positions)[:, 0]
        return jnp.concatenate([c, k_rope.astype(c.dtype)], axis=-1)

    def ffn(layer, x):
        h = rms_norm(x, layer["post_attn_norm/weight"], eps)
        if "mlp/router" not in layer:
            gate_up = h @ layer["mlp/gate_up_proj/kernel"].reshape(h.shape[1], -1)
            gate, up = jnp.split(gate_up, 2, axis=-1)
            return x + (jax.nn.silu(gate) * up) @ layer["mlp/down_proj/kernel"]
        bias = layer.get("mlp/e_score_correction_bias")
        routing = deepseek_route(h, layer["mlp/router"], bias, moe.routing)
        shared = shared_expert(
            h, layer["mlp/shared_expert/gate_up_proj"], layer["mlp/shared_expert/down_proj"]
        )
        out = finalized_expert_outputs(
            h, routing, layer["mlp/gate_up_proj"], layer["mlp/down_proj"], shared=shared, impl=impl
        )
        return x + out

    def logits(params, x):
        x = rms_norm(x, params["final_norm"], eps)
        return (x @ params["lm_head"])[..., : config.vocab_size].astype(jnp.float32)

    def prefill(params, ids, caches):
        batch, length = ids.shape
        positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)
        x = params["embed"][ids.reshape(-1)]
        updated = []
        for index, layer in enumerate(params["layers"]):
            h = rms_norm(x, layer["input_norm/weight"], eps)
            q_nope, q_rope = queries(layer, h, positions)
            lat = latent(layer, h, positions)
            if caches is not None:
                cache = lax.dynamic_update_slice(
                    caches[index],
                    lat.reshape(batch, length, -1).astype(caches[index].dtype),
                    (0, 0, 0),
                )
                updated.append(cache)
            kv = (lat[:, :rank] @ layer["attn/kv_b_proj/kernel"]).reshape(batch, length, heads, -1)
            k_rope = lat[:, rank:].reshape(batch, length, 1, rope)
            k_rope = jnp.broadcast_to(k_rope, (batch, length, heads, rope))
            k = jnp.concatenate([kv[..., :nope], k_rope], axis=-1)
            q = jnp.concatenate([q_nope, q_rope], axis=-1).reshape(batch, length, heads, -1)
            # jax.nn.dot_product_attention wants one width: the value is zero-padded to it.
            values = jnp.pad(kv[..., nope:], ((0, 0), (0, 0), (0, 0), (0, nope + rope - v_dim)))
            out = jax.nn.dot_product_attention(
                q.astype(k.dtype),
                k,
                values.astype(k.dtype),
                scale=mla.softmax_scale,
                is_causal=True,
                implementation=attention_kernel(),
            )[..., :v_dim]
            x = x + out.reshape(batch * length, -1) @ layer["attn/o_proj/kernel"]
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
        visible_at = jnp.arange(caches[0].shape[1])

        def step(_, carry):
            tokens, positions, caches = carry
            x = params["embed"][tokens]
            updated = []
            for index, layer in enumerate(params["layers"]):
                h = rms_norm(x, layer["input_norm/weight"], eps)
                q_nope, q_rope = queries(layer, h, positions)
                cache = (
                    caches[index]
                    .at[rows, positions]
                    .set(latent(layer, h, positions).astype(caches[index].dtype))
                )
                updated.append(cache)
                w_kv = layer["attn/kv_b_proj/kernel"].reshape(rank, heads, -1)
                q_latent = jnp.einsum("bhd,chd->bhc", q_nope, w_kv[..., :nope])
                q = jnp.concatenate([q_latent, q_rope], axis=-1)
                scores = jnp.einsum("bhc,bsc->bhs", q, cache, preferred_element_type=jnp.float32)
                visible = visible_at[None, :] <= positions[:, None]
                scores = jnp.where(visible[:, None, :], scores * mla.softmax_scale, -jnp.inf)
                probs = jax.nn.softmax(scores, axis=-1).astype(cache.dtype)
                out = jnp.einsum("bhs,bsc->bhc", probs, cache[..., :rank])
                out = jnp.einsum("bhc,chv->bhv", out, w_kv[..., nope:])
                x = x + out.reshape(x.shape[0], -1) @ layer["attn/o_proj/kernel"]
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


def _dense_weights(config: DecoderConfig) -> tuple[int, int, int]:
    """Per layer: (attention weights, dense FFN weights, one expert's weights), in elements."""
    mla, h = config.mla, config.hidden_size
    q = h * mla.num_heads * mla.qk_head_dim
    if mla.q_lora_rank is not None:
        q = h * mla.q_lora_rank + mla.q_lora_rank * mla.num_heads * mla.qk_head_dim
    attn = (
        q
        + h * mla.latent_width
        + mla.kv_lora_rank * mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        + mla.num_heads * mla.v_head_dim * h
    )
    return attn, 3 * h * config.intermediate_size, 3 * h * config.moe.expert_intermediate_size


def decode_bytes(config: DecoderConfig, sequences: int, context: float) -> float:
    """Bytes one decode step must read (bf16): attention and dense weights, the shared experts,
    the routed experts its tokens reach (expected under even routing), the router, the LM head
    and the latent cache up to `context` positions."""
    moe, h = config.moe, config.hidden_size
    attn, dense, expert = _dense_weights(config)
    reached = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** sequences)
    shared = 3 * h * (moe.shared_expert_intermediate_size or 0)
    sparse = sum(config.sparse_layers)
    elements = config.num_layers * attn + (config.num_layers - sparse) * dense
    elements += sparse * (reached * expert + shared + h * moe.num_experts)
    elements += h * config.vocab_size
    cache = sequences * context * config.mla.latent_width * config.num_layers
    return 2 * (elements + cache)


def prefill_flops(config: DecoderConfig, sequences: int, length: int) -> float:
    """Matmul and causal attention FLOPs of a prefill (the LM head on each last row only)."""
    mla, moe, h = config.mla, config.moe, config.hidden_size
    attn, dense, expert = _dense_weights(config)
    tokens = sequences * length
    sparse = sum(config.sparse_layers)
    shared = 3 * h * (moe.shared_expert_intermediate_size or 0)
    per_token = config.num_layers * attn + (config.num_layers - sparse) * dense
    per_token += sparse * (moe.top_k * expert + shared + h * moe.num_experts)
    pairs = sequences * length * (length + 1) / 2
    scores = 2 * mla.num_heads * (mla.qk_head_dim + mla.v_head_dim) * pairs
    return (
        2 * tokens * per_token + scores * config.num_layers + 2 * sequences * h * config.vocab_size
    )


# -- the cases -------------------------------------------------------------------------------


def run(
    config: DecoderConfig, *, cache: int, prefills, decodes, steps: int, fusions: str = "none"
) -> list[tuple]:
    topology = bj.Topology()
    mesh = bj.make_mesh(topology)
    provider = bj.fusions.platform_fusions(topology) if fusions == "auto" else bj.fusions.NO_FUSIONS
    model = build_model(
        config, topology, BuildOptions(dtype=jnp.bfloat16, fusions=provider), mesh=mesh
    )
    assert isinstance(model, DeepseekCausalLM)
    impl = model.grouped_matmul
    runner = ShardedCausalLM(model, mesh)
    del model
    gspmd = auto_mesh(mesh)
    params = path_params(runner, gspmd)
    replicated = NamedSharding(gspmd, PartitionSpec())

    def zero_caches(sequences, length):
        shape = (sequences, length, config.mla.latent_width)
        return [jnp.zeros(shape, jnp.bfloat16, device=replicated) for _ in params["layers"]]

    return compare_with_baseline(
        runner,
        JitBaseline(params, *make_baseline(config, impl), zero_caches),
        prefills=prefills,
        decodes=decodes,
        cache=cache,
        steps=steps,
        repeats=REPEATS,
        prefill_roof_ms=lambda s, n: prefill_flops(config, s, n) / PEAK_FLOPS * 1e3,
        decode_roof_ms=lambda s, c: decode_bytes(config, s, c) / hbm_bytes_per_s() * 1e3,
        label=fusions,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny config and its own cases (CPU check)"
    )
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than 27")
    parser.add_argument("--profile", default=None, help="trace each case here, print kernels")
    parser.add_argument("--only", choices=("prefill", "decode"), default=None, help="one kind")
    parser.add_argument(
        "--prefills",
        nargs="+",
        default=["8x512", "1x4096"],
        help="prefill cases as SEQUENCESxLENGTH (4096 tokens each by default)",
    )
    parser.add_argument(
        "--fusions",
        nargs="+",
        choices=("none", "auto"),
        default=["none"],
        help="the project's boundaries: XLA's add + norm, or the platform's Pallas candidates "
        "(each measured in turn, against its own baseline calls)",
    )
    args = parser.parse_args()
    if args.profile:
        profile_into(args.profile)
    print(header("bench_deepseek"))
    config = read_hf_config(SMOKE if args.smoke else DEEPSEEK_V2_LITE)
    if args.layers is not None:
        config = dataclasses.replace(config, num_layers=args.layers)
    if args.smoke:
        shape = dict(cache=64, prefills=((2, 16), (1, 32)), decodes=(2, 8), steps=4)
    else:
        cases = tuple(tuple(int(n) for n in case.split("x")) for case in args.prefills)
        shape = dict(cache=CACHE, prefills=cases, decodes=(8, 64), steps=STEPS)
    if args.only:
        shape["decodes" if args.only == "prefill" else "prefills"] = ()
    results = []
    for fusions in args.fusions:
        results += [(fusions, *row) for row in run(config, **shape, fusions=fusions)]
        gc.collect()
    print(
        f"\n## DeepSeek-V2-Lite shape ({config.num_layers} layers), bf16, one device: project "
        "(boundary fusions) vs one-jit GSPMD (ms; ratio: GSPMD / project)"
    )
    print_table(
        ("fusions", "case", "project ms", "GSPMD ms", "speedup", "project roofline", "logit err"),
        results,
    )


if __name__ == "__main__":
    main()
