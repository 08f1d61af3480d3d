"""Where the time goes: GPU kernel times of the project's and the GSPMD baseline's programs.

Runs one case of `bench_e2e` (prefill or decode, Llama-3-8B shape) under `jax.profiler` with a
Perfetto trace (under OUT_DIR/traces/, one folder per contender, as `name_kernels` reads them),
sums device time per kernel name for each contender, and writes the optimized HLO of both
programs to OUT_DIR. `--scan` profiles scanned layers (the project with
`scan_layers=True`, the baseline scanning its stacked layers), as `bench_e2e --scan` times them.
Run on the GPU machine:
  python3 -m benchmarks.profile_e2e OUT_DIR --layers 8 --tp 2 --case prefill
  python3 -m benchmarks.profile_e2e OUT_DIR --layers 8 --tp 1 --case decode --scan --sequences 8
Each decode call runs 8 steps: `name_kernels OUT_DIR/traces DUMP --calls 5 --per 256` lists
the kernels per layer and step of a 32-layer decode (with the same process's HLO dump).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj
from models.build import build_model
from models.inputs.rows import pack_sequences
from models.layers.attention.self_attention import AttentionImpl
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

from .common import LLAMA3_8B, decode_inputs, kernel_table
from .gspmd_baseline import auto_mesh, baseline_caches, baseline_params, make_baseline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--case", choices=("prefill", "decode"), default="prefill")
    parser.add_argument("--scan", action="store_true", help="scanned layers in both programs")
    parser.add_argument("--sequences", type=int, default=64, help="decode sequences")
    parser.add_argument("--cache", type=int, default=1024, help="decode cache length")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(LLAMA3_8B, num_layers=args.layers)
    topology = bj.Topology(attn_tp=args.tp)
    mesh = bj.make_mesh(topology)
    runner = ShardedCausalLM(
        build_model(
            config,
            topology,
            BuildOptions(dtype=jnp.bfloat16, attention=AttentionImpl.CUDNN, scan_layers=args.scan),
            mesh=mesh,
        ),
        mesh,
    )
    gspmd = auto_mesh(mesh)
    params = baseline_params(runner, gspmd, scan=args.scan)
    _, prefill_step, decode = make_baseline(config, cudnn=True, scan=args.scan)
    replicated = NamedSharding(gspmd, PartitionSpec())
    key = jax.device_put(jax.random.key(0), NamedSharding(mesh, PartitionSpec()))
    rng = np.random.default_rng(0)

    def zero_caches(slots, length):
        return baseline_caches(config, topology, gspmd, slots=slots, length=length, scan=args.scan)

    if args.case == "prefill":
        prompts = rng.integers(0, config.vocab_size, (8, 512)).astype(np.int32)
        packed = pack_sequences(list(prompts), topology, max_sequence_rows=512)
        rows, batch = runner.place(packed)
        last_rows = runner.place_array(packed.last_row_index())
        held = [runner.new_caches(packed.decode_rows_per_rank, 512)]
        ids = jax.device_put(prompts, replicated)
        base = [zero_caches(8, 512)]

        def project():
            tokens, held[0] = runner.prefill(rows, batch, held[0], last_rows, key)
            return tokens

        def baseline():
            tokens, base[0] = prefill_step(params, ids, base[0])
            return tokens

        hlo = {
            "project": runner.lower_prefill(rows, batch, held[0], last_rows, key),
            "baseline": prefill_step.lower(params, ids, base[0]),
        }
    else:
        steps, sequences, cache_len = 8, args.sequences, args.cache
        rows, batch = decode_inputs(runner, sequences, cache_len - steps - 1)
        held = [runner.new_caches(sequences, cache_len)]
        tokens = jax.device_put(np.zeros(sequences, np.int32), replicated)
        positions = jax.device_put(np.full(sequences, cache_len - steps - 1, np.int32), replicated)
        base = [zero_caches(sequences, cache_len)]

        def project():
            result, held[0] = runner.decode(rows, batch, held[0], key, steps, capacity=steps)
            return result

        def baseline():
            result, base[0] = decode(params, tokens, positions, base[0], steps)
            return result

        hlo = {
            "project": runner.lower_decode(rows, batch, held[0], key, steps, capacity=steps),
            "baseline": decode.lower(params, tokens, positions, base[0], steps),
        }
    for name, lowered in hlo.items():
        (out / f"{args.case}_{name}.hlo.txt").write_text(lowered.compile().as_text())
    for name, call in (("project", project), ("baseline", baseline)):
        for _ in range(3):
            jax.block_until_ready(call())
        trace_dir = out / "traces" / f"{args.case}_{name}"
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            for _ in range(5):
                jax.block_until_ready(call())
        for kind, table in kernel_table(trace_dir).items():
            scanned = ", scanned" if args.scan else ""
            print(
                f"\n## {name} {args.case}, {args.layers} layers{scanned} TP {args.tp}: {kind} "
                "(per call)"
            )
            total = 0.0
            for kernel, ms, count in table:
                total += ms
                print(f"{ms / 5:9.3f} ms  x{count // 5:<5} {kernel}")
            print(f"(top entries sum {total / 5:.3f} ms per call)")


if __name__ == "__main__":
    main()
