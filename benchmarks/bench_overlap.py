"""Two-batch overlap (TBO) against one batch: forward (prefill) time, and the share of the
collective time that TBO hides.

Cases: a Llama-3-8B-shaped model (bf16, `--layers` layers) on `--dp` x `--tp` GPUs, a forward of
`--sequences` sequences of `--tokens` tokens, run as one batch and under TBO
(`BuildOptions(two_batch_overlap=True)`). Both forwards are checked to agree (bf16) first.

The collective time is measured apart: the one-batch forward's collectives, read from its
compiled HLO (`bj.report.parse_hlo`: kind, bytes, group size), replayed back to back in one
program on the same mesh. The hidden share is (one batch - TBO) / collective time, clipped to
[0, 1]: what TBO saved, as a share of what communication cost. TBO also pays for its half-size
matmuls, so this is a lower bound on what it overlaps. The TBO program's schedule is read too:
of its async collectives (start/done pairs; the CPU has none), how many have the other
microbatch's matmuls scheduled between start and done.

Run on the GPU machine from the repository root:
  python3 -m benchmarks.bench_overlap --tp 2 --layers 8
  python3 -m benchmarks.bench_overlap --smoke          # CPU check, 2 simulated devices
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

import boundary_jax as bj
from models.build import build_model
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

from .common import LLAMA3_8B, LLAMA3_SMOKE, header, median_wall_ms

_SCOPE = re.compile(r"microbatch_(\d)/")


def replay_collectives(report: bj.report.CollectiveReport, mesh, topology: bj.Topology, dtype):
    """A program running `report`'s collectives back to back (each waits for the previous),
    at their sizes, over the mesh axes whose size is their group's."""
    axes = {
        topology.attn_tp: (bj.MeshAxis.ATTN_TP.value,),
        topology.attn_dp: (bj.MeshAxis.ATTN_DP.value,),
        topology.attn_dp * topology.attn_tp: (bj.MeshAxis.ATTN_DP.value, bj.MeshAxis.ATTN_TP.value),
    }
    itemsize = jnp.dtype(dtype).itemsize
    collectives = [c for c in report.collectives if c.group_size > 1]

    def body(seed):
        carry = seed
        for c in collectives:
            names = axes[c.group_size]
            count = max(c.bytes // itemsize, c.group_size)
            if c.kind.startswith("all-gather"):
                x = jnp.full((count // c.group_size,), carry, dtype)
                out = jax.lax.all_gather(x, names, tiled=True)
            elif c.kind.startswith("reduce-scatter"):
                x = jnp.full((count - count % c.group_size,), carry, dtype)
                out = jax.lax.psum_scatter(x, names, tiled=True)
            else:
                out = jax.lax.psum(jnp.full((count,), carry, dtype), names)
            carry = out[0].astype(jnp.float32) * 0 + seed
        return carry

    # The carry only chains the collectives one after another; its value does not matter, so
    # whether it varies over the mesh (after a reduce-scatter it does) is not checked.
    program = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(), check_vma=False
        )
    )
    return lambda: program(jnp.float32(1)), len(collectives)


def overlapped_share(text: str) -> tuple[int, int]:
    """Of the TBO program's async collectives (start/done pairs in its entry computation),
    how many have a matmul of the other microbatch scheduled between start and done."""
    entry = text[text.index("\nENTRY") :]
    lines = entry[: entry.index("\n}\n")].splitlines()
    starts, covered, total = {}, 0, 0
    for index, line in enumerate(lines):
        name = re.match(r"\s*(?:ROOT )?%(\S+) = .*? ([a-z-]+)\(", line)
        if name is None:
            continue
        scope = _SCOPE.search(line)
        if name[2].endswith("-start") and scope:
            starts[name[1]] = (index, scope[1])
        elif name[2].endswith("-done"):
            operand = re.search(r"-done\(%(\S+?)[,)]", line)
            if operand is None or operand[1] not in starts:
                continue
            first, mine = starts.pop(operand[1])
            total += 1
            covered += any(
                "dot_general" in other and (s := _SCOPE.search(other)) and s[1] != mine
                for other in lines[first + 1 : index]
            )
    return covered, total


def run(layers: int, dp: int, tp: int, sequences: int, tokens: int, smoke: bool) -> None:
    config = dataclasses.replace(LLAMA3_8B, num_layers=layers)
    dtype = jnp.bfloat16
    if smoke:
        config = dataclasses.replace(LLAMA3_SMOKE, num_layers=layers)
        dtype = jnp.float32
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    mesh = bj.make_mesh(topology, jax.devices()[: dp * tp])
    one = ShardedCausalLM(build_model(config, topology, BuildOptions(dtype=dtype), mesh=mesh), mesh)
    tbo = ShardedCausalLM(
        one.model, mesh, options=one.model.options.replace(two_batch_overlap=True)
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, tokens).tolist() for _ in range(sequences)]
    placed = {r: r.place(r.pack(prompts)) for r in (one, tbo)}
    logits = {r: r.forward(prompts) for r in (one, tbo)}
    scale = float(np.max(np.abs(logits[one])))
    error = float(np.max(np.abs(logits[tbo] - logits[one]))) / scale
    times = {r: median_wall_ms(lambda r=r: r.forward_placed(*placed[r]), 10) for r in (one, tbo)}
    compiled = one.lower_forward(prompts).compile()
    replay, count = replay_collectives(
        bj.report.parse_hlo(compiled.as_text()), mesh, topology, dtype
    )
    comm = median_wall_ms(replay, 10)
    hidden = min(max((times[one] - times[tbo]) / comm, 0.0), 1.0) if comm > 0 else 0.0
    covered, pairs = overlapped_share(tbo.lower_forward(prompts).compile().as_text())
    print(
        f"layers {layers}, dp {dp} x tp {tp}, {sequences} x {tokens} tokens: "
        f"one batch {times[one]:.2f} ms, TBO {times[tbo]:.2f} ms "
        f"(x{times[one] / times[tbo]:.2f}); one batch's {count} collectives alone {comm:.2f} ms "
        f"({comm / times[one]:.0%} of its forward); hidden by TBO {hidden:.0%}; async "
        f"collectives of TBO with the other microbatch's matmuls inside: {covered} of {pairs}; "
        f"TBO vs one batch logits {error:.1e} relative"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, nargs="+", default=[2])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--smoke", action="store_true", help="a tiny config (CPU check)")
    args = parser.parse_args()
    if args.smoke:
        jax.config.update("jax_num_cpu_devices", 8)
        args.layers, args.sequences, args.tokens = 2, 4, 16
    print(header("bench_overlap"))
    for tp in args.tp:
        run(args.layers, args.dp, tp, args.sequences, args.tokens, args.smoke)


if __name__ == "__main__":
    main()
