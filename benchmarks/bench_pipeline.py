"""Pipeline runtime: one jitted program per stage group against one SPMD program over `pp`.

The project's pipeline (`models.pipeline.PipelineCausalLM`) runs each stage as its own program on
its own devices and hands activations on with a collective-permute program between two groups
(MPMD, like the original's ranks). The alternative is MaxText's: one program over the whole mesh
in which every `pp` rank runs its stage and `ppermute`s its output to the next, a GPipe loop of
ticks inside the program. Stages here are not alike (stage 0 embeds, the last reads out, each
cut binds its own boundaries, a split may be uneven), so the SPMD program picks the stage body
with `lax.switch` on the `pp` index, and every device holds an array slot for every stage's
parameters (its own stage's values, zeros elsewhere): the one layout in which a device can hold
a stage's parameters at all without the stages being copies of one another.

Measured for the same model, split and microbatches (a forward of the same packed sequences):
  compile  seconds to compile everything the forward runs (every stage, handoff and read-back
           program for MPMD; the one program for SPMD), on one process;
  params   parameter bytes on the fullest device;
  step     median wall-clock seconds of the microbatched forward, after compilation;
and that both give the logits of the one-program model.

CPU smoke run (8 simulated devices), from the repository root:
  python -m benchmarks.bench_pipeline --smoke
On the GPU machine (two H200s, pp=2):
  python3 -m benchmarks.bench_pipeline --layers 4 --pp 2 --tp 1
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj
from boundary_jax import residual_stream
from models.build import build_model
from models.config import PRESETS, DecoderConfig
from models.pipeline import PipelineCausalLM, build_pipeline, split_microbatches
from models.serving.runtime import ShardedCausalLM

PP = bj.MeshAxis.PP.value


def _bytes_per_device(arrays) -> int:
    """The most parameter bytes any one device holds."""
    held: dict = {}
    for leaf in jax.tree.leaves(arrays):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


def _median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class SpmdPipeline:
    """The whole pipelined forward as one SPMD program over the `pp` axis (see the module
    docstring); a benchmark baseline, not a runtime."""

    def __init__(self, runner: PipelineCausalLM, sequences):
        stages = runner.stages
        self.count = len(stages)
        self.mesh = runner.mesh
        models = [stage.model for stage in stages]
        self.graphdefs = [nnx.split(model)[0] for model in models]
        states = [nnx.split(model)[1] for model in models]
        specs = [nnx.get_partition_spec(state) for state in states]
        self.state_specs = [jax.tree.map(lambda spec: PartitionSpec(PP, *spec), s) for s in specs]
        self.states = [
            self._stack(index, state, spec)
            for index, (state, spec) in enumerate(zip(states, self.state_specs, strict=True))
        ]
        packed = runner.pack(sequences)
        self.parts = split_microbatches(packed, runner.microbatches, runner.topology)
        rows = jax.tree.map(lambda *xs: np.stack(xs), *(p.packed.rows for p in self.parts))
        counts = np.stack([p.packed.token_counts for p in self.parts]).astype(np.int32)
        topology = stages[0].topology
        dp = topology.spec_entry((bj.TokenAxis.ATTN_DP,))
        self.rows_spec = PartitionSpec(None, dp)
        self.rows = jax.device_put(rows, NamedSharding(self.mesh, self.rows_spec))
        self.counts = jax.device_put(counts, NamedSharding(self.mesh, PartitionSpec()))
        self.topology = topology
        self.variant = bj.BatchVariant.ORDINARY
        self.vocab = runner.config.vocab_size
        self.hidden_size = runner.config.hidden_size
        self.dtype = runner.dtype
        self.program = jax.jit(
            jax.shard_map(
                self._body,
                mesh=self.mesh,
                in_specs=(tuple(self.state_specs), self.rows_spec, PartitionSpec()),
                out_specs=PartitionSpec(PP, None, dp, None),
                check_vma=False,
            )
        )

    def _stack(self, index, state, specs):
        """Stage `index`'s parameters in slot `index` of a [pp, ...] array, zeros elsewhere."""

        def stacked(value, spec):
            host = np.zeros((self.count, *value.shape), value.dtype)
            host[index] = np.asarray(value)
            return jax.device_put(host, NamedSharding(self.mesh, spec))

        return jax.tree.map(stacked, state, specs)

    def _stage(self, index, states, handoff, rows, counts):
        model = nnx.merge(self.graphdefs[index], jax.tree.map(lambda x: x[0], states[index]))
        batch = bj.BatchFacts(self.variant, self.topology, counts)
        if index == 0:
            x, stream = model.embed(rows.ids), residual_stream.start(batch)
        else:
            _, receiver = model.layer_structure(model.layer_range.start).stages()[0]
            x, stream = receiver.from_pp(handoff, batch)
        x, stream, _ = model.run_layers(x, stream, rows)
        if index == self.count - 1:
            logits = model.lm_head(model.read_out(x, stream)).astype(jnp.float32)
            return jax.tree.map(jnp.zeros_like, handoff), logits
        return residual_stream.to_pp(x, stream), jnp.zeros(
            (rows.ids.shape[0], self.vocab), jnp.float32
        )

    def _body(self, states, rows, counts):
        stage = lax.axis_index(PP)
        microbatches = len(self.parts)
        local_rows = rows.ids.shape[1]
        # What a dense pre-norm stage hands on at every cut: its completed output and residual.
        empty = jnp.zeros((local_rows, self.hidden_size), self.dtype)
        handoff = {"hidden_states": empty, "residual": empty}
        out = jnp.zeros((1, microbatches, local_rows, self.vocab), jnp.float32)

        def tick(carry, index):
            handoff, out = carry
            microbatch = jnp.clip(index - stage, 0, microbatches - 1)
            picked = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, microbatch, 0, False), rows)
            branches = [
                lambda h, r, c, i=i: self._stage(i, states, h, r, c) for i in range(self.count)
            ]
            sent, logits = lax.switch(
                stage,
                branches,
                handoff,
                picked,
                lax.dynamic_index_in_dim(counts, microbatch, 0, False),
            )
            valid = (index - stage >= 0) & (index - stage < microbatches)
            current = lax.dynamic_index_in_dim(out[0], microbatch, 0, False)
            out = lax.dynamic_update_index_in_dim(
                out, jnp.where(valid, logits, current)[None, None], microbatch, 1
            )
            pairs = [(i, i + 1) for i in range(self.count - 1)]
            return (jax.tree.map(lambda x: lax.ppermute(x, PP, pairs), sent), out), None

        (_, out), _ = lax.scan(tick, (handoff, out), jnp.arange(microbatches + self.count - 1))
        return out

    def logits(self) -> np.ndarray:
        """[sequences, longest, vocab] logits (as `PipelineCausalLM.forward`)."""
        out = np.asarray(self.program(tuple(self.states), self.rows, self.counts))[-1]
        sequences = sum(len(p.sequences) for p in self.parts)
        longest = max(max(p.packed.lengths) for p in self.parts)
        logits = np.zeros((sequences, longest, self.vocab), np.float32)
        for part, rows in zip(self.parts, out, strict=True):
            values = part.packed.unpack(rows)
            logits[list(part.sequences), : values.shape[1]] = values
        return logits


def measure(config: DecoderConfig, pp: int, tp: int, microbatches: int, sequences, repeats: int):
    """The MPMD and SPMD forwards of one model: compile seconds, parameter bytes on the fullest
    device, step seconds, and each one's largest logits difference from the one-program model."""
    one = bj.Topology(attn_tp=tp)
    whole = build_model(config, one)
    want = ShardedCausalLM(whole, bj.make_mesh(one)).forward(sequences)
    topology = bj.Topology(pp=pp, attn_tp=tp)
    mesh = bj.make_mesh(topology)
    runner = PipelineCausalLM(
        build_pipeline(config, topology, mesh, weights=whole), mesh, microbatches=microbatches
    )
    placed = runner.place(sequences)
    start = time.perf_counter()
    jax.block_until_ready(runner.forward_placed(placed))
    first = time.perf_counter() - start
    got = runner.forward(sequences)
    mpmd_step = _median_seconds(lambda: runner.forward_placed(placed), repeats)
    rows = {
        "MPMD (a program per stage)": {
            "compile_s": first - mpmd_step,
            "param_bytes": max(
                _bytes_per_device(nnx.state(stage.model)) for stage in runner.stages
            ),
            "step_s": mpmd_step,
            "max_abs_diff": float(np.max(np.abs(got - want))),
        }
    }
    spmd = SpmdPipeline(runner, sequences)
    start = time.perf_counter()
    compiled = spmd.program.lower(tuple(spmd.states), spmd.rows, spmd.counts).compile()
    compile_s = time.perf_counter() - start
    del compiled
    got = spmd.logits()
    rows["SPMD (switch + ppermute)"] = {
        "compile_s": compile_s,
        "param_bytes": _bytes_per_device(spmd.states),
        "step_s": _median_seconds(
            lambda: spmd.program(tuple(spmd.states), spmd.rows, spmd.counts), repeats
        ),
        "max_abs_diff": float(np.max(np.abs(got - want))),
    }
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model on 8 CPU devices")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.smoke:
        config = dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=args.layers)
        sequences = [[(7 * i + j) % 256 for j in range(5 + 3 * i)] for i in range(8)]
    else:
        from .common import LLAMA3_8B

        config = dataclasses.replace(LLAMA3_8B, num_layers=args.layers)
        sequences = [[(7 * i + j) % 1000 for j in range(512)] for i in range(8)]
    rows = measure(config, args.pp, args.tp, args.microbatches, sequences, args.repeats)
    print(
        f"pipeline forward: {config.architecture} {args.layers} layers, pp={args.pp} "
        f"tp={args.tp}, {args.microbatches} microbatches, {len(sequences)} sequences, "
        f"{jax.device_count()} {jax.default_backend()} devices"
    )
    print(f"{'':30} {'compile s':>10} {'params MB/device':>17} {'step s':>9} {'max |diff|':>11}")
    for name, row in rows.items():
        print(
            f"{name:30} {row['compile_s']:10.2f} {row['param_bytes'] / 2**20:17.3f} "
            f"{row['step_s']:9.4f} {row['max_abs_diff']:11.2e}"
        )


if __name__ == "__main__":
    if "--smoke" in sys.argv:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    main()
