"""Stand-in stacks with branches: each layer is one stage of the stack, optionally with a branch
that starts from that stage's prepared input and merges back into its output.

A branch's first stage computes on the source's prepared input (its own norm never applies);
each later stage reads the branch's residual, which forked from the source's; the merged output
is the branch's residual plus the source's output. Every weight is random and sharded, and
depends only on the layer's index, so a cut stack holds the same weights as the uncut one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import boundary_jax as bj
from boundary_jax import residual_stream
from boundary_jax.report import CollectiveReport, parse_hlo

from .hetero import DEFERS, Kind, StandInMoe, declare, make_batch, sharded_stacks, transport
from .standin import StandInAttention, StandInFfn, random_norm

KEY = jax.random.key(31)


@dataclasses.dataclass(frozen=True)
class Part:
    """One stage of a layer and the kinds of the branch forked from its prepared input."""

    kind: Kind
    branch: tuple[Kind, ...] = ()


@dataclasses.dataclass(frozen=True)
class Branched:
    """A stand-in model: per layer its parts, on a topology and policy."""

    layers: tuple[tuple[Part, ...], ...]
    dp: int
    tp: int
    policy: bj.ReductionPolicy = bj.ReductionPolicy.RS_RSV
    fusions: bj.fusions.FusionProvider = DEFERS

    @property
    def topology(self) -> bj.Topology:
        return bj.Topology(attn_dp=self.dp, attn_tp=self.tp)

    def stage_facts(self, index: int) -> tuple[bj.StageDeclaration, ...]:
        return tuple(declare(part.kind) for part in self.layers[index])


def _compute(kind: Kind, topology: bj.Topology, key, dtype) -> nnx.Module:
    match kind:
        case Kind.ATTN | Kind.MIXER | Kind.HYBRID_MIXER:
            return StandInAttention(topology, key, dtype)
        case Kind.FFN:
            return StandInFfn(topology, key, dtype)
        case Kind.FFN_DP:
            return StandInFfn(bj.Topology(), key, dtype)
        case Kind.MOE | Kind.MOE_OWN:
            return StandInMoe(topology, key, dtype, sharded=kind is Kind.MOE)


def _run(kind: Kind, compute, h, exit):
    if kind in (Kind.MOE, Kind.MOE_OWN):
        return compute(h, exit.defer_moe_finalize)
    return compute(h)


def _reference(kind: Kind, compute, h):
    return compute(h, False) if kind in (Kind.MOE, Kind.MOE_OWN) else compute(h)


class BranchPart(nnx.Module):
    """One stage, and the branch from its prepared input when the part has one."""

    def __init__(self, part: Part, topology: bj.Topology, key, dtype):
        keys = jax.random.split(key, 2 + 2 * len(part.branch))
        self.part = part
        self.norm = random_norm(keys[0], dtype)
        self.compute = _compute(part.kind, topology, keys[1], dtype)
        (self.boundary,) = bj.append_stages((declare(part.kind), self.norm), owner=self)
        items = []
        for index, kind in enumerate(part.branch):
            # The first stage's norm never applies: pass the source's, as LongCat does.
            norm = self.norm if index == 0 else random_norm(keys[2 + 2 * index], dtype)
            setattr(self, f"branch_norm_{index}", norm)
            setattr(
                self,
                f"branch_compute_{index}",
                _compute(kind, topology, keys[3 + 2 * index], dtype),
            )
            items.append((declare(kind), norm))
        self.branch = nnx.List(
            bj.append_stages(*items, owner=self, prepared_from=self.boundary) if items else []
        )

    def branch_part(self, index: int):
        return getattr(self, f"branch_norm_{index}"), getattr(self, f"branch_compute_{index}")

    def __call__(self, x, stream):
        h, stream = self.boundary.prepare(x, stream)
        if self.part.branch:
            g, stream, branch = bj.adapters.branch_input(self.branch[0], self.boundary, h, stream)
        exit = self.boundary.exit(stream)
        out, stream = exit.finish(_run(self.part.kind, self.compute, h, exit), stream)
        if not self.part.branch:
            return out, stream
        kinds = self.part.branch
        exit = self.branch[0].exit(branch)
        y, branch = exit.finish(_run(kinds[0], self.branch_part(0)[1], g, exit), branch)
        for index in range(1, len(kinds)):
            g, branch = self.branch[index].prepare(y, branch)
            exit = self.branch[index].exit(branch)
            y, branch = exit.finish(_run(kinds[index], self.branch_part(index)[1], g, exit), branch)
        y, branch = bj.adapters.branch_output(self.branch[-1], y, branch)
        return bj.adapters.merge_branch(out, stream, y, branch)

    def reference(self, rows: jax.Array) -> jax.Array:
        """The stage and its branch on one device's whole block of rows."""
        h = self.norm(rows)
        out = _reference(self.part.kind, self.compute, h)
        if not self.part.branch:
            return rows + out
        branch = rows
        for index, kind in enumerate(self.part.branch):
            norm, compute = self.branch_part(index)
            branch = branch + _reference(kind, compute, h if index == 0 else norm(branch))
        return branch + out


class BranchLayer(nnx.Module):
    """One layer: its parts in order."""

    def __init__(self, parts: tuple[Part, ...], topology: bj.Topology, key, dtype):
        self.parts = nnx.List(
            [
                BranchPart(part, topology, jax.random.fold_in(key, index), dtype)
                for index, part in enumerate(parts)
            ]
        )

    def __call__(self, x, stream):
        for part in self.parts:
            x, stream = part(x, stream)
        return x, stream

    def reference(self, rows: jax.Array) -> jax.Array:
        for part in self.parts:
            rows = part.reference(rows)
        return rows


class BranchStack(nnx.Module):
    """Layers [a, b) of a `Branched` model."""

    def __init__(self, model: Branched, layers: range, key, dtype=jnp.float64):
        with bj.layer_stack(
            model.topology,
            reduction=model.policy,
            input_sum=bj.SumGroup.ATTN_TP,
            fusions=model.fusions,
            stage_facts=model.stage_facts,
            num_layers=len(model.layers),
            layers=layers,
        ):
            self.layers = nnx.List(
                [
                    BranchLayer(model.layers[i], model.topology, jax.random.fold_in(key, i), dtype)
                    for i in layers
                ]
            )
        self.final_norm = random_norm(jax.random.fold_in(key, 1000), dtype)

    def run(self, x, stream):
        for index, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{index}"):
                x, stream = layer(x, stream)
        return x, stream


def reference(stacks: list[BranchStack], x: jax.Array, dp: int, counts) -> jax.Array:
    """The model on one device: each DP block's valid rows through every layer, then the final
    norm; rows past a block's count are zero."""
    valid = (np.arange(x.shape[0] // dp)[None, :] < np.asarray(counts)[:, None]).reshape(-1)
    outputs = []
    for block in jnp.where(valid[:, None], x, 0).reshape(dp, -1, x.shape[-1]):
        for stack in stacks:
            for layer in stack.layers:
                block = layer.reference(block)
        outputs.append(stacks[-1].final_norm(block))
    return jnp.where(valid[:, None], jnp.concatenate(outputs), 0)


@dataclasses.dataclass(frozen=True)
class Built:
    """A sharded stand-in model with branches: its stacks, sharded module and jitted program."""

    model: Branched
    stacks: list
    sharded: bj.ShardedModule
    place: Callable
    programs: Callable

    @property
    def program(self) -> Callable:
        """The jitted `f(leaves, placed_x, batch)` for ordinary batches."""
        return self.programs(bj.BatchVariant.ORDINARY)

    def batch(self, x, counts, variant=bj.BatchVariant.ORDINARY) -> bj.BatchFacts:
        return make_batch(self.model, variant, counts, x.shape[0] // self.model.dp)

    def run(self, x, counts, variant=bj.BatchVariant.ORDINARY):
        """The output rows for stack input `x` and per-DP-rank token `counts`."""
        return self.programs(variant)(
            self.sharded.leaves, self.place(x), self.batch(x, counts, variant)
        )

    def report(self, x, counts) -> CollectiveReport:
        """The collectives the compiled program runs."""
        lowered = self.program.lower(self.sharded.leaves, self.place(x), self.batch(x, counts))
        return parse_hlo(lowered.compile().as_text())


def build(model: Branched, cut: int | None = None, *, check_vma: bool = True) -> Built:
    """The jitted sharded forward of `model`, cut before layer `cut` (None: uncut)."""
    n = len(model.layers)
    parts = [range(n)] if cut is None else [range(cut), range(cut, n)]
    with jax.enable_x64(True):
        stacks = nnx.List([BranchStack(model, part, KEY) for part in parts])
    topology = model.topology

    def body(stacks, x, batch):
        stream = residual_stream.start(batch)
        out, stream = stacks[0].run(x, stream)
        if cut is not None:
            tensors = transport(residual_stream.to_pp(out, stream), topology)
            out, stream = stacks[1].layers[0].parts[0].boundary.from_pp(tensors, batch)
            out, stream = stacks[1].run(out, stream)
        return residual_stream.final_norm(out, stream, stacks[-1].final_norm, skip_empty=True)

    sharded, place, programs = sharded_stacks(stacks, model, body, check_vma=check_vma)
    return Built(model, list(stacks), sharded, place, programs)


@functools.cache
def built(model: Branched, cut: int | None = None) -> Built:
    """`build`, once per model and cut."""
    return build(model, cut)
