"""Running a decoder sharded over a mesh: `shard_map` inside `jit`, prefill, decode, generate.

The serving path stays on the device: a prefill writes the KV caches in place and samples each
sequence's next token from its last row's logits; a decode loop (`lax.fori_loop` inside one
program) runs any number of steps, sampling on the device; only the token ids come back.
Static sizes (prefill rows, cache slots, cache length, decode steps) are rounded up to buckets,
so requests of nearby shapes share one compiled program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import boundary_jax as bj

from ..decoder.captures import hidden_captured
from ..decoder.model import CausalLM
from ..distributed import fetch
from ..inputs.rows import PackedBatch, RowsPhase, TokenRows
from ..layers.attention.context_parallel import share_over_cp
from ..layers.attention.kv_cache import KVCache
from ..layers.lora import adapter_indices
from ..options import BuildOptions
from ..precision import matmul_precision_scope
from .buckets import (
    MIN_ROWS,
    DecodeLoop,
    PlacedCounts,
    blocked_fori_loop,
    bucket,
    decode_loop,
    pack_bucketed,
)
from .generation import check_context, check_prompts, token_chunks
from .overlap import check_two_batch_overlap, hidden_states, microbatch_facts, pack_two_batches
from .sampling import GREEDY, Sampling, head_tokens, rank_key


def _next_tokens(
    model: CausalLM,
    rows: TokenRows,
    batch: bj.BatchFacts,
    caches: tuple[KVCache, ...],
    last_rows: jax.Array | None,
    key: jax.Array,
    sampling: Sampling,
    *,
    tbo: bool = False,
) -> tuple[jax.Array, tuple[KVCache, ...]]:
    """The next token per row (or per `last_rows` entry), and the updated caches
    (`head_tokens` of the model's final-norm output)."""
    out, caches = hidden_states(model, rows, batch, caches, last_rows, tbo=tbo)
    return head_tokens(model, out, key, sampling), caches


class ShardedCausalLM:
    """A `CausalLM` placed on a mesh, with jitted sharded forward, prefill, decode and generation.

    The runner keeps the model's graph and its placed state only: build the model with
    `build_model(..., mesh=mesh)` or `load_model` and drop your own reference to it, and no
    unsharded copy of a weight exists.

    The `place*`, `new_caches`, `prefill` and `decode` methods are the placed-input API, for
    callers (servers, benchmarks) that run the same shapes repeatedly: they take and return
    device arrays and never copy to the host.

    Attributes:
      mesh: The mesh; its axes are boundary-jax's `MeshAxis` names.
      topology: The model's parallel topology.
      config: The model's architecture.
      input_scattered: Run batches input-scattered (residual on attention-TP slices).
      check_vma: `shard_map`'s varying-axes check; on by default, Pallas kernels (fusion
        candidates, expert matmuls) included: each declares how its outputs vary.
      options: The options the model runs under: its own, or those given, which may change
        only `RUNTIME_SWITCHES` (`BuildOptions.for_running`).
      matmul_precision: The precision every program traces its matmuls with
        (`options.precision`: `HIGHEST` for a float32 model, true float32 where a GPU's default
        is TF32; `DEFAULT` for other dtypes).
      two_batch_overlap: `options.two_batch_overlap`: forward, prefill and decode
        run as two microbatches, one's collectives beside the other's compute
        (`models.serving.overlap`): `pack` splits the sequences into two microbatches (a batch
        needs at least two), `place` gives each its batch facts. Not built with pipeline
        stages, context parallelism, scanned layers, captures or single-stage (hybrid) layers.
    """

    def __init__(
        self,
        model: CausalLM,
        mesh: Mesh,
        *,
        options: BuildOptions | None = None,
        input_scattered: bool = False,
        check_vma: bool = True,
    ):
        self.options = model.options.for_running(options)
        two_batch_overlap = self.options.two_batch_overlap
        if two_batch_overlap:
            check_two_batch_overlap(model)
        mesh_topology = bj.Topology.from_mesh(mesh, moe_ep=model.topology.moe_ep)
        if mesh_topology != model.topology:
            raise ValueError(
                f"the model is bound on {model.topology} but the mesh is {mesh_topology}"
            )
        self.mesh = mesh
        self._platform = mesh.devices.flat[0].platform
        self.topology = model.topology
        self.config = model.config
        self.input_scattered = input_scattered
        self.two_batch_overlap = two_batch_overlap
        self.check_vma = check_vma
        self.dtype = model.final_norm.weight[...].dtype
        self.matmul_precision = self.options.precision
        self._sharded = bj.ShardedModule(model, mesh)
        self._leaves = self._sharded.leaves
        rows = model.topology.row_spec(model.topology.attention_rows())
        self._rows = rows
        self._variant = (
            bj.BatchVariant.INPUT_SCATTERED if input_scattered else bj.BatchVariant.ORDINARY
        )
        model.check_batch_variant(self._variant)
        batch_spec = bj.BatchFacts(self._variant, model.topology, PartitionSpec())
        self._batch_spec = (batch_spec, batch_spec) if two_batch_overlap else batch_spec
        self._logits_spec = PartitionSpec(rows[0], None)
        specs = model.cache_specs()
        self._cache_specs = (specs, specs) if two_batch_overlap else specs
        tbo = two_batch_overlap
        self._forward = self.sharded_program(
            lambda model, rows, batch: model.lm_head(
                hidden_states(model, rows, batch, tbo=tbo)[0]
            ).astype(jnp.float32),
            in_specs=(rows, self._batch_spec),
            out_specs=self._logits_spec,
            check_vma=check_vma,
        )
        self._programs: dict[tuple, Callable] = {}
        self._step_count = PlacedCounts(mesh)

    def sharded_program(self, call: Callable, **options) -> Callable:
        """A program of `call(model, *args)` over the placed model (`bj.ShardedModule.program`
        with `options`), traced under the runner's matmul precision, called as
        `program(runner.leaves, *args)`: the runner's programs and the paged server's step."""
        precision = self.matmul_precision

        def traced(*args):
            with matmul_precision_scope(precision):
                return call(*args)

        return self._sharded.program(traced, **options)

    @property
    def leaves(self):
        """The placed state's leaves, the first argument of every `sharded_program`."""
        return self._leaves

    @property
    def row_spec(self) -> PartitionSpec:
        """The `PartitionSpec` of token rows (and of per-slot arrays): split over attention DP."""
        return self._rows

    @property
    def model(self) -> CausalLM:
        """The model over the placed (sharded) state; no copy is made."""
        return self._sharded.module

    @property
    def state(self) -> nnx.State:
        """The placed parameters (global arrays sharded over the mesh)."""
        return self._sharded.state

    # -- placing inputs -------------------------------------------------------------------

    def pack(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        bucketed: bool = False,
        adapters: Sequence[str | int | None] | None = None,
    ) -> PackedBatch:
        """Packs sequences onto the DP ranks (`pack_bucketed`); under two-batch overlap as two
        microbatches (`pack_two_batches`), `bucketed` rounding each half as `pack_bucketed`
        rounds a block. `adapters` names each sequence's LoRA adapter (a loaded adapter's name
        or index, None for none; `LoraSpec.index`).

        Raises:
          TypeError, ValueError: A sequence is text, holds an id outside the vocabulary or
            passes the context (`check_prompts`, `check_context`), or an adapter is not loaded.
        """
        sequences = check_prompts(sequences, self.config.vocab_size)
        check_context(sequences, 0, self.config.max_position_embeddings)
        indices = adapter_indices(self.options.lora, adapters, len(sequences))
        if not self.two_batch_overlap:
            return pack_bucketed(sequences, self.topology, bucketed=bucketed, adapters=indices)
        if indices is not None:
            raise NotImplementedError(
                "LoRA adapters are not served under two-batch overlap; run the adapters on a "
                "runner without two_batch_overlap"
            )
        exact = pack_two_batches(sequences, self.topology)
        if not bucketed:
            return exact
        tp = self.topology.attn_tp
        return pack_two_batches(
            sequences,
            self.topology,
            rows_per_half=bucket(max(exact.rows_per_rank // 2, MIN_ROWS // 2), tp),
            slots_per_half=bucket(exact.decode_rows_per_rank // 2, tp),
        )

    def place_array(self, values: np.ndarray | jax.Array, *, rows: bool = True) -> jax.Array:
        """An array placed on the mesh: split over attention DP along axis 0, or replicated."""
        spec = PartitionSpec(*self._rows) if rows else PartitionSpec()
        return jax.device_put(values, NamedSharding(self.mesh, spec))

    def place(self, packed: PackedBatch) -> tuple[TokenRows, bj.BatchFacts]:
        """The packed rows and their batch facts, placed on the mesh (under two-batch overlap,
        a pair: each microbatch's)."""
        rows = jax.device_put(packed.rows, NamedSharding(self.mesh, self._rows))
        if self.two_batch_overlap:
            place = lambda counts: self.place_array(counts, rows=False)  # noqa: E731
            return rows, microbatch_facts(packed, self._variant, self.topology, place)
        return rows, self.place_batch(packed.token_counts)

    def place_batch(self, token_counts: np.ndarray) -> bj.BatchFacts:
        """Placed batch facts of this runner's variant: [attn_dp] real rows per DP rank."""
        return self.batch_facts(self.place_array(np.asarray(token_counts, np.int32), rows=False))

    def batch_facts(self, token_counts: jax.Array) -> bj.BatchFacts:
        """Batch facts of this runner's variant over counts already placed (replicated)."""
        return bj.BatchFacts(self._variant, self.topology, token_counts)

    def new_caches(self, slots_per_rank: int, max_len: int) -> tuple[KVCache, ...]:
        """Zero decode caches of `slots_per_rank` slots per DP rank, sharded, as the model
        lays them out (`CausalLM.new_caches`): one KV cache per block of the model's layers
        (`DecoderConfig.layer_blocks`), a scanned run's stacked on a leading layer axis; a
        hybrid stack's per layer (a Mamba2 layer's conv and SSM state, none for an FFN).
        Under two-batch overlap, a pair: each microbatch's caches of half the slots."""
        parts = 2 if self.two_batch_overlap else 1
        caches = tuple(
            self.model.new_caches(
                slots=slots_per_rank // parts * self.topology.attn_dp,
                max_len=max_len,
                dtype=self.dtype,
                mesh=self.mesh,
            )
            for _ in range(parts)
        )
        return caches if self.two_batch_overlap else caches[0]

    # -- forward --------------------------------------------------------------------------

    def forward_rows(self, packed: PackedBatch) -> jax.Array:
        """[attn_dp * rows_per_rank, vocab] logits of packed rows (attention within the batch)."""
        return self._forward(self._leaves, *self.place(packed))

    def forward_placed(self, rows: TokenRows, batch: bj.BatchFacts) -> jax.Array:
        """`forward_rows` on rows already placed by `place`."""
        return self._forward(self._leaves, rows, batch)

    def forward(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        adapters: Sequence[str | int | None] | None = None,
    ) -> np.ndarray:
        """float32 logits [sequences, longest, vocab] of ragged token-id lists, zero past ends
        (each sequence through its LoRA adapter, given `adapters`: as for `pack`)."""
        packed = self.pack(sequences, adapters=adapters)
        return packed.unpack(fetch(self.forward_rows(packed)))

    def lower_forward(self, sequences: Sequence[Sequence[int]]):
        """The lowered (not yet compiled) sharded forward for these sequences' shapes."""
        return self._forward.lower(self._leaves, *self.place(self.pack(sequences)))

    def forward_captured(
        self,
        sequences: Sequence[Sequence[int]],
        capture_layers: Sequence[int],
    ) -> tuple[np.ndarray, np.ndarray]:
        """`forward`, also returning the auxiliary hidden states of `capture_layers` (what
        EAGLE-3 drafting reads), computed in the same program.

        Capture index i < num_layers is the residual stream entering layer i, transformers'
        `output_hidden_states[i]` (0: the embedding output); i = num_layers is the residual the
        final norm reads (transformers' last hidden state is it after the final norm). The
        logits are those `forward` returns: a capture completes the sums the layers owe in the
        same collectives, unfused from the add + norm.

        Args:
          sequences: Ragged token-id lists.
          capture_layers: Capture indices in [0, num_layers], in the order wanted (a model
            built with `scan_layers` captures in its scanned runs).

        Returns:
          (float32 logits [sequences, longest, vocab], hidden states [len(capture_layers),
          sequences, longest, hidden] in the model's dtype; both zero past each sequence's end).
        """
        self._reject_overlap("forward_captured")
        packed = self.pack(sequences)
        program = self._captured_program(tuple(capture_layers))
        logits, hidden = jax.device_get(program(self._leaves, *self.place(packed)))
        return packed.unpack(logits), np.moveaxis(packed.unpack(np.moveaxis(hidden, 0, 1)), 2, 0)

    def lower_forward_captured(
        self,
        sequences: Sequence[Sequence[int]],
        capture_layers: Sequence[int],
    ):
        """The lowered (not yet compiled) `forward_captured` program for these shapes."""
        self._reject_overlap("lower_forward_captured")
        program = self._captured_program(tuple(capture_layers))
        return program.lower(self._leaves, *self.place(self.pack(sequences)))

    def _reject_overlap(self, what: str) -> None:
        if self.two_batch_overlap:
            raise NotImplementedError(
                f"{what} is not built under two-batch overlap; run it on a runner without "
                "two_batch_overlap"
            )

    def _captured_program(self, capture_layers: tuple[int, ...]) -> Callable:
        name = ("captured", capture_layers)
        if name not in self._programs:
            rows = self._rows

            def body(model, rows_, batch):
                hidden, captures = hidden_captured(model, rows_, batch, capture_layers)
                return model.lm_head(hidden).astype(jnp.float32), captures

            self._programs[name] = self.sharded_program(
                body,
                in_specs=(rows, self._batch_spec),
                out_specs=(self._logits_spec, PartitionSpec(None, rows[0], None)),
                check_vma=self.check_vma,
            )
        return self._programs[name]

    # -- serving: prefill and decode on the device ----------------------------------------

    def prefill(
        self,
        rows: TokenRows,
        batch: bj.BatchFacts,
        caches: tuple[KVCache, ...],
        last_rows: jax.Array,
        key: jax.Array,
        *,
        sampling: Sampling = GREEDY,
    ) -> tuple[jax.Array, tuple[KVCache, ...]]:
        """Runs placed PREFILL rows, writes the caches in place (they are donated) and samples.

        Args:
          rows, batch: From `place(packed)`.
          caches: From `new_caches(packed.decode_rows_per_rank, max_len)`.
          last_rows: `place_array(packed.last_row_index())`: per slot, its last row.
          key: A replicated PRNG key (unused when greedy).
          sampling: How the next token is drawn.

        Returns:
          (int32 [attn_dp * slots per rank] next token per slot, in slot order; the caches).
        """
        program = self._program(self._prefill_program, sampling)
        return program(self._leaves, rows, batch, caches, last_rows, key)

    def decode(
        self,
        rows: TokenRows,
        batch: bj.BatchFacts,
        caches: tuple[KVCache, ...],
        key: jax.Array,
        steps: int | jax.Array,
        *,
        capacity: int,
        sampling: Sampling = GREEDY,
        first_step: int | jax.Array = 0,
    ) -> tuple[jax.Array, tuple[KVCache, ...]]:
        """Runs `steps` decode steps in one program; the caches are donated.

        Args:
          rows: DECODE rows, placed: per slot its latest token, that token's position, and its
            slot index (or -1 for an idle slot). See `decode_rows`.
          batch: Placed batch facts of `rows` (sequences per DP rank).
          caches: The caches the prefill filled.
          key: A replicated PRNG key (unused when greedy).
          steps: How many tokens to generate, at most `capacity` (a traced value: any count
            runs the same program).
          capacity: Static size of the returned token buffer.
          sampling: How each token is drawn.
          first_step: The index of this call's first step in the whole decode (a traced
            value): step i draws with `fold_in(key, first_step + i)`, so a decode run in
            several calls samples what one call would.

        Returns:
          (int32 [capacity, attn_dp * slots per rank] tokens, rows past `steps` zero; caches).
        """
        program = self._decode(rows, sampling, capacity)
        steps, first_step = self._step_count(steps), self._step_count(first_step)
        return program(self._leaves, rows, batch, caches, key, steps, first_step)

    def lower_prefill(
        self,
        rows: TokenRows,
        batch: bj.BatchFacts,
        caches: tuple[KVCache, ...],
        last_rows: jax.Array,
        key: jax.Array,
        *,
        sampling: Sampling = GREEDY,
    ):
        """The lowered (not yet compiled) `prefill` program for these placed inputs."""
        program = self._program(self._prefill_program, sampling)
        return program.lower(self._leaves, rows, batch, caches, last_rows, key)

    def lower_decode(
        self,
        rows: TokenRows,
        batch: bj.BatchFacts,
        caches: tuple[KVCache, ...],
        key: jax.Array,
        steps: int | jax.Array,
        *,
        capacity: int,
        sampling: Sampling = GREEDY,
    ):
        """The lowered (not yet compiled) `decode` program for these placed inputs."""
        program = self._decode(rows, sampling, capacity)
        steps, first_step = self._step_count(steps), self._step_count(0)
        return program.lower(self._leaves, rows, batch, caches, key, steps, first_step)

    def compiled_shapes(self) -> dict[tuple, int]:
        """Per program built so far (forward, prefill, decode, captured), how many input shapes
        it has compiled for: what a server watches to see nearby requests share programs."""
        programs = {("forward",): self._forward, **self._programs}
        return {name: program.compiled_shapes() for name, program in programs.items()}

    def _program(self, make: Callable, sampling: Sampling, *args) -> Callable:
        """The program `make(sampling, *args)` builds, built once per runner."""
        name = (make.__name__, sampling, *args)
        if name not in self._programs:
            self._programs[name] = make(sampling, *args)
        return self._programs[name]

    def _decode(self, rows: TokenRows, sampling: Sampling, capacity: int) -> Callable:
        """The decode program for these DECODE rows, one per loop form (`decode_loop`): one
        device multiplies one (attention DP, CP) block of the rows."""
        per_rank = rows.ids.shape[0] // (self.topology.attn_dp * self.topology.attn_cp)
        loop = decode_loop(self._platform, capacity, self.mesh.size, per_rank)
        return self._program(self._decode_program, sampling, capacity, loop)

    def _prefill_program(self, sampling: Sampling) -> Callable:
        rows = self._rows

        def body(model, rows_, batch, caches, last_rows, key):
            tokens, caches = _next_tokens(
                model,
                rows_,
                batch,
                caches,
                last_rows,
                rank_key(key, self.topology),
                sampling,
                tbo=self.two_batch_overlap,
            )
            # Under CP a slot's last row is on one CP rank, and its token goes to all of them.
            held = share_over_cp((last_rows >= 0).astype(jnp.int32), self.topology) > 0
            return jnp.where(held, tokens, 0), caches

        return self.sharded_program(
            body,
            in_specs=(
                rows,
                self._batch_spec,
                self._cache_specs,
                rows,
                PartitionSpec(),
            ),
            out_specs=(rows, self._cache_specs),
            check_vma=self.check_vma,
            donate_argnums=(2,),
        )

    def _decode_program(self, sampling: Sampling, capacity: int, loop: DecodeLoop) -> Callable:
        rows = self._rows

        def body(model, rows_, batch, caches, key, steps, first_step):
            key = rank_key(key, self.topology)
            active = rows_.segment_ids >= 0
            # Built from the rows, so the buffer varies over the same mesh axes as the tokens.
            out = jnp.broadcast_to(rows_.ids * 0, (capacity, *rows_.ids.shape))

            def step(index, carry):
                ids, positions, caches, out = carry
                current = dataclasses.replace(
                    rows_, ids=ids, positions=positions, phase=RowsPhase.DECODE
                )
                step_key = jax.random.fold_in(key, first_step + index)
                tokens, caches = _next_tokens(
                    model,
                    current,
                    batch,
                    caches,
                    None,
                    step_key,
                    sampling,
                    tbo=self.two_batch_overlap,
                )
                tokens = jnp.where(active, tokens, 0)
                out = lax.dynamic_update_index_in_dim(out, tokens, index, axis=0)
                return tokens, positions + 1, caches, out

            carry = (jnp.where(active, rows_.ids, 0), rows_.positions, caches, out)
            count = jnp.minimum(steps, capacity)
            _, _, caches, out = blocked_fori_loop(count, step, carry, loop.block)
            return out, caches

        return self.sharded_program(
            body,
            in_specs=(
                rows,
                self._batch_spec,
                self._cache_specs,
                PartitionSpec(),
                PartitionSpec(),
                PartitionSpec(),
            ),
            out_specs=(PartitionSpec(None, *rows), self._cache_specs),
            check_vma=self.check_vma,
            donate_argnums=(2,),
            compiler_options=loop.compiler_options,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        sampling: Sampling = GREEDY,
        seed: int = 0,
        adapters: Sequence[str | int | None] | None = None,
    ) -> np.ndarray:
        """Continuation of each prompt: int32 [prompts, max_new_tokens] (every step, end-of-
        sequence ids included; `models.generate_ids` stops at them). `adapters` names each
        prompt's LoRA adapter, as for `pack`.

        One prefill fills a static-shape KV cache (its length rounded up to `CACHE_LENGTHS`)
        and samples the first token; one decode program samples the rest on the device. Only
        the token ids come back to the host, once.

        Raises:
          TypeError, ValueError: `check_prompts` or the context refuses the prompts.
        """
        packed, chunks = token_chunks(
            self,
            prompts,
            max_new_tokens,
            sampling=sampling,
            seed=seed,
            chunk=max_new_tokens,
            adapters=adapters,
        )
        tokens = jnp.concatenate(list(chunks))
        return fetch(tokens)[:, packed.slot_order()].T.astype(np.int32)

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
        """`generate`'s tokens as they come: yields int32 [prompts, n] arrays, first the
        prefill's token (n = 1), then `chunk` decode steps at a time (one decode program run
        per chunk); together they equal `generate`'s, sampled ones too. Stop early by
        leaving the loop (`models.generate_ids` stops once every prompt has met an
        end-of-sequence id).
        """
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1 decode step; got {chunk}")
        packed, chunks = token_chunks(
            self,
            prompts,
            max_new_tokens,
            sampling=sampling,
            seed=seed,
            chunk=chunk,
            adapters=adapters,
        )
        order = packed.slot_order()
        for tokens in chunks:
            yield fetch(tokens)[:, order].T.astype(np.int32)
