"""Heterogeneous stand-in stacks: any sequence of stage kinds, one stage per layer, cut anywhere.

Each stage is its own layer, declared by one shared function (`declare`), so a stack holding
layers [a, b) binds its edge stages against the neighbouring layers' declarations exactly as a
pipeline rank would. Every weight is random and sharded, so every rank's shard differs; weights
depend only on the stage's index, so a cut stack holds the same weights as the uncut one.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
from boundary_jax import residual_stream
from boundary_jax.report import CollectiveReport, parse_hlo

from .standin import (
    HIDDEN,
    ROWS,
    StandInAttention,
    StandInFfn,
    _param,
    input_shares,
    make_mesh,
    random_norm,
)

TOP_K = 2
EXPERT_WIDTH = 16


class Kind(enum.Enum):
    """The stage kinds of the cut sweep."""

    ATTN = "attention that always leaves its sum"
    MIXER = "mixer whose exit may leave its sum"
    HYBRID_MIXER = "mixer whose exit may leave its sum, on inputs it does not gather"
    FFN = "dense FFN over the full TP group"
    FFN_DP = "dense FFN fully data-parallel"
    MOE = "sparse FFN with a deferred finalize"
    MOE_OWN = "sparse FFN on its own rows"


DEFERS = bj.fusions.FusionProvider(defer_finalize=True, terminal_finalize=True)


def declare(kind: Kind, design: dict | None = None) -> bj.StageDeclaration:
    """The one declaration of each kind; `design` may give its `read` and `update`."""
    extra = design or {}
    match kind:
        case Kind.ATTN:
            return bj.declare_attn(**extra)
        case Kind.MIXER:
            return bj.declare_mixer(gathers_attn_tp_input=True, **extra)
        case Kind.HYBRID_MIXER:
            return bj.declare_mixer(**extra)
        case Kind.FFN:
            return bj.declare_ffn(**extra)
        case Kind.FFN_DP:
            return bj.declare_ffn(dense_tp_size=1, **extra)
        case Kind.MOE:
            return bj.declare_ffn(sparse=True, **extra)
        case Kind.MOE_OWN:
            return bj.declare_ffn(sparse=True, moe_dispatch=bj.MoeDispatch.ALL_TO_ALL, **extra)


class StandInMoe(nnx.Module):
    """Top-k experts with softmax routing weights; `sharded` splits each expert over full TP."""

    def __init__(self, topology: bj.Topology, key, dtype, *, sharded: bool):
        k1, k2, k3 = jax.random.split(key, 3)
        cols = topology.shard_entry(bj.SumGroup.MOE_OUTPUT) if sharded else None
        self.w_router = _param(k1, (HIDDEN, TOP_K), (None, None), dtype)
        self.w_up = _param(k2, (HIDDEN, TOP_K, EXPERT_WIDTH), (None, None, cols), dtype)
        self.w_down = _param(k3, (EXPERT_WIDTH, TOP_K, HIDDEN), (cols, None, None), dtype)

    def __call__(self, h: jax.Array, defer: bool) -> jax.Array | bj.DeferredFinalize:
        hidden = jnp.tanh(jnp.einsum("rh,hkf->rkf", h, self.w_up[...]))
        outputs = jnp.einsum("rkf,fkh->rkh", hidden, self.w_down[...])
        weights = jax.nn.softmax(h @ self.w_router[...], axis=-1)
        handoff = bj.DeferredFinalize(outputs, weights)
        return handoff if defer else handoff.complete()


class Stage(nnx.Module):
    """One stage of `kind` as its own layer: boundary, compute and single-device reference."""

    def __init__(self, kind: Kind, topology: bj.Topology, key, dtype, design: dict | None = None):
        k1, k2 = jax.random.split(key)
        self.kind = kind
        self.norm = random_norm(k1, dtype)
        design = design or {}
        self.read, self.update = design.get("read"), design.get("update")
        (self.boundary,) = bj.append_stages((declare(kind, design), self.norm), owner=self)
        match kind:
            case Kind.ATTN | Kind.MIXER | Kind.HYBRID_MIXER:
                self.compute = StandInAttention(topology, k2, dtype)
            case Kind.FFN:
                self.compute = StandInFfn(topology, k2, dtype)
            case Kind.FFN_DP:
                self.compute = StandInFfn(bj.Topology(), k2, dtype)
            case Kind.MOE | Kind.MOE_OWN:
                self.compute = StandInMoe(topology, k2, dtype, sharded=kind is Kind.MOE)

    def __call__(self, x, stream):
        h, stream = self.boundary.prepare(x, stream)
        exit = self.boundary.exit(stream)
        if self.kind in (Kind.MOE, Kind.MOE_OWN):
            return exit.finish(self.compute(h, exit.defer_moe_finalize), stream)
        return exit.finish(self.compute(h), stream)

    def reference(self, rows: jax.Array) -> jax.Array:
        """update(rows, compute(read(rows))) on one device's full block of rows."""
        h, _, state = self.boundary.read.read(rows, self.boundary.norm)
        out = self.compute(h, False) if self.kind in (Kind.MOE, Kind.MOE_OWN) else self.compute(h)
        return self.boundary.update.apply(rows, out, state)


@dataclasses.dataclass(frozen=True)
class Hetero:
    """A stand-in model: its stage kinds, topology, policy and (optionally) a residual update.

    Attributes:
      kinds: One stage kind per layer.
      dp: Attention DP size.
      tp: Attention TP size.
      policy: The reduction policy.
      fusions: The stack's provider (default: hand every finalize on).
      design: `design(index)` gives stage `index`'s `read` and `update` as declaration keywords
        (None: the plain add + norm); called once per declaration, so it must be deterministic.
      final: `final(key, dtype)` builds the module the final read applies (None: an RMSNorm).
    """

    kinds: tuple[Kind, ...]
    dp: int
    tp: int
    policy: bj.ReductionPolicy = bj.ReductionPolicy.RS_RSV
    fusions: bj.fusions.FusionProvider = DEFERS
    design: object = None
    final: object = None

    @property
    def topology(self) -> bj.Topology:
        return bj.Topology(attn_dp=self.dp, attn_tp=self.tp)

    def stage_facts(self, index: int) -> tuple[bj.StageDeclaration, ...]:
        return (declare(self.kinds[index], self.design and self.design(index)),)


class HeteroStack(nnx.Module):
    """Layers [a, b) of a `Hetero` model, each stage with the weights of its global index."""

    def __init__(self, model: Hetero, layers: range, key, dtype=jnp.float64):
        with bj.layer_stack(
            model.topology,
            reduction=model.policy,
            input_sum=bj.SumGroup.ATTN_TP,
            fusions=model.fusions,
            stage_facts=model.stage_facts,
            num_layers=len(model.kinds),
            layers=layers,
        ):
            self.stages = nnx.List(
                [
                    Stage(
                        model.kinds[i],
                        model.topology,
                        jax.random.fold_in(key, i),
                        dtype,
                        model.design and model.design(i),
                    )
                    for i in layers
                ]
            )
        final = model.final or random_norm
        self.final_norm = final(jax.random.fold_in(key, 1000), dtype)

    def run(self, x, stream):
        for index, stage in enumerate(self.stages):
            with jax.named_scope(f"layer_{index}"):
                x, stream = stage(x, stream)
        return x, stream


def reference(stacks: list[HeteroStack], x: jax.Array, dp: int) -> jax.Array:
    """The model on one device: each DP block through every stage, then the final norm."""
    outputs = []
    first = stacks[0].stages[0].boundary
    for block in x.reshape(dp, -1, x.shape[-1]):
        _, block, _ = first.read.init_residual(block, first.norm)
        for stack in stacks:
            for stage in stack.stages:
                block = stage.reference(block)
        outputs.append(stacks[-1].final_norm(block))
    return jnp.concatenate(outputs)


def transport(tensors: dict, topology: bj.Topology) -> dict:
    """The simulated pipeline transport: each attention-TP rank sends its slice of every tensor,
    and the receiver gathers the slices back (inside `shard_map`)."""
    tp = topology.active((bj.TokenAxis.ATTN_TP,))
    slice_, gather = bj.ops.take_block(tp, topology), bj.ops.all_gather(tp, topology)
    return jax.tree.map(lambda t: bj.ops.run(gather, bj.ops.run(slice_, t)), tensors)


KEY = jax.random.key(21)


def make_batch(model: Hetero, variant: bj.BatchVariant, counts, rows: int = ROWS) -> bj.BatchFacts:
    make = {
        bj.BatchVariant.ORDINARY: bj.BatchFacts.ordinary,
        bj.BatchVariant.INPUT_SCATTERED: bj.BatchFacts.input_scattered,
        bj.BatchVariant.UNPADDED: bj.BatchFacts.unpadded,
    }[variant]
    return make(model.topology, counts, rows_per_block=rows)


@dataclasses.dataclass(frozen=True)
class Built:
    """A sharded stand-in model.

    Attributes:
      stacks: Its stacks (one, or the two sides of a cut).
      sharded: Their parameters placed on the mesh.
      place: Places a stack input `x` [dp * rows, HIDDEN] as per-rank shares.
      program: `program(variant)` is the jitted `f(leaves, placed_x, batch)`.
    """

    model: Hetero
    stacks: list
    sharded: bj.ShardedModule
    place: Callable
    program: Callable

    def run(self, x, counts, variant):
        """The output rows for stack input `x` and per-DP-rank token `counts`."""
        batch = make_batch(self.model, variant, counts, x.shape[0] // self.model.dp)
        return self.program(variant)(self.sharded.leaves, self.place(x), batch)

    def retraced(self) -> Built:
        """This model, its programs traced afresh at their next call (so that a step patched
        since takes effect) over the same stacks and placed parameters."""
        self.program.cache_clear()
        return self

    def report(self, x, counts, variant) -> CollectiveReport:
        """The collectives the compiled program runs."""
        batch = make_batch(self.model, variant, counts, x.shape[0] // self.model.dp)
        lowered = self.program(variant).lower(self.sharded.leaves, self.place(x), batch)
        return parse_hlo(lowered.compile().as_text())


def build(
    model: Hetero,
    cut: int | None,
    *,
    finalize_norm=None,
    check_vma: bool = True,
    skip_empty: bool = True,
) -> Built:
    """The jitted sharded forward of `model`, cut before layer `cut` (None: uncut). A cut runs
    to_pp, the simulated transport and from_pp between its two stacks."""
    n = len(model.kinds)
    parts = [range(n)] if cut is None else [range(cut), range(cut, n)]
    with jax.enable_x64(True):
        stacks = nnx.List([HeteroStack(model, part, KEY) for part in parts])
    topology = model.topology

    def body(stacks, x, batch):
        stream = residual_stream.start(batch)
        out, stream = stacks[0].run(x, stream)
        if cut is not None:
            tensors = transport(residual_stream.to_pp(out, stream), topology)
            out, stream = stacks[1].stages[0].boundary.from_pp(tensors, batch)
            out, stream = stacks[1].run(out, stream)
        return residual_stream.final_norm(
            out, stream, stacks[-1].final_norm, skip_empty=skip_empty, finalize_norm=finalize_norm
        )

    sharded, place, program = sharded_stacks(stacks, model, body, check_vma=check_vma)
    return Built(model, list(stacks), sharded, place, program)


def sharded_stacks(
    stacks: nnx.List, model, body: Callable, *, out_specs=None, check_vma: bool = True
) -> tuple[bj.ShardedModule, Callable, Callable]:
    """`stacks` sharded over `model`'s DP x TP mesh: the `ShardedModule`, a function placing a
    stack input `x` [dp * rows, HIDDEN] as per-rank shares, and the jitted `body` program per
    batch variant (built once each; output rows by DP rank unless `out_specs` says)."""
    topology = model.topology
    mesh = make_mesh(model.dp, model.tp)
    sharded = bj.ShardedModule(stacks, mesh)
    dp = topology.spec_entry((bj.TokenAxis.ATTN_DP,))
    in_rows = P(dp, topology.spec_entry((bj.TokenAxis.ATTN_TP,)))
    out_specs = P(dp, None) if out_specs is None else out_specs

    @functools.cache
    def program(variant: bj.BatchVariant) -> Callable:
        spec = bj.BatchFacts(variant, topology, P())
        return sharded.program(
            body, in_specs=(in_rows, spec), out_specs=out_specs, check_vma=check_vma
        )

    def place(x):
        return jax.device_put(input_shares(x, model.tp), NamedSharding(mesh, in_rows))

    return sharded, place, program


@dataclasses.dataclass(frozen=True)
class BuiltMany:
    """Several uncut stand-in models of one topology and policy, run side by side in one
    compiled program (each stack with its own residual stream, on the same input).

    Attributes:
      models: The models, in output order.
      stacks: One stack per model.
      sharded: Their parameters placed on the mesh.
      place: Places a stack input `x` [dp * rows, HIDDEN] as per-rank shares.
      program: The jitted `f(leaves, placed_x, batch)` -> [models, dp * rows, HIDDEN].
    """

    models: tuple[Hetero, ...]
    stacks: list
    sharded: bj.ShardedModule
    place: Callable
    program: Callable

    def run(self, x, counts) -> jax.Array:
        """Every model's output rows for stack input `x` and per-DP-rank token `counts`."""
        batch = make_batch(self.models[0], bj.BatchVariant.ORDINARY, counts)
        return self.program(self.sharded.leaves, self.place(x), batch)


def build_many(models: tuple[Hetero, ...]) -> BuiltMany:
    """The models of one topology and policy (ordinary batches) compiled as one program."""
    first = models[0]
    if any(
        (m.dp, m.tp, m.policy, m.fusions) != (first.dp, first.tp, first.policy, first.fusions)
        for m in models
    ):
        raise ValueError("build_many runs models of one topology, policy and fusion provider")
    with jax.enable_x64(True):
        stacks = nnx.List([HeteroStack(model, range(len(model.kinds)), KEY) for model in models])
    topology = first.topology

    def body(stacks, x, batch):
        outputs = []
        for index, stack in enumerate(stacks):
            with jax.named_scope(f"stack_{index}"):
                stream = residual_stream.start(batch)
                out, stream = stack.run(x, stream)
                outputs.append(
                    residual_stream.final_norm(out, stream, stack.final_norm, skip_empty=True)
                )
        return jnp.stack(outputs)

    dp = topology.spec_entry((bj.TokenAxis.ATTN_DP,))
    sharded, place, program = sharded_stacks(stacks, first, body, out_specs=P(None, dp, None))
    return BuiltMany(tuple(models), list(stacks), sharded, place, program(bj.BatchVariant.ORDINARY))
