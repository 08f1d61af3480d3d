"""A model's own layers called in order inside one `jax.jit`: the one-jit baseline of the
one-device stack benchmarks (`bench_nemotron_h`, `bench_qwen3_next`), and the prefill and decode
rows that time it beside the project's model.

The baseline is what a user writes first: the family built for one device (`Topology()`), holding
the project model's placed weights (`to_auto`: the same buffers), each layer's compute called
in order without boundaries (a benchmark's `layer` function), inside one `jax.jit` over global
arrays, so XLA's GSPMD partitions it. "project / jit" then isolates what the boundaries cost or
gain. Before timing, the baseline's last-row logits are compared with the project's.

Rooflines: dense bf16 peak 990 TFLOP/s, HBM the bandwidth a device copy reaches; a decode call runs
`STEPS` steps (one program), so dispatch is amortized.
"""

# ruff: noqa: B023 (each timed closure runs within its own loop iteration)

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj
from models.build import build_model
from models.config import DecoderConfig
from models.inputs.rows import RowsPhase, TokenRows, pack_sequences
from models.layers.attention.self_attention import AttentionImpl
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM
from pallas_kernels.grouped_matmul import GroupedMatmulImpl

from .common import (
    PEAK_FLOPS,
    decode_inputs,
    hbm_bytes_per_s,
    median_wall_ms,
    print_table,
    relative_error,
)

STEPS = 32

Layer = Callable[[nnx.Module, jax.Array, TokenRows, object], tuple[jax.Array, object]]
"""`layer(module, x, rows, cache) -> (x, cache)`: one layer of the stack without boundaries."""


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


def attention(attn: nnx.Module, h: jax.Array, rows: TokenRows, cache) -> tuple[jax.Array, Any]:
    """An attention's output and updated cache on `rows`, without boundaries: what a baseline
    layer calls (with the rows' phase and layout facts)."""
    return attn(
        h,
        rows.positions,
        rows.segment_ids,
        cache,
        phase=rows.phase,
        max_sequence_rows=rows.max_sequence_rows,
        window_rows=rows.window_rows,
    )


def baseline_model(runner: ShardedCausalLM, family: type) -> nnx.Module:
    """`family`'s stack built for one device, holding the project's placed weights, with the
    project's attention and grouped matmul."""
    config = runner.config
    options = BuildOptions(
        dtype=runner.dtype,
        attention=runner.options.attention,
        grouped_matmul=runner.options.grouped_matmul,
    )
    graphdef, _ = nnx.split(
        nnx.eval_shape(lambda: family(config, bj.Topology(), options, rngs=nnx.Rngs(0)))
    )
    return nnx.merge(graphdef, to_auto(runner.state, runner.mesh))


def make_baseline(graphdef, layer: Layer):
    """(last-row logits, prefill, decode) of the baseline, jitted; caches are donated."""

    def hidden_of(model, rows: TokenRows, caches):
        x = model.embed(rows.ids)
        updated = []
        for module, cache in zip(model.layers, caches, strict=True):
            x, cache = layer(module, x, rows, cache)
            updated.append(cache)
        return model.final_norm(x), tuple(updated)

    def logits(state, rows, last_rows, caches):
        model = nnx.merge(graphdef, state)
        hidden, _ = hidden_of(model, rows, caches)
        return model.lm_head(hidden[last_rows]).astype(jnp.float32)

    def prefill(state, rows, last_rows, caches):
        model = nnx.merge(graphdef, state)
        hidden, caches = hidden_of(model, rows, caches)
        return model.lm_head.greedy(hidden[last_rows]), caches

    def decode(state, rows, caches, steps):
        model = nnx.merge(graphdef, state)

        def step(_, carry):
            ids, positions, caches = carry
            now = TokenRows(ids, positions, rows.segment_ids, RowsPhase.DECODE)
            hidden, caches = hidden_of(model, now, caches)
            return model.lm_head.greedy(hidden), positions + 1, caches

        ids, _, caches = lax.fori_loop(0, steps, step, (rows.ids, rows.positions, caches))
        return ids, caches

    return (
        jax.jit(logits),
        jax.jit(prefill, donate_argnums=3),
        jax.jit(decode, static_argnums=3, donate_argnums=2),
    )


def run(
    config: DecoderConfig,
    family: type,
    layer: Layer,
    *,
    prefill: tuple[int, int],
    decode: tuple[int, int],
    prefill_flops: Callable[[DecoderConfig, tuple[int, ...]], float],
    decode_bytes: Callable[[DecoderConfig, int, float], float],
    grouped_matmul: GroupedMatmulImpl | None = None,
) -> list[tuple]:
    """The prefill (`prefill` = (sequences, length)) and decode (`decode` = (sequences, cache
    length)) rows of a stack benchmark's table: (case, project ms, jit ms, ratio, roofline,
    logit error), on one device; both models' experts through `grouped_matmul` (None: the
    platform's default)."""
    topology = bj.Topology()
    mesh = bj.make_mesh(topology)
    attention = AttentionImpl.for_platform(jax.default_backend())
    options = BuildOptions(dtype=jnp.bfloat16, attention=attention, grouped_matmul=grouped_matmul)
    model = build_model(config, topology, options, mesh=mesh)
    runner = ShardedCausalLM(model, mesh)
    del model
    baseline = baseline_model(runner, family)
    graphdef, state = nnx.split(baseline)
    logits_of, prefill_step, decode_steps = make_baseline(graphdef, layer)
    key = jax.device_put(jax.random.key(0), NamedSharding(mesh, PartitionSpec()))
    rng = np.random.default_rng(0)
    results = []

    sequences, length = prefill
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
        tokens, holder[0] = prefill_step(state, rows_, last_, holder[0])
        return tokens

    jit_ms = median_wall_ms(baseline_prefill, label="one-jit prefill")
    del holder[0]
    roof = prefill_flops(config, (length,) * sequences) / PEAK_FLOPS * 1e3
    results.append(
        (
            f"prefill {sequences} x {length}",
            project_ms,
            jit_ms,
            jit_ms / project_ms,
            f"{100 * roof / project_ms:.0f}% FLOP",
            f"{error:.1e}",
        )
    )
    print(results[-1], flush=True)

    decoding, cache_len = decode
    start = cache_len - STEPS - 1
    rows, batch = decode_inputs(runner, decoding, start)
    caches = [runner.new_caches(decoding, cache_len)]

    def project_decode():
        out, caches[0] = runner.decode(rows, batch, caches[0], key, STEPS, capacity=STEPS)
        return out

    project_ms = median_wall_ms(project_decode, 5, label="project decode") / STEPS
    del caches[0]
    holder = [baseline_caches(decoding, cache_len)]
    rows_ = to_auto(rows, mesh)

    def baseline_decode():
        out, holder[0] = decode_steps(state, rows_, holder[0], STEPS)
        return out

    jit_ms = median_wall_ms(baseline_decode, 5, label="one-jit decode") / STEPS
    del holder[0]
    roof = decode_bytes(config, decoding, start + STEPS / 2) / hbm_bytes_per_s() * 1e3
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


def print_results(title: str, results: list[tuple]) -> None:
    """`run`'s rows as a table under `title` (the model's shape and dtype)."""
    print(f"\n## {title}: project vs one jit (ms; ratio = speedup)")
    print_table(
        ("case", "project ms", "one-jit ms", "vs jit", "project roofline", "logit err"), results
    )
