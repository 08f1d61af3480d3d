"""A Nemotron-H-8B-shaped hybrid stack on one GPU: prefill and decode against their rooflines,
beside the same stack written as one `jax.jit`, and the chunked SSD scan against `lax.scan`.

Issue 20 asks, on one H200 (bf16, 8 layers in the `M-M-M*-M` style of Nemotron-H-8B's
pattern): prefill of 4096 tokens at >= 40% of the FLOP roofline, decode at 64 sequences at
>= 60% of the HBM roofline (weights + KV cache + Mamba2 conv and SSM state), each beside the
same stack as one jitted function; the chunked scan >= 10x a row-by-row `lax.scan` at 4096.

The baseline is what a user writes first: the stack's layers (the project's own Mamba2,
attention, relu^2 MLP modules, built for one device, holding the project model's placed
weights: the same buffers) called in order, `x + mixer(norm(x))`, inside one `jax.jit` over
global arrays, so XLA's GSPMD partitions it. "project / jit" then isolates what the boundaries
(`shard_map`, the residual stream's plans) cost or gain. Before timing, the baseline's last-row
logits are compared with the project's.

Roofline: prefill, the stack's matmul, causal attention and chunked-scan FLOPs / dense bf16
peak (990 TFLOP/s); decode, the bytes one step reads and writes (bf16 weights, the KV cache
up to each position, each Mamba2 layer's conv state (bf16) and SSM state (float32), read and
written) / HBM bandwidth (4.8 TB/s). Times are wall-clock medians of blocking calls; a decode
call runs `STEPS` steps (one program), so dispatch is amortized.

Run from the repository root:
  python3 -m benchmarks.bench_nemotron_h            # one H200
  python3 -m benchmarks.bench_nemotron_h --smoke    # CPU: tiny shapes, every path once
"""

# ruff: noqa: B023 (each timed closure runs within its own loop iteration)

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj
from models.build import build_model
from models.config import (
    DecoderConfig,
    HybridConfig,
    HybridLayer,
    Mamba2Spec,
    parse_pattern,
)
from models.families.nemotron_h import NO_ROPE_THETA, NemotronHForCausalLM
from models.inputs.rows import RowsPhase, TokenRows, pack_sequences
from models.layers.attention.self_attention import AttentionImpl
from models.layers.mixers.ssd import ssd_chunked_scan, ssd_reference
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

from .bench_ssd import chunked_flops
from .bench_ssd import inputs as ssd_inputs
from .common import (
    header,
    kernel_ms,
    median_wall_ms,
    print_table,
    profile_into,
    relative_error,
)

HBM_BYTES_PER_S = 4.8e12
PEAK_FLOPS = 990e12
STEPS = 32
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
    return dataclasses.replace(
        config,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        hybrid=dataclasses.replace(config.hybrid, mamba=mamba),
    )


# -- the one-jit baseline: the layers in order over global arrays ----------------------------


def to_auto(tree, mesh: jax.sharding.Mesh):
    """`tree`'s arrays viewed on the Auto-axes twin of `mesh` with their own specs (the same
    device buffers, not a copy), so that GSPMD may partition what uses them."""
    auto = jax.sharding.Mesh(
        mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * mesh.devices.ndim
    )

    def rewrap(x: jax.Array) -> jax.Array:
        shards = [shard.data for shard in x.addressable_shards]
        sharding = NamedSharding(auto, x.sharding.spec)
        return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)

    return jax.tree.map(rewrap, tree)


def baseline_model(runner: ShardedCausalLM) -> NemotronHForCausalLM:
    """The stack built for one device, holding the project's placed weights (`to_auto`)."""
    config = runner.config
    graphdef, _ = nnx.split(
        nnx.eval_shape(
            lambda: NemotronHForCausalLM(
                config,
                bj.Topology(),
                BuildOptions(
                    dtype=runner.dtype, attention=AttentionImpl.for_platform(jax.default_backend())
                ),
                rngs=nnx.Rngs(0),
            )
        )
    )
    return nnx.merge(graphdef, to_auto(runner.state, runner.mesh))


def _layer(layer, x, rows: TokenRows, cache):
    """`x + mixer(norm(x))` of one hybrid layer, without boundaries."""
    h = layer.norm(x)
    match layer.kind:
        case HybridLayer.MAMBA2:
            y, cache = layer.mixer(h, rows.positions, rows.segment_ids, cache, phase=rows.phase)
        case HybridLayer.ATTENTION:
            y, cache = layer.mixer(
                h,
                rows.positions,
                rows.segment_ids,
                cache,
                phase=rows.phase,
                max_sequence_rows=rows.max_sequence_rows,
                window_rows=rows.window_rows,
            )
        case HybridLayer.MLP:
            y = layer.mixer(h)
        case HybridLayer.MOE:
            # One program over the whole model (Topology()): every replicated part added once.
            y = layer.mixer(h, defer=False, counts=lambda name: True)
    return x + y, cache


def _hidden(model, rows: TokenRows, caches):
    x = model.embed(rows.ids)
    updated = []
    for layer, cache in zip(model.layers, caches, strict=True):
        x, cache = _layer(layer, x, rows, cache)
        updated.append(cache)
    return model.final_norm(x), tuple(updated)


def make_baseline(graphdef):
    """(last-row logits, prefill, decode) of the baseline, jitted; caches are donated."""

    def logits(state, rows, last_rows, caches):
        model = nnx.merge(graphdef, state)
        hidden, _ = _hidden(model, rows, caches)
        return model.lm_head(hidden[last_rows]).astype(jnp.float32)

    def prefill(state, rows, last_rows, caches):
        model = nnx.merge(graphdef, state)
        hidden, caches = _hidden(model, rows, caches)
        return model.lm_head.greedy(hidden[last_rows]), caches

    def decode(state, rows, caches, steps):
        model = nnx.merge(graphdef, state)

        def step(_, carry):
            ids, positions, caches = carry
            now = TokenRows(ids, positions, rows.segment_ids, RowsPhase.DECODE)
            hidden, caches = _hidden(model, now, caches)
            return model.lm_head.greedy(hidden), positions + 1, caches

        ids, _, caches = lax.fori_loop(0, steps, step, (rows.ids, rows.positions, caches))
        return ids, caches

    return (
        jax.jit(logits),
        jax.jit(prefill, donate_argnums=3),
        jax.jit(decode, static_argnums=3, donate_argnums=2),
    )


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


# -- timing ----------------------------------------------------------------------------------


def _decode_rows(runner: ShardedCausalLM, sequences: int, start: int) -> tuple[TokenRows, ...]:
    ids = np.zeros(sequences, np.int32)
    positions = np.full(sequences, start, np.int32)
    segments = np.arange(sequences, dtype=np.int32)
    rows = TokenRows(*(runner.place_array(a) for a in (ids, positions, segments)), RowsPhase.DECODE)
    return rows, runner.place_batch(np.full(1, sequences, np.int32))


def run(config: DecoderConfig, sequences: int, length: int, decoding: int, cache_len: int):
    """The prefill and decode rows of the table: (case, project ms, jit ms, ratio, roofline)."""
    topology = bj.Topology()
    mesh = bj.make_mesh(topology)
    attention = AttentionImpl.for_platform(jax.default_backend())
    model = build_model(
        config, topology, BuildOptions(dtype=jnp.bfloat16, attention=attention), mesh=mesh
    )
    runner = ShardedCausalLM(model, mesh)
    del model
    baseline = baseline_model(runner)
    graphdef, state = nnx.split(baseline)
    logits_of, prefill, decode = make_baseline(graphdef)
    key = jax.device_put(jax.random.key(0), NamedSharding(mesh, PartitionSpec()))
    rng = np.random.default_rng(0)
    results = []

    prompts = list(rng.integers(0, config.vocab_size, (sequences, length)).astype(np.int32))
    packed = pack_sequences(prompts, topology, max_sequence_rows=length)
    rows, batch = runner.place(packed)
    last_rows = runner.place_array(packed.last_row_index())
    last = packed.last_row_index()[packed.slot_order()]
    want = np.asarray(runner.forward_placed(rows, batch))[last]
    slots = packed.decode_rows_per_rank

    def baseline_caches(slots, max_len):
        caches = baseline.new_caches(slots=slots, max_len=max_len, dtype=runner.dtype, mesh=mesh)
        return to_auto(caches, mesh)

    rows_, last_ = to_auto((rows, runner.place_array(last)), mesh)
    got = logits_of(state, rows_, last_, baseline_caches(slots, length))
    error = relative_error(got, want)
    caches = [runner.new_caches(slots, length)]

    def project_prefill():
        tokens, caches[0] = runner.prefill(rows, batch, caches[0], last_rows, key)
        return tokens

    project_ms = median_wall_ms(project_prefill, label="project prefill")
    del caches[0]
    holder = [baseline_caches(slots, length)]

    def baseline_prefill():
        tokens, holder[0] = prefill(state, rows_, last_, holder[0])
        return tokens

    jit_ms = median_wall_ms(baseline_prefill, label="one-jit prefill")
    del holder[0]
    roof = prefill_flops(config, (length,) * sequences) / PEAK_FLOPS * 1e3
    results.append(
        (
            f"prefill {sequences * length}",
            project_ms,
            jit_ms,
            jit_ms / project_ms,
            f"{100 * roof / project_ms:.0f}% FLOP",
            f"{error:.1e}",
        )
    )
    print(results[-1], flush=True)

    start = cache_len - STEPS - 1
    rows, batch = _decode_rows(runner, decoding, start)
    caches = [runner.new_caches(decoding, cache_len)]

    def project_decode():
        out, caches[0] = runner.decode(rows, batch, caches[0], key, STEPS, capacity=STEPS)
        return out

    project_ms = median_wall_ms(project_decode, 5, label="project decode") / STEPS
    del caches[0]
    holder = [baseline_caches(decoding, cache_len)]
    rows_ = to_auto(rows, mesh)

    def baseline_decode():
        out, holder[0] = decode(state, rows_, holder[0], STEPS)
        return out

    jit_ms = median_wall_ms(baseline_decode, 5, label="one-jit decode") / STEPS
    del holder[0]
    roof = decode_bytes(config, decoding, start + STEPS / 2) / HBM_BYTES_PER_S * 1e3
    results.append(
        (
            f"decode {decoding} @ {cache_len}",
            project_ms,
            jit_ms,
            jit_ms / project_ms,
            f"{100 * roof / project_ms:.0f}% HBM",
            "-",
        )
    )
    print(results[-1], flush=True)
    return results


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
    results = run(config, sequences, length, decoding, cache_len)
    print(
        f"\n## Nemotron-H-8B shape, {args.pattern}, bf16: project vs one jit (ms; ratio = speedup)"
    )
    print_table(
        ("case", "project ms", "one-jit ms", "vs jit", "project roofline", "logit err"), results
    )
    if config.hybrid.mamba is not None:
        rows = sum(scan_lengths)
        print(f"\n## SSD scan, {rows} packed rows ({len(scan_lengths)} sequences)")
        print_table(
            ("form", "ms", "x lax.scan", "rel err"),
            scan_rows(config.hybrid.mamba, rows, scan_lengths),
        )


if __name__ == "__main__":
    main()
