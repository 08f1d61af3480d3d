"""Stand-in stacks for the read options: a read that needs every row of the attention's (the
guide's Qwen4-exp per-layer embedding read) after an FFN on its own rows, which leaves its output
on this rank's attention-TP slice."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import boundary_jax as bj
from boundary_jax import residual_stream
from boundary_jax.designs import AddNormRead
from boundary_jax.report import CollectiveReport, parse_hlo

from .replicated import GroupFfn
from .standin import (
    HIDDEN,
    ROWS,
    StandInAttention,
    make_batch,
    mix_rows,
    random_norm,
    sharded_forward,
)


@dataclasses.dataclass(frozen=True)
class EveryRowRead(AddNormRead):
    """Reads `norm(residual)` plus a contribution computed for every row from all the
    attention's rows (their running mean), as a per-layer embedding read adds one per token: on
    an attention-TP slice it would see only the slice's rows."""

    reads_after_attn_tp_gather: bool = True

    def read(self, residual: jax.Array, norm) -> tuple[jax.Array, jax.Array, None]:
        normed = residual if norm is None else norm(residual)
        return normed + 0.5 * mix_rows(residual), residual, None

    def update_and_read(self, update, value, residual, norm, state=None):
        return self.read(update.apply(residual, value, state), norm)


def psum_gather(x: jax.Array, topology: bj.Topology) -> jax.Array:
    """A stage's own gather over attention TP by another algorithm: each rank places its slice
    in a zero block of the attention's rows and the blocks are summed (an all-reduce in the
    compiled program where the built-in gather is an all-gather)."""
    names = topology.mesh_names((bj.TokenAxis.ATTN_TP,))
    rows = x.shape[0]
    placed = jnp.zeros((topology.attn_tp * rows, *x.shape[1:]), x.dtype)
    placed = jax.lax.dynamic_update_slice_in_dim(placed, x, jax.lax.axis_index(names) * rows, 0)
    return jax.lax.psum(placed, names)


def tiling_gather(x: jax.Array, topology: bj.Topology) -> jax.Array:
    """The mutant gather that skips its communication: this rank's slice, repeated."""
    return jnp.tile(x, (topology.attn_tp,) + (1,) * (x.ndim - 1))


def reversed_gather(x: jax.Array, topology: bj.Topology) -> jax.Array:
    """The mutant gather that concatenates the slices in reverse rank order."""
    names = topology.mesh_names((bj.TokenAxis.ATTN_TP,))
    blocks = jax.lax.all_gather(x, names, axis=0, to="invarying")
    return jnp.concatenate(list(blocks[::-1]), axis=0)


def declining_gather(x: jax.Array, topology: bj.Topology) -> None:
    """A stage's own gather that declines every batch: the built-in gather runs."""
    del x, topology


@dataclasses.dataclass(frozen=True)
class ReadSetup:
    """One stack: mesh, depth, policy, whether the attention's read needs every row of the
    attention's and declares it (`declared=False`: the mutant that reads on the slice;
    `every_row=False`: a plain add + norm read), the attention's own gather over attention TP,
    and the FFN's rows ("own-rows" or "full-tp")."""

    dp: int
    tp: int
    layers: int = 3
    policy: bj.ReductionPolicy = bj.ReductionPolicy.RS_RSV
    declared: bool = True  # the reads' reads_after_attn_tp_gather
    every_row: bool = True
    gather: object = None
    ffn: str = "own-rows"
    final_gather: object = None
    final_slices: bool = False
    final_every_row: bool = False
    completing: tuple = ()  # a plain read's own fused candidates
    gathering: tuple = ()
    input_sum: bj.SumGroup | None = bj.SumGroup.ATTN_TP
    update = None
    rows: int = ROWS

    @property
    def topology(self) -> bj.Topology:
        return bj.Topology(attn_dp=self.dp, attn_tp=self.tp)


class EveryRowLayer(nnx.Module):
    """Attention reading every row of the attention's (or a plain read), then a dense FFN on
    its own rows (or over the full TP group)."""

    def __init__(self, setup: ReadSetup, key, dtype):
        keys = jax.random.split(key, 4)
        self.input_norm = random_norm(keys[0], dtype)
        self.post_attn_norm = random_norm(keys[1], dtype)
        self.attn = StandInAttention(setup.topology, keys[2], dtype)
        own = setup.ffn == "own-rows"
        self.ffn = GroupFfn(setup.topology, None if own else bj.SumGroup.FULL_TP, keys[3], dtype)
        self.read = (
            EveryRowRead(reads_after_attn_tp_gather=setup.declared)
            if setup.every_row
            else AddNormRead(completing_fusions=setup.completing, gathering_reads=setup.gathering)
        )
        attn = bj.declare_attn(read=self.read, attn_tp_gather=setup.gather)
        self.attn_boundary, self.ffn_boundary = bj.append_stages(
            (attn, self.input_norm),
            (bj.declare_ffn(dense_tp_size=1 if own else None), self.post_attn_norm),
            owner=self,
        )

    def __call__(self, x, stream):
        h, stream = self.attn_boundary.prepare(x, stream)
        x, stream = self.attn_boundary.finish(self.attn(h), stream)
        h, stream = self.ffn_boundary.prepare(x, stream)
        return self.ffn_boundary.finish(self.ffn(h), stream)

    def reference(self, rows: jax.Array, update) -> jax.Array:
        del update
        h, _, _ = self.read.read(rows, self.input_norm)
        rows = rows + self.attn(h)
        return rows + self.ffn(self.post_attn_norm(rows))


class EveryRowDecoder(nnx.Module):
    def __init__(self, setup: ReadSetup, key, dtype=jnp.float64):
        keys = jax.random.split(key, setup.layers + 1)
        self.final_read = EveryRowRead() if setup.final_every_row else AddNormRead()
        with bj.layer_stack(
            setup.topology,
            reduction=setup.policy,
            input_sum=setup.input_sum,
            final_read=self.final_read,
            final_attn_tp_gather=setup.final_gather,
            final_reads_attn_tp_slices=setup.final_slices,
        ):
            self.layers = nnx.List(
                [EveryRowLayer(setup, keys[i], dtype) for i in range(setup.layers)]
            )
        self.final_norm = random_norm(keys[-1], dtype)

    def __call__(self, x: jax.Array, batch: bj.BatchFacts) -> jax.Array:
        stream = residual_stream.start(batch)
        for index, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{index}"):
                x, stream = layer(x, stream)
        return residual_stream.final_norm(x, stream, self.final_norm, skip_empty=True)


@dataclasses.dataclass
class ReadCase:
    setup: ReadSetup
    scattered: bool
    model: EveryRowDecoder
    fn: object
    leaves: object
    place: object
    report: CollectiveReport

    def run(self, x, counts):
        return self.fn(self.leaves, self.place(x), make_batch(self.setup, self.scattered, counts))

    def reference(self, x, counts):
        """The decoder on one device, each DP rank's block its own token set, read out by the
        stack's final read."""
        blocks = x.reshape(self.setup.dp, -1, x.shape[-1])
        valid = jnp.arange(blocks.shape[1])[None, :] < jnp.asarray(counts)[:, None]
        model = self.model

        def block_output(block, keep):
            rows = jnp.where(keep[:, None], block, 0)
            for layer in model.layers:
                rows = layer.reference(rows, None)
            out, _, _ = model.final_read.read(rows, model.final_norm)
            return jnp.where(keep[:, None], out, 0)

        return jax.vmap(block_output)(blocks, valid).reshape(x.shape)


@functools.cache
def compiled(setup: ReadSetup, scattered: bool) -> ReadCase:
    """The stack of `setup`, compiled for a batch of full DP blocks, with its collectives."""
    with jax.enable_x64(True):
        model = EveryRowDecoder(setup, jax.random.key(10 * setup.dp + setup.tp + 3))
        batch = make_batch(setup, scattered, np.full(setup.dp, ROWS))
        fn, leaves, place = sharded_forward(model, setup, batch)
        x = np.zeros((setup.dp * ROWS, HIDDEN))
        report = parse_hlo(fn.lower(leaves, place(x), batch).compile().as_text())
    return ReadCase(setup, scattered, model, fn, leaves, place, report)


OFFERED: list[str] = []
"""Which of the read's own candidates each trace ran (appended while tracing)."""


def psum_add(request: bj.fusions.FusionRequest) -> bj.fusions.FusedReadout | None:
    """A read's own completion: the sum over the owed axes and the residual add in one step
    (a plain update only)."""
    if not request.update.plain:
        return None
    OFFERED.append("completing")
    summed = jax.lax.psum(request.value, request.axis_names)
    return bj.fusions.FusedReadout(request.residual + summed)


def psum_add_norm(request: bj.fusions.FusionRequest) -> bj.fusions.FusedReadout | None:
    """A read's own completion that also reads (the guide's `reads=True`)."""
    if not request.update.plain:
        return None
    OFFERED.append("completing and reading")
    residual = request.residual + jax.lax.psum(request.value, request.axis_names)
    return bj.fusions.FusedReadout(residual, request.norm(residual))


def declining_fusion(request: bj.fusions.FusionRequest) -> None:
    """A read's own completion that declines every batch."""
    del request
    OFFERED.append("declined")


def gathering_norm(residual: jax.Array, norm, topology: bj.Topology) -> jax.Array:
    """A read's own read + gather: this rank's slice normalized and gathered in one step."""
    OFFERED.append("gathering")
    names = topology.mesh_names((bj.TokenAxis.ATTN_TP,))
    return jax.lax.all_gather(norm(residual), names, axis=0, tiled=True, to="invarying")


def declining_read(residual: jax.Array, norm, topology: bj.Topology) -> None:
    """A read's own read + gather that declines every batch."""
    del residual, norm, topology
    OFFERED.append("declined")
