"""A stand-in stack whose stages have replicated parts: a bias on the attention's row-parallel
output projection, and a shared expert with its own TP size 1 beside the FFN.

Every rank holds the bias and the shared expert's weights whole and computes them on the same
rows, so each is added only where its stage boundary says this rank counts it
(`StageBoundary.counts`); the single-device reference adds each once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import boundary_jax as bj
from boundary_jax import residual_stream
from boundary_jax.declare import Replicated
from boundary_jax.report import CollectiveReport, parse_hlo

from .standin import (
    FFN_WIDTH,
    HIDDEN,
    ROWS,
    StandInAttention,
    _param,
    make_batch,
    random_norm,
    reference,
    sharded_forward,
)

O_BIAS = "o_proj bias"
SHARED = "shared expert"


class GroupFfn(nnx.Module):
    """A SwiGLU whose width is split over `group` (None: whole on every rank)."""

    def __init__(self, topology: bj.Topology, group: bj.SumGroup | None, key, dtype):
        k1, k2, k3 = jax.random.split(key, 3)
        cols = None if group is None else topology.shard_entry(group)
        self.w_gate = _param(k1, (HIDDEN, FFN_WIDTH), (None, cols), dtype)
        self.w_up = _param(k2, (HIDDEN, FFN_WIDTH), (None, cols), dtype)
        self.w_down = _param(k3, (FFN_WIDTH, HIDDEN), (cols, None), dtype)

    def __call__(self, h: jax.Array) -> jax.Array:
        return (jax.nn.silu(h @ self.w_gate[...]) * (h @ self.w_up[...])) @ self.w_down[...]


FFN_SPLITS = {
    "full-tp": (None, bj.SumGroup.FULL_TP),  # (dense_tp_size, the group its width is split over)
    "attn-tp": ("attn_tp", bj.SumGroup.ATTN_TP),
    "own-rows": (1, None),
}


@dataclasses.dataclass(frozen=True)
class RepSetup:
    """One stack: mesh, depth, policy, how the FFN is split and the stack's fusion provider."""

    dp: int
    tp: int
    layers: int = 3
    policy: bj.ReductionPolicy = bj.ReductionPolicy.RS_RSV
    ffn: str = "full-tp"
    fusions: bj.fusions.FusionProvider = bj.fusions.NO_FUSIONS
    input_sum: bj.SumGroup | None = bj.SumGroup.ATTN_TP
    update = None
    rows: int = ROWS

    @property
    def topology(self) -> bj.Topology:
        return bj.Topology(attn_dp=self.dp, attn_tp=self.tp)

    @property
    def dense_tp_size(self) -> int | None:
        size = FFN_SPLITS[self.ffn][0]
        return self.tp if size == "attn_tp" else size


class ReplicatedLayer(nnx.Module):
    def __init__(self, setup: RepSetup, key, dtype):
        keys = jax.random.split(key, 6)
        self.input_norm = random_norm(keys[0], dtype)
        self.post_attn_norm = random_norm(keys[1], dtype)
        self.attn = StandInAttention(setup.topology, keys[2], dtype)
        self.o_bias = nnx.Param(jax.random.normal(keys[3], (HIDDEN,), dtype))
        self.ffn = GroupFfn(setup.topology, FFN_SPLITS[setup.ffn][1], keys[4], dtype)
        self.shared = GroupFfn(setup.topology, None, keys[5], dtype)
        self.attn_boundary, self.ffn_boundary = bj.append_stages(
            (bj.declare_attn(replicated=(Replicated(O_BIAS),)), self.input_norm),
            (
                bj.declare_ffn(replicated=(Replicated(SHARED),), dense_tp_size=setup.dense_tp_size),
                self.post_attn_norm,
            ),
            owner=self,
        )

    def __call__(self, x, stream):
        h, stream = self.attn_boundary.prepare(x, stream)
        bias = jnp.where(self.attn_boundary.counts(O_BIAS, stream), self.o_bias[...], 0.0)
        x, stream = self.attn_boundary.finish(self.attn(h) + bias[None], stream)
        h, stream = self.ffn_boundary.prepare(x, stream)
        exit = self.ffn_boundary.exit(stream)
        shared = jnp.where(self.ffn_boundary.counts(SHARED, stream), self.shared(h), 0.0)
        return exit.finish(self.ffn(h) + shared, stream)

    def reference(self, rows: jax.Array, update) -> jax.Array:
        del update
        rows = rows + self.attn(self.input_norm(rows)) + self.o_bias[...][None]
        h = self.post_attn_norm(rows)
        return rows + self.ffn(h) + self.shared(h)


class ReplicatedDecoder(nnx.Module):
    def __init__(self, setup: RepSetup, key, dtype=jnp.float64):
        keys = jax.random.split(key, setup.layers + 1)
        with bj.layer_stack(
            setup.topology,
            reduction=setup.policy,
            input_sum=setup.input_sum,
            fusions=setup.fusions,
        ):
            self.layers = nnx.List(
                [ReplicatedLayer(setup, keys[i], dtype) for i in range(setup.layers)]
            )
        self.final_norm = random_norm(keys[-1], dtype)

    def __call__(self, x: jax.Array, batch: bj.BatchFacts) -> jax.Array:
        stream = residual_stream.start(batch)
        for index, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{index}"):
                x, stream = layer(x, stream)
        return residual_stream.final_norm(x, stream, self.final_norm, skip_empty=True)


@dataclasses.dataclass
class RepCase:
    setup: RepSetup
    scattered: bool
    model: ReplicatedDecoder
    fn: object
    leaves: object
    place: object
    report: CollectiveReport

    def run(self, x, counts):
        return self.fn(self.leaves, self.place(x), make_batch(self.setup, self.scattered, counts))

    def reference(self, x, counts):
        return reference(self.model, x, self.setup, counts)


@functools.cache
def compiled(setup: RepSetup, scattered: bool) -> RepCase:
    """The stack of `setup`, compiled for a batch of full DP blocks, with its collectives."""
    with jax.enable_x64(True):
        model = ReplicatedDecoder(setup, jax.random.key(10 * setup.dp + setup.tp))
        batch = make_batch(setup, scattered, np.full(setup.dp, ROWS))
        fn, leaves, place = sharded_forward(model, setup, batch)
        x = np.zeros((setup.dp * ROWS, HIDDEN))
        report = parse_hlo(fn.lower(leaves, place(x), batch).compile().as_text())
    return RepCase(setup, scattered, model, fn, leaves, place, report)
