"""Running a decoder split into pipeline stages: one jitted program per stage on its own devices,
activations handed on between them, a GPipe schedule of prefill microbatches, and decode one
step at a time through every stage.

Stage s is a `CausalLM` holding its share of the layers (`CausalLM.layer_range`), bound against
its neighbours' declarations, on the devices at `pp` index s of the mesh (attention DP x TP, and
expert parallelism, inside it). Its program enters the stack from the embedding (stage 0) or by
`StageBoundary.from_pp` of what the previous stage sent, runs its layers, and leaves by
`residual.to_pp` (every owed sum completed first) or, on the last stage, through the final norm
and the LM head. `transport.Transfer` carries each handoff device to device.

Every process runs the same schedule and calls the programs of the stages (and transfers) whose
devices it holds, in the same order; a stage it does not hold is followed by shape alone, so the
same code runs on one process or on many.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import boundary_jax as bj
from boundary_jax import residual_stream

from ..decoder.model import CausalLM
from ..inputs.rows import PackedBatch, RowsPhase, TokenRows, decode_rows
from ..layers.attention.self_attention import KVCache
from ..layers.lora import adapter_indices
from ..options import BuildOptions
from ..precision import matmul_precision_scope
from ..serving.buckets import MIN_ROWS, MIN_STEPS, bucket, cache_length, pack_bucketed
from ..serving.generation import check_context, check_prompts
from ..serving.sampling import GREEDY, Sampling, head_tokens, rank_key
from .schedule import Microbatch, bubble, gpipe_ticks, split_microbatches
from .split import PipelineSplit
from .transport import (
    REPLICATED,
    Collect,
    Transfer,
    holds,
    place_rows,
    rows_spec,
    settle,
    stage_meshes,
)

Tree = Any


def enter_stage(
    model: CausalLM, inputs: Tree, ids: jax.Array, batch: bj.BatchFacts
) -> tuple[jax.Array | bj.OwedOutput, bj.ResidualStream]:
    """A stage's stack entry, inside its `shard_map`: the embedding of `ids` and a fresh stream
    on stage 0, else the stream the previous stage's `to_pp` sent (`inputs`), rebuilt by the
    receiving boundary's `from_pp`."""
    if model.holds_first:
        return model.embed(ids), residual_stream.start(batch)
    _, receiver = model.layer_structure(model.layer_range.start).stages()[0]
    return receiver.from_pp(inputs, batch)


class Stage:
    """One pipeline stage: its model's graph, its mesh, its placed state where this process
    holds its devices, and its programs.

    Attributes:
      index: The stage's position in the pipeline.
      layers: The model layers it holds.
      mesh: Its devices (the pipeline mesh's at `pp` index `index`).
      held: This process holds some of its devices (and runs its programs).
      model: The stage's model over its placed state (abstract where not held).
      matmul_precision: The precision its programs trace their matmuls with.
    """

    def __init__(
        self,
        index: int,
        model: CausalLM,
        mesh: Mesh,
        *,
        check_vma: bool,
        matmul_precision: lax.Precision = lax.Precision.DEFAULT,
    ):
        if bj.Topology.from_mesh(mesh, moe_ep=model.topology.moe_ep) != model.topology:
            raise ValueError(
                f"stage {index} is bound on {model.topology} but its mesh is "
                f"{bj.Topology.from_mesh(mesh, moe_ep=model.topology.moe_ep)}"
            )
        self.index = index
        self.layers = model.layer_range
        self.mesh = mesh
        self.held = holds(mesh)
        self.topology = model.topology
        self.first, self.last = model.holds_first, model.holds_last
        self._check_vma = check_vma
        self.matmul_precision = matmul_precision
        self._sharded = bj.ShardedModule(model, mesh, held=self.held)
        self._programs: dict[tuple, Callable] = {}
        self._shapes: dict[tuple, Tree] = {}
        self.rows = rows_spec(self.topology)
        self.cache_specs = model.cache_specs()

    @property
    def model(self) -> CausalLM:
        """The stage's model over its placed state (abstract where this process lacks it)."""
        return self._sharded.module

    @property
    def leaves(self) -> tuple:
        """The stage's placed state as a flat tuple of arrays (shapes only where this process
        does not hold it): what its programs take (`bj.ShardedModule.leaves`)."""
        return self._sharded.leaves

    @property
    def leaf_specs(self) -> tuple:
        """The `PartitionSpec` of every leaf of `leaves`."""
        return self._sharded.leaf_specs

    @property
    def state(self) -> nnx.State:
        """`leaves` as the stage model's `nnx.State`."""
        return self._sharded.state

    def state_of(self, leaves: tuple) -> nnx.State:
        """`leaves` of this stage's structure (parameters, or their gradients) as an
        `nnx.State`."""
        return self._sharded.state_of(leaves)

    def sharded(self, body: Callable, in_specs: tuple, out_specs: Tree) -> Callable:
        """`f(leaves, *args)`: `body(model, *args)` inside `shard_map` on this stage's devices
        (not jitted: a caller may differentiate it first), traced at `matmul_precision`."""
        precision = self.matmul_precision

        def call(model, *args):
            with matmul_precision_scope(precision):
                return body(model, *args)

        return self._sharded.sharded(
            call, in_specs=in_specs, out_specs=out_specs, check_vma=self._check_vma
        )

    def program(
        self,
        name: tuple,
        body: Callable,
        in_specs: tuple,
        out_specs: Tree,
        donate: tuple[int, ...] = (),
    ) -> Callable:
        """The jitted `sharded(body, ...)` program, built once per name; `donate` indexes
        `args`."""
        if name not in self._programs:
            self._programs[name] = jax.jit(
                self.sharded(body, in_specs, out_specs),
                donate_argnums=tuple(1 + i for i in donate),
            )
        return self._programs[name]

    def cached(self, name: tuple, make: Callable[[], Callable]) -> Callable:
        """The program `make()` builds, built once per name."""
        if name not in self._programs:
            self._programs[name] = make()
        return self._programs[name]

    def run(self, program: Callable, *args, leaves: tuple | None = None) -> Tree:
        """`program(leaves, *args)` (by default the stage's own `leaves`); where this process
        does not hold the stage, the shapes of what it would return (traced once per argument
        shapes)."""
        leaves = self.leaves if leaves is None else leaves
        if self.held:
            return settle(program(leaves, *args), self.mesh)
        key = (program, jax.tree.structure(args), tuple(_shape(x) for x in jax.tree.leaves(args)))
        if key not in self._shapes:
            self._shapes[key] = jax.eval_shape(program, leaves, *args)
        return self._shapes[key]

    def place(self, packed: PackedBatch, variant: bj.BatchVariant) -> tuple[TokenRows, Tree]:
        """A packed batch's rows and batch facts on this stage's devices."""
        counts = place_rows(np.asarray(packed.token_counts, np.int32), self.mesh, REPLICATED)
        return place_rows(packed.rows, self.mesh, self.rows), bj.BatchFacts(
            variant, self.topology, counts
        )

    def new_caches(self, config, slots: int, max_len: int, dtype) -> tuple[KVCache, ...]:
        """Zero decode caches of this stage's layers, one per block, `slots` slots in all (the
        model's own kind per layer: `CausalLM.new_caches`)."""
        del config  # the stage's model holds it

        def create():
            return self.model.new_caches(slots=slots, max_len=max_len, dtype=dtype, mesh=self.mesh)

        if self.held:
            return create()
        return jax.tree.map(
            lambda x, spec: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(self.mesh, spec)
            ),
            jax.eval_shape(create),
            self.cache_specs,
        )


def _shape(value) -> tuple:
    return (tuple(value.shape), str(value.dtype))


@dataclasses.dataclass(frozen=True)
class PlacedMicrobatches:
    """A batch's microbatches, their rows and batch facts placed on every stage.

    Attributes:
      parts: The microbatches.
      placed: `placed[stage][microbatch]` is `(rows, batch facts)` on that stage's devices.
      lengths: The length of each sequence of the whole batch.
    """

    parts: tuple[Microbatch, ...]
    placed: tuple[tuple[tuple[TokenRows, bj.BatchFacts], ...], ...]
    lengths: tuple[int, ...]


class PipelineCausalLM:
    """A `CausalLM` split into pipeline stages, each on its own device group: forward, prefill
    (GPipe microbatches) and decode through every stage, and generation.

    The stages' devices are the pipeline mesh's at each `pp` index; each stage runs attention
    DP x TP (and expert parallelism) inside. Results (logits, tokens) come back to every
    process.

    Attributes:
      mesh: The pipeline mesh; its axes are boundary-jax's `MeshAxis` names, `pp` outermost.
      topology: The parallel topology (`pp` stages of the stage meshes' sizes).
      config: The model's architecture.
      split: The layers of each stage.
      microbatches: How many microbatches a batch's sequences are split into.
      input_scattered: Run batches input-scattered (residual on attention-TP slices).
      matmul_precision: The precision every stage's programs trace their matmuls with (the
        `precision` of the stage models' options, or of `options` given, which may change only
        `RUNTIME_SWITCHES`, as `ShardedCausalLM`).
      variant: The batch variant every stage runs.
      stages: The `Stage`s.
      sends: `sends[s]` hands stage s's output to stage s + 1.
    """

    def __init__(
        self,
        stages: Sequence[CausalLM],
        mesh: Mesh,
        *,
        microbatches: int | None = None,
        input_scattered: bool = False,
        check_vma: bool = True,
        options: BuildOptions | None = None,
    ):
        meshes = stage_meshes(mesh)
        if len(meshes) != len(stages):
            raise ValueError(
                f"the mesh has pp={len(meshes)} stage groups; got {len(stages)} stage models"
            )
        self.split = PipelineSplit(tuple(model.layer_range for model in stages))
        self.mesh = mesh
        self.config = stages[0].config
        self.topology = bj.Topology.from_mesh(mesh, moe_ep=stages[0].topology.moe_ep)
        self.microbatches = len(stages) if microbatches is None else microbatches
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be at least 1; got {microbatches}")
        self.input_scattered = input_scattered
        self.dtype = stages[0].options.dtype
        self.matmul_precision = stages[0].options.for_running(options).precision
        self.stages = tuple(
            Stage(
                index,
                model,
                stage_mesh,
                check_vma=check_vma,
                matmul_precision=self.matmul_precision,
            )
            for index, (model, stage_mesh) in enumerate(zip(stages, meshes, strict=True))
        )
        self.variant = (
            bj.BatchVariant.INPUT_SCATTERED if input_scattered else bj.BatchVariant.ORDINARY
        )
        for model in stages:
            model.check_batch_variant(self.variant)
        stage_topology = stages[0].topology
        self.sends = tuple(
            Transfer(a, b, stage_topology) for a, b in zip(meshes[:-1], meshes[1:], strict=True)
        )
        self._loop = Transfer(meshes[-1], meshes[0], stage_topology) if len(meshes) > 1 else None
        self._collect = Collect(meshes, stage_topology)

    @property
    def bubble(self) -> float:
        """The idle fraction of each stage in a prefill of `microbatches` microbatches."""
        return bubble(len(self.stages), self.microbatches)

    # -- packing --------------------------------------------------------------------------

    def pack(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        bucketed: bool = False,
        adapters: Sequence[str | int | None] | None = None,
    ) -> PackedBatch:
        """Packs sequences (each with its LoRA adapter, given `adapters`) onto the DP ranks as
        `ShardedCausalLM.pack` does (checked by `check_prompts`, `check_context` and
        `adapter_indices`)."""
        sequences = check_prompts(sequences, self.config.vocab_size)
        check_context(sequences, 0, self.config.max_position_embeddings)
        indices = adapter_indices(self.stages[0].model.options.lora, adapters, len(sequences))
        return pack_bucketed(sequences, self.topology, bucketed=bucketed, adapters=indices)

    def _microbatches(self, packed: PackedBatch, *, bucketed: bool) -> tuple[Microbatch, ...]:
        parts = split_microbatches(packed, self.microbatches, self.topology)
        if not bucketed:
            return parts
        rows = bucket(max(parts[0].packed.rows_per_rank, MIN_ROWS), self.topology.attn_tp)
        return split_microbatches(packed, self.microbatches, self.topology, rows_per_rank=rows)

    # -- stage programs -------------------------------------------------------------------

    def forward_program(self, stage: Stage) -> Callable:
        """Stage `stage`'s forward: `(state, inputs, rows, batch)` to its handoff, or on the last
        stage to float32 logits of every row."""

        def body(model, inputs, rows, batch):
            x, stream = enter_stage(model, inputs, rows.ids, batch)
            x, stream, _ = model.run_layers(x, stream, rows)
            if not stage.last:
                return residual_stream.to_pp(x, stream)
            return model.lm_head(model.read_out(x, stream)).astype(jnp.float32)

        out = PartitionSpec(*stage.rows, None) if stage.last else stage.rows
        spec = bj.BatchFacts(self.variant, stage.topology, PartitionSpec())
        return stage.program(("forward",), body, (stage.rows, stage.rows, spec), out)

    def _prefill_program(self, stage: Stage, sampling: Sampling) -> Callable:
        def body(model, inputs, rows, batch, caches, last_rows, key, tokens):
            x, stream = enter_stage(model, inputs, rows.ids, batch)
            x, stream, caches = model.run_layers(x, stream, rows, caches)
            if not stage.last:
                return residual_stream.to_pp(x, stream), caches
            hidden = model.read_out(x, stream, last_rows)
            key = rank_key(jax.random.wrap_key_data(key), stage.topology)
            drawn = head_tokens(model, hidden, key, sampling)
            return jnp.where(last_rows >= 0, drawn, tokens), caches

        spec = bj.BatchFacts(self.variant, stage.topology, PartitionSpec())
        rows, caches, one = stage.rows, stage.cache_specs, PartitionSpec()
        return stage.program(
            ("prefill", sampling),
            body,
            (rows, rows, spec, caches, rows, PartitionSpec(), rows if stage.last else one),
            (rows, caches),
            donate=(3, 6),
        )

    def _decode_program(self, stage: Stage, sampling: Sampling) -> Callable:
        def body(model, inputs, rows, batch, caches, key, index, out):
            active = rows.segment_ids >= 0
            ids = jnp.where(active, inputs, 0) if stage.first else rows.ids
            current = dataclasses.replace(
                rows, ids=ids, positions=rows.positions + index, phase=RowsPhase.DECODE
            )
            x, stream = enter_stage(model, inputs, current.ids, batch)
            x, stream, caches = model.run_layers(x, stream, current, caches)
            if not stage.last:
                return residual_stream.to_pp(x, stream), caches, index + 1
            key = rank_key(jax.random.wrap_key_data(key), stage.topology)
            key = jax.random.fold_in(key, index)
            tokens = jnp.where(
                active, head_tokens(model, model.read_out(x, stream), key, sampling), 0
            )
            out = lax.dynamic_update_index_in_dim(out, tokens, index, axis=1)
            return (tokens, out), caches, index + 1

        spec = bj.BatchFacts(self.variant, stage.topology, PartitionSpec())
        rows, caches, one = stage.rows, stage.cache_specs, PartitionSpec()
        return stage.program(
            ("decode", sampling),
            body,
            (rows, rows, spec, caches, one, one, rows if stage.last else one),
            ((rows, rows) if stage.last else rows, caches, one),
            donate=(3, 5, 6),
        )

    # -- forward --------------------------------------------------------------------------

    def forward(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        adapters: Sequence[str | int | None] | None = None,
    ) -> np.ndarray:
        """float32 logits [sequences, longest, vocab] of ragged token-id lists, zero past ends
        (as `ShardedCausalLM.forward`), the microbatches run on the GPipe schedule."""
        batch = self.place(sequences, adapters=adapters)
        logits = self.forward_placed(batch)
        out = np.zeros((len(sequences), max(batch.lengths), self.config.vocab_size), np.float32)
        for part, values in zip(batch.parts, logits, strict=True):
            rows = part.packed.unpack(self._collect(values, len(self.stages) - 1))
            out[list(part.sequences), : rows.shape[1]] = rows
        return out

    def place(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        adapters: Sequence[str | int | None] | None = None,
    ) -> PlacedMicrobatches:
        """The sequences packed (with their LoRA adapters, given `adapters`), split into
        microbatches and placed on every stage."""
        packed = self.pack(sequences, adapters=adapters)
        parts = self._microbatches(packed, bucketed=False)
        placed = tuple(
            tuple(stage.place(part.packed, self.variant) for part in parts) for stage in self.stages
        )
        return PlacedMicrobatches(parts, placed, packed.lengths)

    def forward_placed(self, batch: PlacedMicrobatches) -> list[jax.Array]:
        """The last stage's float32 logits [attn_dp * rows_per_rank, vocab] of each placed
        microbatch (on its devices), run on the GPipe schedule."""
        programs = [self.forward_program(stage) for stage in self.stages]
        return self._schedule(
            len(batch.parts),
            lambda s, m, inputs: self.stages[s].run(programs[s], inputs, *batch.placed[s][m]),
        )

    def _schedule(self, microbatches: int, run: Callable[[int, int, Tree], Tree]) -> list[Tree]:
        """Runs `run(stage, microbatch, inputs)` on the GPipe schedule, handing each stage's
        output to the next; returns the last stage's output per microbatch."""
        handoffs: dict[tuple[int, int], Tree] = {}
        results: list[Tree] = [None] * microbatches
        last = len(self.stages) - 1
        for tick in gpipe_ticks(len(self.stages), microbatches):
            for stage, microbatch in tick:
                out = run(stage, microbatch, handoffs.pop((stage, microbatch), {}))
                if stage == last:
                    results[microbatch] = out
                else:
                    handoffs[(stage + 1, microbatch)] = self.sends[stage](out)
        return results

    # -- generation -----------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        sampling: Sampling = GREEDY,
        seed: int = 0,
        adapters: Sequence[str | int | None] | None = None,
    ) -> np.ndarray:
        """Continuation of each prompt: int32 [prompts, max_new_tokens], the tokens
        `ShardedCausalLM.generate` draws for the same prompts, sampling, seed and adapters.

        The prompts' microbatches fill every stage's KV caches on the GPipe schedule, the last
        stage sampling each slot's first token; each further token runs one decode step through
        every stage, the last stage's tokens handed back to the first. The tokens come back to
        the host once, at the end.
        """
        chunks = self.generate_stream(
            prompts,
            max_new_tokens,
            chunk=max_new_tokens,
            sampling=sampling,
            seed=seed,
            adapters=adapters,
        )
        return np.concatenate(list(chunks), axis=1)

    def generate_stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        chunk: int,
        sampling: Sampling = GREEDY,
        seed: int = 0,
        adapters: Sequence[str | int | None] | None = None,
    ) -> Iterator[np.ndarray]:
        """`generate`'s tokens as they come, as `ShardedCausalLM.generate_stream`: yields int32
        [prompts, n] arrays, first the prefill's token (n = 1), then `chunk` decode steps at a
        time; together they equal `generate`'s. Stop early by leaving the loop; under several
        processes, every process must leave it at the same point (each gets the same tokens).
        Checks the request before anything runs.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1 decode step; got {chunk}")
        prompts = check_prompts(prompts, self.config.vocab_size)
        check_context(prompts, max_new_tokens, self.config.max_position_embeddings)
        packed = self.pack(prompts, bucketed=True, adapters=adapters)
        longest = max(packed.lengths) + max_new_tokens
        return self._token_chunks(packed, longest, max_new_tokens, sampling, seed, chunk)

    def _token_chunks(
        self,
        packed: PackedBatch,
        longest: int,
        max_new_tokens: int,
        sampling: Sampling,
        seed: int,
        chunk: int,
    ) -> Iterator[np.ndarray]:
        slots = packed.decode_rows_per_rank * self.topology.attn_dp
        length = cache_length(longest, self.config.max_position_embeddings)
        caches = [stage.new_caches(self.config, slots, length, self.dtype) for stage in self.stages]
        prefill_key, decode_key = jax.random.split(jax.random.key(seed))
        first = self._prefill(packed, caches, prefill_key, sampling)
        order = packed.slot_order()
        yield self._collect(first, len(self.stages) - 1)[order, None].astype(np.int32)
        steps = max_new_tokens - 1
        if steps:
            for tokens in self._decode(packed, caches, first, decode_key, steps, sampling, chunk):
                yield tokens[order].astype(np.int32)

    def _prefill(self, packed: PackedBatch, caches: list, key: jax.Array, sampling: Sampling):
        """Fills `caches` (in place) with every microbatch; returns the first token per slot,
        on the last stage."""
        parts = self._microbatches(packed, bucketed=True)
        keys = [place_rows(jax.random.key_data(key), s.mesh, REPLICATED) for s in self.stages]
        programs = [self._prefill_program(stage, sampling) for stage in self.stages]
        slots = len(packed.last_row_index())
        last = self.stages[-1]
        tokens = [place_rows(np.zeros(slots, np.int32), last.mesh, last.rows)]

        def run(s, m, inputs):
            stage, part = self.stages[s], parts[m].packed
            last_rows = place_rows(part.last_row_index(), stage.mesh, stage.rows)
            args = (inputs, *stage.place(part, self.variant), caches[s], last_rows, keys[s])
            out, caches[s] = stage.run(programs[s], *args, tokens[0] if stage.last else ())
            if stage.last:
                tokens[0] = out
            return out

        self._schedule(len(parts), run)
        return tokens[0]

    def _decode(
        self, packed, caches: list, first, key: jax.Array, steps: int, sampling, chunk: int
    ) -> Iterator[np.ndarray]:
        """`steps` decode steps through every stage from the first tokens (on the last stage);
        yields the tokens of every `chunk` steps (and of the last ones), [slots, n] (slot-major),
        on every process."""
        lengths = np.asarray(packed.lengths, np.int32)
        host = decode_rows(packed, np.zeros_like(lengths), lengths)
        placed = [stage.place(host, self.variant) for stage in self.stages]
        keys = [place_rows(jax.random.key_data(key), s.mesh, REPLICATED) for s in self.stages]
        counters = [place_rows(np.int32(0), stage.mesh, REPLICATED) for stage in self.stages]
        slots, capacity = len(packed.last_row_index()), bucket(max(steps, MIN_STEPS))
        last = self.stages[-1]
        out = place_rows(np.zeros((slots, capacity), np.int32), last.mesh, last.rows)
        programs = [self._decode_program(stage, sampling) for stage in self.stages]
        tokens, done = first, 0
        for step in range(1, steps + 1):
            inputs = tokens if self._loop is None else self._loop(tokens)
            for index, stage in enumerate(self.stages):
                args = (inputs, *placed[index], caches[index], keys[index], counters[index])
                handoff, caches[index], counters[index] = stage.run(
                    programs[index], *args, out if stage.last else ()
                )
                if stage.last:
                    tokens, out = handoff
                else:
                    inputs = self.sends[index](handoff)
            if step % chunk == 0 or step == steps:
                yield self._collect(out, len(self.stages) - 1)[:, done:step]
                done = step
