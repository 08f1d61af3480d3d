"""Random-weight build time: `build_model(..., mesh=)` of a Llama-3-8B-shaped decoder, by layers.

The model is built abstractly, then `models.weights.initialization.sharded_initializer` draws every
parameter straight into its shards (one batched draw per parameter shape). Reported per layer
count: the abstract build, the initializer's lowering and compile, its run (the draws) and the
whole `build_model` call; the compile should not grow with the layers (benchmarks/RESULTS.md run
15: the former initializer compiled in 11 s at 8 layers, 60 s at 16, minutes at 32).

Run on the GPU machine from the repository root:
  python3 -m benchmarks.bench_init --layers 8 16 32 --tp 1
CPU smoke run (a small preset):
  python3 -m benchmarks.bench_init --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

import boundary_jax as bj
from models.build import build_model
from models.config import PRESETS, DecoderConfig
from models.options import BuildOptions
from models.weights.initialization import param_draws, sharded_initializer

from .common import LLAMA3_8B, header, print_table

HEADERS = ("layers", "tp", "parameters", "abstract s", "lower s", "compile s", "draw s", "cached s")


def run(base: DecoderConfig, layers: int, tp: int, dtype: jnp.dtype) -> tuple:
    """Seconds of each phase of building `base` at `layers` layers on an attention-TP `tp` mesh
    (a row of `HEADERS`)."""
    config = dataclasses.replace(base, num_layers=layers)
    topology = bj.Topology(attn_tp=tp)
    mesh = bj.make_mesh(topology)
    start = time.perf_counter()
    abstract = nnx.eval_shape(lambda: build_model(config, topology, BuildOptions(dtype=dtype)))
    draws = param_draws(nnx.state(abstract), config.layer_blocks(False))
    built = time.perf_counter()
    lowered = sharded_initializer(draws, mesh).lower(jax.random.key(0))
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    jax.block_until_ready(compiled(jax.random.key(0)))
    ran = time.perf_counter()
    # The whole call, its initializer now cached: what a second model of one structure costs.
    model = build_model(config, topology, BuildOptions(dtype=dtype), mesh=mesh)
    jax.block_until_ready(nnx.state(model))
    again = time.perf_counter()
    times = (built - start, lowered_at - built, compiled_at - lowered_at, ran - compiled_at)
    return (layers, tp, len(draws), *times, again - ran)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument(
        "--smoke", action="store_true", help="small-llama in float32 at 2 and 4 layers (CPU)"
    )
    args = parser.parse_args()
    base, dtype, layers = LLAMA3_8B, jnp.bfloat16, args.layers
    if args.smoke:
        base, dtype, layers = PRESETS["small-llama"], jnp.float32, [2, 4]
    name = "small-llama" if args.smoke else "Llama-3-8B shape"
    print(header(f"bench_init: {name}, random weights built on a mesh"))
    print_table(HEADERS, [run(base, n, args.tp, dtype) for n in layers])


if __name__ == "__main__":
    main()
