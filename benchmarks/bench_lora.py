"""Multi-LoRA decode on one H200: the Llama-3-8B-shaped model with 8 rank-16 adapters on every
attention and MLP projection, against the same model's base step, in the same run.

One model is built with the adapter stacks (`BuildOptions(lora=...)`, random A and B); the base
step is the same program fed rows that name no adapter (`TokenRows.adapters` None: the stacks
are never read), the LoRA step rows whose sequence i runs adapter `i % 8 + 1` (every adapter in
every step, the sequences on each adapter spread over the batch). Each is a jitted loop of greedy
decode steps over a cache of `cache` tokens, timed per step (the median of alternating calls,
`paired_wall_ms`). Target (issue 43): the LoRA step within 1.25x of the base step at decode 64 @
1024. The table's last column is the adapters' share of the bytes a LoRA step reads (each
adapter's A and B read once per step, as the one-hot selection reads them).

    python3 -m benchmarks.bench_lora              # on the GPU machine (JAX_PLATFORMS=cuda,cpu)
    python3 -m benchmarks.bench_lora --layers 8   # a shorter stack
    python3 -m benchmarks.bench_lora --smoke      # CPU: a tiny config, one timed call each
"""

# ruff: noqa: B023 (each timed closure runs within its own loop iteration)

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import boundary_jax as bj
from models.build import build_model
from models.layers.attention.self_attention import AttentionImpl
from models.layers.lora import ATTENTION_TARGETS, MLP_TARGETS, LoraSpec
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

from .common import LLAMA3_8B, LLAMA3_SMOKE, decode_inputs, header, paired_wall_ms, print_table


def lora_bytes(config, spec: LoraSpec, itemsize: int) -> int:
    """Bytes of every adapter stack of the model (what one LoRA step reads)."""
    h, heads, kv = config.hidden_size, config.num_heads, config.num_kv_heads
    q, k = heads * config.head_dim, kv * config.head_dim
    widths = (h + q) + 2 * (h + k) + (q + h) + 2 * (h + config.intermediate_size)
    widths += config.intermediate_size + h
    return config.num_layers * spec.adapters * spec.rank * widths * itemsize


def run(config, *, adapters: int, rank: int, sequences: int, cache: int, steps: int, repeats: int):
    """The base and LoRA decode steps of `config` on one device: a row of the results table."""
    spec = LoraSpec(
        names=tuple(f"adapter{i}" for i in range(1, adapters + 1)),
        rank=rank,
        targets=frozenset(ATTENTION_TARGETS + MLP_TARGETS),
    )
    topology = bj.Topology()
    mesh = bj.make_mesh(topology)
    options = BuildOptions(
        dtype=jnp.bfloat16, attention=AttentionImpl.for_platform(jax.default_backend()), lora=spec
    )
    runner = ShardedCausalLM(build_model(config, topology, options, mesh=mesh), mesh)
    rows, batch = decode_inputs(runner, sequences, cache - steps - 1)
    chosen = np.arange(sequences, dtype=np.int32) % adapters + 1
    lora_rows = dataclasses.replace(rows, adapters=runner.place_array(chosen))
    key = jax.device_put(
        jax.random.key(0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    caches = {
        "base": runner.new_caches(sequences, cache),
        "lora": runner.new_caches(sequences, cache),
    }
    tokens = {}

    def step(name, placed):
        def call():
            tokens[name], caches[name] = runner.decode(
                placed, batch, caches[name], key, steps, capacity=steps
            )
            return tokens[name]

        return call

    base, lora = paired_wall_ms(
        [step("base", rows), step("lora", lora_rows)], repeats, labels=["base", "lora"]
    )
    moved = float(np.mean(np.asarray(tokens["base"]) != np.asarray(tokens["lora"])))
    share = lora_bytes(config, spec, 2) / sum(leaf.nbytes for leaf in jax.tree.leaves(runner.state))
    return (
        f"{config.num_layers}L",
        f"decode {sequences} @ {cache}",
        f"{adapters} x r{rank}",
        base / steps,
        lora / steps,
        lora / base,
        f"{100 * share:.2f}%",
        f"{100 * moved:.0f}%",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="default: 32 (2 with --smoke)")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--sequences", type=int, nargs="+", default=None, help="default: 64")
    parser.add_argument("--cache", type=int, default=None, help="default: 1024")
    parser.add_argument("--steps", type=int, default=None, help="decode steps per timed call")
    parser.add_argument("--smoke", action="store_true", help="a tiny config, one timed call")
    args = parser.parse_args()
    base = LLAMA3_SMOKE if args.smoke else LLAMA3_8B
    config = dataclasses.replace(base, num_layers=args.layers or base.num_layers)
    sequences = args.sequences or ([4] if args.smoke else [64])
    cache = args.cache or (16 if args.smoke else 1024)
    steps = args.steps or (2 if args.smoke else 32)
    print(header("bench_lora: multi-LoRA decode against the base step"), flush=True)
    rows = [
        run(
            config,
            adapters=args.adapters,
            rank=args.rank,
            sequences=count,
            cache=cache,
            steps=steps,
            repeats=1 if args.smoke else 7,
        )
        for count in sequences
    ]
    print_table(
        (
            "model",
            "case",
            "adapters",
            "base ms/step",
            "LoRA ms/step",
            "LoRA / base",
            "adapter bytes",
            "tokens changed",
        ),
        rows,
    )


if __name__ == "__main__":
    main()
