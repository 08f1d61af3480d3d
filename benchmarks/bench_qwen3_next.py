"""A Qwen3-Next-80B-A3B-shaped stack of 8 layers on one GPU: prefill and decode against their
rooflines, beside the same stack written as one `jax.jit`.

Issue 45 asks, on one H200 (bf16, 8 layers in Qwen3-Next's pattern: three Gated DeltaNet layers,
then one gated full-attention layer, each with a 512-expert top-10 MoE and a sigmoid-gated
shared expert): prefill of 4096 tokens at >= 35% of the FLOP roofline, decode of 64 sequences
@ 1024 at >= 60% of the HBM roofline, each at >= 1.0x the one-jit stack in the same run.

The baseline (`layer_stack_jit`) is what a user writes first: the stack's layers (the project's
own Gated DeltaNet, gated attention and MoE modules, built for one device, holding the project
model's placed weights) called in order, `x + mixer(norm(x))`, `x + moe(norm(x))`, inside one
`jax.jit` over global arrays.

Roofline: prefill, the stack's matmul FLOPs (each row through its top-k experts), causal
attention and the chunked delta rule's matmuls, over dense bf16 peak (990 TFLOP/s); decode, the
bytes one step must move (bf16 weights, of the experts only those the step's rows choose: the
expected number of distinct experts under uniform routing; the KV cache up to each position;
each Gated DeltaNet layer's float32 state and bf16 conv state, read and written) over the
bandwidth a device copy reaches (measured in the run), as `bench_nemotron_h` counts them.

Run from the repository root:
  python3 -m benchmarks.bench_qwen3_next            # one H200
  python3 -m benchmarks.bench_qwen3_next --smoke    # CPU: tiny shapes, every path once
  python3 -m benchmarks.bench_qwen3_next --delta-storage float32    # the rule's terms in float32
"""

from __future__ import annotations

import argparse
import dataclasses

from models.config import DecoderConfig, GatedDeltaNetSpec, LinearAttentionLayers, MoeConfig
from models.families.qwen3_next import TINY, Qwen3NextForCausalLM
from models.inputs.rows import TokenRows
from models.layers.mixers.gated_deltanet import GatedDeltaNet
from pallas_kernels.grouped_matmul import GroupedMatmulImpl

from . import layer_stack_jit
from .bench_delta_rule import chunked_flops
from .common import header, profile_into

PATTERN = (True, True, True, False) * 2
"""Gated DeltaNet (True) or full attention, per layer: Qwen3-Next's `full_attention_interval` 4."""


def qwen3_next_80b(layers: tuple[bool, ...] = PATTERN) -> DecoderConfig:
    """Qwen3-Next-80B-A3B's shapes (random weights, no checkpoint) with `layers`' kinds."""
    spec = GatedDeltaNetSpec(
        hidden_size=2048, num_k_heads=16, num_v_heads=32, k_dim=128, v_dim=128, conv_kernel=4
    )
    moe = MoeConfig(
        num_experts=512,
        top_k=10,
        expert_intermediate_size=512,
        renormalize=True,
        shared_expert_intermediate_size=512,
        shared_expert_gate=True,
    )
    return dataclasses.replace(
        TINY,
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        num_layers=len(layers),
        num_heads=16,
        num_kv_heads=2,
        head_dim=256,
        rope_theta=10_000_000.0,
        max_position_embeddings=8192,
        rotary_dim=64,
        linear_attention=LinearAttentionLayers(spec, layers),
        moe=moe,
    )


def smoke(config: DecoderConfig) -> DecoderConfig:
    """`config` at tiny widths (a CPU run of every path)."""
    spec = GatedDeltaNetSpec(hidden_size=64, num_k_heads=4, num_v_heads=8, k_dim=8, v_dim=8)
    moe = dataclasses.replace(
        config.moe, num_experts=8, top_k=2, expert_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )  # fmt: skip
    return dataclasses.replace(
        TINY,
        num_layers=config.num_layers,
        linear_attention=LinearAttentionLayers(spec, config.linear_attention.layers),
        moe=moe,
    )


# -- the one-jit baseline's layer (`layer_stack_jit`) -----------------------------------------


def _layer(layer, x, rows: TokenRows, cache):
    """`x + mixer(norm(x))`, then `x + ffn(norm(x))`, of one layer, without boundaries."""
    h = layer.input_norm(x)
    if isinstance(layer.attn, GatedDeltaNet):
        y, cache = layer.attn(h, rows.positions, rows.segment_ids, cache, phase=rows.phase)
    else:
        y, cache = layer_stack_jit.attention(layer.attn, h, rows, cache)
    x = x + y
    h = layer.post_attn_norm(x)
    # One program over the whole model (Topology()): every replicated part added once.
    return x + layer.mlp(h, defer=False, counts=lambda name: True), cache


# -- the rooflines ---------------------------------------------------------------------------


def _mixer_weights(config: DecoderConfig, linear: bool) -> int:
    """Matmul weights of one layer's token mixer (elements)."""
    h = config.hidden_size
    if linear:
        s = config.linear_attention.spec
        key, value = s.num_k_heads * s.k_dim, s.num_v_heads * s.v_dim
        return h * (2 * key + 2 * value + 2 * s.num_v_heads) + value * h
    heads, kv, d = config.num_heads, config.num_kv_heads, config.head_dim
    return h * d * (2 * heads + 2 * kv) + heads * d * h  # q and its gate, k, v; o


def _expert_weights(config: DecoderConfig) -> int:
    return 3 * config.hidden_size * config.moe.expert_intermediate_size


def _shared_weights(config: DecoderConfig) -> int:
    moe = config.moe
    return 3 * config.hidden_size * moe.shared_expert_intermediate_size + config.hidden_size


def prefill_flops(config: DecoderConfig, lengths: tuple[int, ...]) -> float:
    """Matmul, causal attention and chunked delta-rule FLOPs of a prefill of packed `lengths`
    (each row through its top-k experts; the LM head on each sequence's last row)."""
    h, tokens, moe = config.hidden_size, sum(lengths), config.moe
    total = 2 * len(lengths) * h * config.vocab_size
    ffn = moe.num_experts * h + moe.top_k * _expert_weights(config) + _shared_weights(config)
    for linear in config.linear_attention.layers:
        total += 2 * tokens * (_mixer_weights(config, linear) + ffn)
        if linear:
            s = config.linear_attention.spec
            total += chunked_flops(tokens, s.chunk_size, s.num_v_heads, s.k_dim, s.v_dim)
        else:
            d, heads = config.head_dim, config.num_heads
            total += 2 * 2 * heads * d * sum(n * (n + 1) / 2 for n in lengths)
    return total


def decode_bytes(config: DecoderConfig, sequences: int, context: float) -> float:
    """Bytes one decode step must move: bf16 weights (of the experts, the expected number of
    distinct ones `sequences` rows choose under uniform routing), each sequence's KV cache up to
    `context`, each Gated DeltaNet layer's float32 state and bf16 conv state, read and written."""
    h, moe = config.hidden_size, config.moe
    chosen = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** sequences)
    ffn = moe.num_experts * h + chosen * _expert_weights(config) + _shared_weights(config)
    weights = h * config.vocab_size + h
    state = 0.0
    for linear in config.linear_attention.layers:
        weights += 2 * h + _mixer_weights(config, linear) + ffn
        if linear:
            s = config.linear_attention.spec
            channels = 2 * s.num_k_heads * s.k_dim + s.num_v_heads * s.v_dim
            delta = s.num_v_heads * s.k_dim * s.v_dim * 4
            conv = (s.conv_kernel - 1) * channels * 2
            state += 2 * sequences * (delta + conv)
        else:
            state += sequences * context * 2 * config.num_kv_heads * config.head_dim * 2
    return 2 * weights + state


GROUPED_MATMULS = {
    "auto": None,
    "triton": GroupedMatmulImpl.PALLAS_TRITON,
    "hopper": GroupedMatmulImpl.PALLAS_GPU,
    "padded": GroupedMatmulImpl.PADDED_BATCHED,
}
"""`--grouped-matmul`'s choices: 512 experts of ~80 rows each at a 4096-token prefill are far
from the Qwen3-30B-A3B shape that set `GPU_BY_SIZE`'s crossover (128 experts of 256 rows)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check)")
    parser.add_argument("--profile", default=None, help="trace each case here, print kernels")
    parser.add_argument("--sequences", type=int, default=1, help="prefill sequences")
    parser.add_argument("--length", type=int, default=4096, help="tokens per prefill sequence")
    parser.add_argument(
        "--grouped-matmul",
        choices=sorted(GROUPED_MATMULS),
        default="auto",
        help="the experts' grouped matmul in both models (auto: the platform's default)",
    )
    parser.add_argument(
        "--delta-storage",
        choices=("float32", "bfloat16"),
        default=None,
        help="the chunked delta rule's stored terms between matmuls, in both models "
        "(default: the activations' dtype, bf16)",
    )
    args = parser.parse_args()
    if args.profile:
        profile_into(args.profile)
    config = qwen3_next_80b()
    sequences, length, decoding, cache_len = args.sequences, args.length, 64, 1024
    if args.smoke:
        config = smoke(config)
        sequences, length, decoding, cache_len = 2, 64, 8, 128
    if args.delta_storage:
        spec = dataclasses.replace(config.linear_attention.spec, chunk_storage=args.delta_storage)
        layers = LinearAttentionLayers(spec, config.linear_attention.layers)
        config = dataclasses.replace(config, linear_attention=layers)
    print(header(f"bench_qwen3_next: {config.num_layers} layers, bf16, one device"))
    results = layer_stack_jit.run(
        config,
        Qwen3NextForCausalLM,
        _layer,
        prefill=(sequences, length),
        decode=(decoding, cache_len),
        prefill_flops=prefill_flops,
        decode_bytes=decode_bytes,
        grouped_matmul=GROUPED_MATMULS[args.grouped_matmul],
    )
    title = f"Qwen3-Next-80B-A3B shape, {config.num_layers} layers (DeltaNet x 3, attention) x 2"
    title += f", delta rule storage {args.delta_storage or 'bfloat16 (default)'}"
    layer_stack_jit.print_results(f"{title}, bf16", results)


if __name__ == "__main__":
    main()
