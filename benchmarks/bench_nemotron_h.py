"""A Nemotron-H-8B-shaped hybrid stack on one GPU: prefill and decode against their rooflines,
beside the same stack written as one `jax.jit`, and the chunked SSD scan against `lax.scan`.

Issue 20 asks, on one H200 (bf16, 8 layers in the `M-M-M*-M` style of Nemotron-H-8B's
pattern): prefill of 4096 tokens at >= 40% of the FLOP roofline, decode at 64 sequences at
>= 60% of the HBM roofline (weights + KV cache + Mamba2 conv and SSM state), each beside the
same stack as one jitted function; the chunked scan >= 10x a row-by-row `lax.scan` at 4096.

The baseline (`layer_stack_jit`) is what a user writes first: the stack's layers (the project's
own Mamba2, attention, relu^2 MLP modules, built for one device, holding the project model's
placed weights) called in order, `x + mixer(norm(x))`, inside one `jax.jit` over global arrays.

Roofline: prefill, the stack's matmul, causal attention and chunked-scan FLOPs / dense bf16 peak
(990 TFLOP/s); decode, the bytes one step reads and writes (bf16 weights, the KV cache up to each
position, each Mamba2 layer's conv state (bf16) and SSM state (float32), read and written) / the
bandwidth a device copy reaches (measured in the run). Times are wall-clock medians of blocking
calls; a decode call runs `STEPS` steps (one program), so dispatch is amortized.

Run from the repository root:
  python3 -m benchmarks.bench_nemotron_h            # one H200
  python3 -m benchmarks.bench_nemotron_h --smoke    # CPU: tiny shapes, every path once
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp

from models.config import (
    DecoderConfig,
    HybridConfig,
    HybridLayer,
    Mamba2Spec,
    parse_pattern,
)
from models.families.nemotron_h import NO_ROPE_THETA, NemotronHForCausalLM
from models.inputs.rows import TokenRows
from models.layers.mixers.ssd import ssd_chunked_scan, ssd_reference

from . import layer_stack_jit
from .bench_ssd import chunked_flops
from .bench_ssd import inputs as ssd_inputs
from .common import header, kernel_ms, print_table, profile_into, relative_error, smoke_widths

PATTERN = "M-M-M*-M"


def nemotron_h_8b(pattern: str) -> DecoderConfig:
    """Nemotron-H-8B's shapes (random weights, no checkpoint) with `pattern`'s layers."""
    layers = parse_pattern(pattern)
    mamba = Mamba2Spec(
        hidden_size=4096, num_heads=128, head_dim=64, n_groups=8, state_size=128, chunk_size=128
    )
    return DecoderConfig(
        architecture="NemotronHForCausalLM",
        vocab_size=131072,
        hidden_size=4096,
        intermediate_size=21504,
        num_layers=len(layers),
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=NO_ROPE_THETA,
        rope_scaling=None,
        qk_norm=False,
        tie_word_embeddings=False,
        sliding_window=None,
        max_position_embeddings=8192,
        nope_full_layers=True,
        hybrid=HybridConfig(layers, mamba if HybridLayer.MAMBA2 in layers else None),
    )


def smoke(config: DecoderConfig) -> DecoderConfig:
    """`config` at tiny widths (a CPU run of every path)."""
    mamba = config.hybrid.mamba
    if mamba is not None:
        mamba = dataclasses.replace(
            mamba,
            hidden_size=128,
            num_heads=8,
            head_dim=16,
            n_groups=2,
            state_size=16,
            chunk_size=32,
        )
    return smoke_widths(config, hybrid=dataclasses.replace(config.hybrid, mamba=mamba))


# -- the one-jit baseline's layer (`layer_stack_jit`) -----------------------------------------


def _layer(layer, x, rows: TokenRows, cache):
    """`x + mixer(norm(x))` of one hybrid layer, without boundaries."""
    h = layer.norm(x)
    match layer.kind:
        case HybridLayer.MAMBA2:
            y, cache = layer.mixer(h, rows.positions, rows.segment_ids, cache, phase=rows.phase)
        case HybridLayer.ATTENTION:
            y, cache = layer_stack_jit.attention(layer.mixer, h, rows, cache)
        case HybridLayer.MLP:
            y = layer.mixer(h)
        case HybridLayer.MOE:
            # One program over the whole model (Topology()): every replicated part added once.
            y = layer.mixer(h, defer=False, counts=lambda name: True)
    return x + y, cache


# -- the rooflines ---------------------------------------------------------------------------


def prefill_flops(config: DecoderConfig, lengths: tuple[int, ...]) -> float:
    """Matmul, causal attention and chunked-scan FLOPs of a prefill of packed `lengths` (the
    LM head on each sequence's last row)."""
    h, tokens, hybrid = config.hidden_size, sum(lengths), config.hybrid
    d, heads, kv = config.head_dim, config.num_heads, config.num_kv_heads
    total = 2 * len(lengths) * h * config.vocab_size
    for layer in hybrid.layers:
        if layer is HybridLayer.MAMBA2:
            m = hybrid.mamba
            rows = 2 * m.intermediate_size + 2 * m.bc_width + m.num_heads
            total += 2 * tokens * h * (rows + m.intermediate_size)
            shape = (m.num_heads, m.head_dim, m.n_groups, m.state_size)
            total += chunked_flops(tokens, m.chunk_size, *shape)
        elif layer is HybridLayer.ATTENTION:
            total += 2 * tokens * h * d * (2 * heads + 2 * kv)
            total += 2 * 2 * heads * d * sum(n * (n + 1) / 2 for n in lengths)
        elif layer is HybridLayer.MLP:
            total += 2 * tokens * h * config.intermediate_size * 2
    return total


def decode_bytes(config: DecoderConfig, sequences: int, context: float) -> float:
    """Bytes one decode step reads and writes: bf16 weights (the embedding's rows aside), each
    sequence's KV cache up to `context`, and each Mamba2 layer's conv (bf16) and SSM (float32)
    state, read and written."""
    h, hybrid = config.hidden_size, config.hybrid
    d, heads, kv = config.head_dim, config.num_heads, config.num_kv_heads
    weights = h * config.vocab_size + h  # LM head, final norm
    state = 0.0
    for layer in hybrid.layers:
        weights += h
        if layer is HybridLayer.MAMBA2:
            m = hybrid.mamba
            channels = m.intermediate_size + 2 * m.bc_width
            rows = 2 * m.intermediate_size + 2 * m.bc_width + m.num_heads
            weights += h * (rows + m.intermediate_size) + channels * (m.conv_kernel + 1)
            weights += 3 * m.num_heads + m.intermediate_size
            ssm = m.num_heads * m.head_dim * m.state_size * 4
            conv = (m.conv_kernel - 1) * channels * 2
            state += 2 * sequences * (ssm + conv)
        elif layer is HybridLayer.ATTENTION:
            weights += h * d * (2 * heads + 2 * kv)
            state += sequences * context * 2 * kv * d * 2
        elif layer is HybridLayer.MLP:
            weights += 2 * h * config.intermediate_size
    return 2 * weights + state


# -- the SSD scan ----------------------------------------------------------------------------


def scan_rows(mamba: Mamba2Spec, rows: int, lengths: tuple[int, ...]) -> list[tuple]:
    """The chunked scan at the stack's Mamba2 shapes against the row-by-row `lax.scan`."""
    shape = (mamba.num_heads, mamba.head_dim, mamba.n_groups, mamba.state_size)
    args = ssd_inputs(rows, lengths, *shape, jnp.bfloat16)
    slots = len(lengths)
    reference = jax.jit(functools.partial(ssd_reference, num_slots=slots))
    want = reference(*args)
    base = kernel_ms(reference, [args], wall=True, repeats=16)
    chunked = jax.jit(
        functools.partial(ssd_chunked_scan, chunk_size=mamba.chunk_size, num_slots=slots)
    )
    error = relative_error(chunked(*args), want)
    ms = kernel_ms(chunked, [args], wall=True, repeats=16)
    return [
        ("lax.scan, row by row", base, 1.0, "-"),
        (f"chunked, chunk {mamba.chunk_size}", ms, base / ms, f"{error:.1e}"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pattern", default=PATTERN, help="the stack's layers, e.g. M-M-M*-M")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check)")
    parser.add_argument("--profile", default=None, help="trace each case here, print kernels")
    args = parser.parse_args()
    if args.profile:
        profile_into(args.profile)
    config = nemotron_h_8b(args.pattern)
    sequences, length, decoding, cache_len, scan_lengths = 8, 512, 64, 1024, (2048, 1024, 700, 324)
    if args.smoke:
        config = smoke(config)
        sequences, length, decoding, cache_len, scan_lengths = 2, 64, 8, 128, (50, 30, 16)
    print(header(f"bench_nemotron_h: {args.pattern}, {config.num_layers} layers, bf16, one device"))
    results = layer_stack_jit.run(
        config,
        NemotronHForCausalLM,
        _layer,
        prefill=(sequences, length),
        decode=(decoding, cache_len),
        prefill_flops=prefill_flops,
        decode_bytes=decode_bytes,
    )
    layer_stack_jit.print_results(f"Nemotron-H-8B shape, {args.pattern}, bf16", results)
    if config.hybrid.mamba is not None:
        rows = sum(scan_lengths)
        print(f"\n## SSD scan, {rows} packed rows ({len(scan_lengths)} sequences)")
        print_table(
            ("form", "ms", "x lax.scan", "rel err"),
            scan_rows(config.hybrid.mamba, rows, scan_lengths),
        )


if __name__ == "__main__":
    main()
