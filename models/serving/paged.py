"""The device side of continuous batching: a paged KV cache on the mesh and one jitted step
that runs prefill chunks and decode tokens of many sequences together.

A step's rows are `RowsPhase.EXTEND` rows: per attention-DP rank a block of `rows` rows holding
chunks of the sequences that rank serves (a chunk of a prompt, or one decode token), packed from
row 0 with the rest padding, and the batch facts count the real rows per rank, as the
boundaries take any packed rows. Each sequence has a slot on its DP rank; the page table maps
its positions to pages of the rank's pool (`models.layers.attention.paged`). A slot whose chunk
ends where a token is due (the prompt's last chunk, or a decode token) samples its next token
from that row with its own sampling parameters; the others sample nothing. Only the tokens
(and their log-probabilities) come back to the host.

The step compiles once per (rows per rank, pages per sequence) bucket: both are rounded up to
powers of two (`bucket`, from `min_rows` and `min_pages` up), the slots and the pool are fixed at
construction; `warm_up` compiles every bucket a load can reach with one synthetic step each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from ..distributed import fetch
from ..inputs.rows import RowsPhase, TokenRows
from ..layers.attention.kv_cache import KVCache
from ..layers.attention.paged import kernel_takes, page_table_spec
from ..layers.attention.self_attention import AttentionImpl
from .buckets import bucket
from .runtime import ShardedCausalLM
from .sampling import (
    MAX_LOGIT_BIAS,
    hold_stops,
    penalize,
    record_rows,
    sample_rows,
    slot_entries,
    token_logprobs,
    write_slot,
)
from .step_caches import PAGED_FORMS, SLOT_STATES, cache_parts, cache_pools, step_cache

MIN_STEP_ROWS = 16
"""The smallest block of step rows per DP rank."""
SLOT_PARAMS = {
    "temperature": np.float32,
    "top_k": np.int32,
    "top_p": np.float32,
    "seed": np.uint32,
    "counter": np.int32,
    "min_p": np.float32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "repetition_penalty": np.float32,
    "min_tokens": np.int32,
    "prompt_length": np.int32,
}
"""What a step reads per sequence slot, in order, and its dtype: the sampling parameters of a
slot that draws (`SlotSampling`, and the index of the position drawn), the prompt length of
every slot that runs rows."""


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Tokens of one sequence that a step runs: `tokens` at positions `start`, `start + 1`, ...
    of the sequence in slot `slot` of DP rank `rank`; `sample`: its last row draws the
    sequence's next token; `previous`: its last token is the one the previous step drew for
    this slot, read on the device (its entry in `tokens` is a placeholder); `key`: the
    caller's name for the sequence; `adapter`: the LoRA adapter index its rows run through (0:
    none); `prompt_length`: its sequence's prompt length (rows from that position on are
    generated tokens, which the penalties count); `first`: the first chunk of its sequence in
    this slot, which writes the slot's logit bias (its `SlotSampling.logit_bias`) and the stop
    ids it holds back until its `min_tokens`, `held_stops` (a first chunk's)."""

    rank: int
    slot: int
    tokens: tuple[int, ...]
    start: int
    sample: bool
    key: int = -1
    previous: bool = False
    adapter: int = 0
    prompt_length: int = 0
    first: bool = False
    held_stops: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class SlotSampling:
    """One sequence's sampling parameters on the device: temperature 0 (or under
    `sampling.GREEDY_BELOW`) is greedy; top_k 0, top_p 1 and min_p 0 keep every token; the seed
    and the index of the token drawn key the draw. A logit bias ((token id, bias) pairs, at
    most `MAX_LOGIT_BIAS`) is added to the logits, then the penalties (`sampling.penalize`;
    neutral at 0, 0 and 1) apply, then the sequence's stop ids are held back until it has
    `min_tokens` tokens, before the draw, greedy or not."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    def __post_init__(self):
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"a logit bias holds at most {MAX_LOGIT_BIAS} tokens; got {len(self.logit_bias)}"
            )

    @property
    def adjusts(self) -> bool:
        """Whether anything changes the model's logits before the draw (a step runs its token
        histories, biases and held stops only where some sequence's does)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the sequence's token history (so every token of it must run
        as a row: no cached prefix)."""
        penalties = (self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        return penalties != (0.0, 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What a step drew, per (DP rank, slot): arrays [attn_dp, slots] (the ids and
    log-probabilities of the most likely tokens [attn_dp, slots, TOP_LOGPROBS]); only the
    slots of chunks with `sample` hold a draw."""

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclasses.dataclass(frozen=True)
class Launched:
    """A step dispatched to the device, not waited for: its chunks and its outputs as device
    arrays (`tokens` slot-ordered, what the next step's `Chunk.previous` rows read)."""

    chunks: tuple[Chunk, ...]
    tokens: jax.Array
    outputs: tuple[jax.Array, ...]
    shape: tuple[int, int]

    def fetch(self) -> StepOutput:
        """Waits for the step and copies what it drew to the host."""
        dp, slots = self.shape
        tokens, logprobs, top_ids, top_logprobs = (fetch(x) for x in self.outputs)
        return StepOutput(
            tokens.reshape(dp, slots),
            logprobs.reshape(dp, slots),
            top_ids.reshape(dp, slots, -1),
            top_logprobs.reshape(dp, slots, -1),
        )


class PagedRunner:
    """A `ShardedCausalLM` serving many sequences from a paged KV cache, one step at a time.

    Attributes:
      runner: The sharded model.
      page_size: Positions per page.
      pages_per_rank: Pages in each DP rank's pool (every layer has its own pool of this many).
      slots_per_rank: Sequences each DP rank holds at once.
      max_rows: The most step rows per DP rank (the token budget of a step on one rank).
      min_rows: The smallest rows bucket (fewer buckets, so fewer programs to compile, for
        more padding rows in small steps).
      min_pages: The smallest pages bucket (likewise: fewer programs, for more pages read by
        the steps of short sequences; where every layer reads its pages in place,
        `reads_pages_in_place`, a wide table costs nothing and the default is one bucket as
        wide as the longest context).
      pages_per_sequence: Page-table width: pages of the longest context.
      tables: int32 [attn_dp, slots, pages_per_sequence] host page tables, which the caller (the
        scheduler) fills; each step places the part its sequences reach.
    """

    def __init__(
        self,
        runner: ShardedCausalLM,
        *,
        page_size: int,
        pages_per_rank: int,
        slots_per_rank: int,
        max_rows: int,
        min_rows: int = MIN_STEP_ROWS,
        min_pages: int | None = None,
    ):
        topology = runner.topology
        specs = runner.model.cache_specs()
        unknown = sorted(
            {type(spec).__name__ for spec in specs if spec is not None and not cache_parts(spec)}
            - {kind.__name__ for kind in (*PAGED_FORMS, *SLOT_STATES)}
        )
        if unknown:
            raise NotImplementedError(
                "the paged step holds attention keys and values, MLA latents and recurrent "
                f"states (Mamba2, the delta rule); this model's layers also cache {unknown}: "
                "serve it with generate, or "
                "add the paged form of its cache"
            )
        if runner.two_batch_overlap or runner.input_scattered:
            raise NotImplementedError(
                "the paged step runs one ordinary batch; build the runner without "
                "two_batch_overlap and input_scattered"
            )
        if topology.attn_cp > 1 or topology.pp > 1:
            raise NotImplementedError(
                f"the paged step is not built under attention CP or pipeline stages; got "
                f"{topology}. Serve on a mesh of attention DP x TP (and MoE axes)"
            )
        least_pages = 1 if min_pages is None else min_pages
        sizes = (page_size, pages_per_rank, slots_per_rank, max_rows, min_rows, least_pages)
        if min(sizes) < 1:
            raise ValueError(
                "page_size, pages_per_rank, slots_per_rank, max_rows, min_rows and min_pages "
                f"must be >= 1; got {page_size=}, {pages_per_rank=}, {slots_per_rank=}, "
                f"{max_rows=}, {min_rows=}, {min_pages=}"
            )
        self.runner = runner
        self.page_size = page_size
        self.pages_per_rank = pages_per_rank
        tp = topology.attn_tp
        self.slots_per_rank = bucket(slots_per_rank, tp)
        self.max_rows = bucket(max(max_rows, MIN_STEP_ROWS), tp)
        self.min_rows = min(bucket(max(min_rows, MIN_STEP_ROWS), tp), self.max_rows)
        limit = runner.config.max_position_embeddings
        self.pages_per_sequence = -(-limit // page_size)
        dp = topology.attn_dp
        self.tables = np.zeros((dp, self.slots_per_rank, self.pages_per_sequence), np.int32)
        self._blocks = runner.config.layer_blocks(runner.options.scan_layers)
        self._specs = specs
        self._shapes = jax.eval_shape(
            lambda: runner.model.new_caches(slots=dp, max_len=page_size, dtype=runner.dtype)
        )
        wide = self.pages_per_sequence if self.reads_pages_in_place() else 1
        self.min_pages = wide if min_pages is None else min_pages
        self._pools = self._history = self._written = ()
        self.reset()
        self._write_slot = jax.jit(write_slot, donate_argnums=(0, 1))
        self._no_draw = runner.place_array(np.zeros(dp * self.slots_per_rank, np.int32))
        self._programs: dict[int, Callable] = {}

    @property
    def attn_dp(self) -> int:
        return self.runner.topology.attn_dp

    @property
    def reuses_prefixes(self) -> bool:
        """Whether cached pages alone hold a prefix (no layer keeps a recurrent state, which
        pages cannot restore): the scheduler's prefix reuse is on only then."""
        return not any(isinstance(spec, SLOT_STATES) for spec in self._specs)

    def reads_pages_in_place(self) -> bool:
        """Whether every paged layer reads its pages where they lie: grouped-query keys and
        values on the GPU's paged attention kernel (`kernel_takes`), not gathered per row as the
        `jnp` form and the MLA latents are."""
        if self.runner.options.attention is not AttentionImpl.CUDNN:
            return False
        for spec, shape in zip(self._specs, self._shapes, strict=True):
            if spec is None or isinstance(spec, SLOT_STATES):
                continue
            if not isinstance(spec, KVCache):
                return False
            if not kernel_takes(self.page_size, shape.k.shape[-1], self.runner.dtype):
                return False
        return True

    def _new_pools(self) -> tuple[tuple[jax.Array, ...], ...]:
        """Zero pools per block of layers, each array of the block's slot-indexed cache
        (`CausalLM.new_caches`) placed as that cache is: with pages in place of slots and a page
        in place of a sequence for keys, values and latents; a recurrent state as it is, one
        slot per sequence slot."""
        runner = self.runner
        pools = []
        for block, spec, shape in zip(self._blocks, self._specs, self._shapes, strict=True):
            lead = 1 if block.scanned else 0
            count = self.slots_per_rank if isinstance(spec, SLOT_STATES) else self.pages_per_rank
            arrays = []
            for leaf, leaf_spec in zip(
                jax.tree_util.tree_leaves(shape), jax.tree_util.tree_leaves(spec), strict=True
            ):
                dims = list(leaf.shape)
                dims[lead] = count * self.attn_dp
                placed = NamedSharding(runner.mesh, leaf_spec)
                arrays.append(jnp.zeros(dims, leaf.dtype, device=placed))
            pools.append(tuple(arrays))
        return tuple(pools)

    def _per_slot(self, dtype: Any) -> jax.Array:
        """Zeros [attn_dp * slots, vocab] of `dtype`, slots over attention DP: a token history
        part (`sampling.record_rows`), or what a sequence's first chunk writes, its logit bias
        and held stop ids (`sampling.write_slot`)."""
        runner = self.runner
        shape = (self.attn_dp * self.slots_per_rank, runner.config.vocab_size)
        placed = NamedSharding(runner.mesh, PartitionSpec(runner.row_spec[0], None))
        return jnp.zeros(shape, dtype, device=placed)

    def reset(self) -> None:
        """Fresh zero pools, token histories, logit biases and held stops (after a step that
        failed may have consumed the donated ones)."""
        self._pools = self._history = self._written = ()
        self._pools = self._new_pools()
        self._history = (self._per_slot(jnp.int32), self._per_slot(bool))
        self._written = (self._per_slot(jnp.float32), self._per_slot(bool))

    def cache_bytes(self) -> tuple[int, int]:
        """Bytes of the page pools and of the recurrent states, summed over the devices: each
        device's shard counts, so a pool every attention-TP rank keeps whole (a latent cache)
        counts once per rank."""
        held = [0, 0]
        for spec, pool in zip(self._specs, self._pools, strict=True):
            for x in pool:
                shard = np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)
                held[isinstance(spec, SLOT_STATES)] += (
                    int(shard) * x.dtype.itemsize * len(x.sharding.device_set)
                )
        return held[0], held[1]

    def slot_bytes(self) -> int:
        """Bytes of the per-slot sampling state on each device: the token histories, logit
        biases and held stops of its DP rank's slots (`sampling.record_rows`, `write_slot`)."""
        arrays = (*self._history, *self._written)
        return sum(x.nbytes for x in arrays) // self.attn_dp

    def step(
        self, chunks: Sequence[Chunk], sampling: dict[tuple[int, int], SlotSampling]
    ) -> StepOutput:
        """`launch` without a previous step, waited for (`Launched.fetch`)."""
        return self.launch(chunks, sampling).fetch()

    def launch(
        self,
        chunks: Sequence[Chunk],
        sampling: dict[tuple[int, int], SlotSampling],
        previous: Launched | None = None,
    ) -> Launched:
        """Dispatches `chunks` (at most one per slot, at most `max_rows` tokens per DP rank)
        as one step and returns without waiting: it writes their keys and values into the pages
        `tables` names and draws a token for each chunk with `sample`, with the parameters
        `sampling[rank, slot]` (greedy where absent) and counter `start + len(tokens)` (the
        index of the position drawn). A chunk with `previous` reads its last token from what
        `previous` (the step launched before, still running or not) drew for its slot.

        Raises:
          ValueError: A rank's chunks exceed `max_rows`, two chunks share a slot, or a chunk
            reads a previous step that is not given.
        """
        dp, slots = self.attn_dp, self.slots_per_rank
        used = np.zeros(dp, np.int64)
        for chunk in chunks:
            used[chunk.rank] += len(chunk.tokens)
        if used.max(initial=0) > self.max_rows:
            raise ValueError(f"a step holds at most {self.max_rows} rows per rank; got {used}")
        if len({(c.rank, c.slot) for c in chunks}) != len(chunks):
            raise ValueError("a step runs at most one chunk per slot")
        if previous is None and any(c.previous for c in chunks):
            raise ValueError("a chunk reads the previous step's draw; pass that step")
        reach = max((c.start + len(c.tokens) for c in chunks), default=1)
        rows, pages = self.step_bucket(int(used.max(initial=1)), reach)
        ids = np.zeros((dp, rows), np.int32)
        positions = np.zeros((dp, rows), np.int32)
        segments = np.full((dp, rows), -1, np.int32)
        from_previous = np.full((dp, rows), -1, np.int32)
        adapters = np.zeros((dp, rows), np.int32)
        last = np.full((dp, slots), -1, np.int32)
        params = np.zeros((len(SLOT_PARAMS), dp, slots), np.float64)
        names = list(SLOT_PARAMS)
        params[names.index("top_p")] = params[names.index("repetition_penalty")] = 1.0
        filled = np.zeros(dp, np.int64)
        adjusts = False
        for chunk in chunks:
            draw = sampling.get((chunk.rank, chunk.slot), SlotSampling())
            adjusts |= draw.adjusts
            if chunk.first:
                self._written = self._write_slot(
                    *self._written,
                    chunk.rank * slots + chunk.slot,
                    *slot_entries(draw.logit_bias, chunk.held_stops),
                )
            count, at = len(chunk.tokens), int(filled[chunk.rank])
            where = (chunk.rank, slice(at, at + count))
            ids[where] = chunk.tokens
            positions[where] = np.arange(chunk.start, chunk.start + count)
            segments[where] = chunk.slot
            adapters[where] = chunk.adapter
            if chunk.previous:
                from_previous[chunk.rank, at + count - 1] = chunk.slot
            filled[chunk.rank] += count
            params[-1, chunk.rank, chunk.slot] = chunk.prompt_length
            if chunk.sample:
                last[chunk.rank, chunk.slot] = at + count - 1
                params[:-1, chunk.rank, chunk.slot] = (
                    draw.temperature,
                    draw.top_k,
                    draw.top_p,
                    draw.seed,
                    chunk.start + count,
                    draw.min_p,
                    draw.presence_penalty,
                    draw.frequency_penalty,
                    draw.repetition_penalty,
                    draw.min_tokens,
                )
        runner = self.runner
        host = (
            ids.reshape(-1),
            positions.reshape(-1),
            segments.reshape(-1),
            from_previous.reshape(-1),
            adapters.reshape(-1),
            np.asarray([*filled, adjusts], np.int32),
            self.tables[:, :, :pages].reshape(dp * slots, pages).copy(),
            last.reshape(-1),
            *(
                values.reshape(-1).astype(dtype)
                for values, dtype in zip(params, SLOT_PARAMS.values(), strict=True)
            ),
        )
        mesh, rows_spec = runner.mesh, runner.row_spec
        specs = (
            *(rows_spec,) * 5,
            PartitionSpec(),
            page_table_spec(runner.topology),
            *(PartitionSpec(rows_spec[0]),) * (1 + len(SLOT_PARAMS)),
        )
        # One transfer for the step's host arrays.
        placed = jax.device_put(host, tuple(NamedSharding(mesh, spec) for spec in specs))
        ids_, positions_, segments_, from_previous_, adapters_, facts, table, last_, *per_slot = (
            placed
        )
        lora = adapters_ if runner.options.lora is not None else None
        drawn = self._no_draw if previous is None else previous.tokens
        program = self._program(rows)
        outputs, self._pools, self._history = program(
            runner.leaves,
            TokenRows(ids_, positions_, segments_, RowsPhase.EXTEND, adapters=lora),
            from_previous_,
            drawn,
            runner.batch_facts(facts[:dp]),
            facts[dp],
            self._pools,
            self._history,
            self._written,
            table,
            last_,
            *per_slot,
        )
        return Launched(tuple(chunks), outputs[0], outputs, (dp, slots))

    def step_bucket(self, rows: int, reach: int) -> tuple[int, int]:
        """The (rows per rank, pages per sequence) bucket of a step whose busiest rank runs
        `rows` rows and whose furthest sequence reaches `reach` positions."""
        rows = bucket(max(rows, self.min_rows), self.runner.topology.attn_tp)
        pages = bucket(max(-(-reach // self.page_size), self.min_pages))
        return rows, min(pages, self.pages_per_sequence)

    def step_buckets(self, reach: int) -> list[tuple[int, int]]:
        """Every step bucket of sequences reaching at most `reach` positions."""
        rows_buckets = sorted({self.step_bucket(r, 1)[0] for r in range(1, self.max_rows + 1)})
        pages_buckets = sorted(
            {
                self.step_bucket(1, count * self.page_size)[1]
                for count in range(1, -(-reach // self.page_size) + 1)
            }
        )
        return [(rows, pages) for rows in rows_buckets for pages in pages_buckets]

    def warm_up(self, reach: int, between: Callable[[], None] | None = None) -> int:
        """Compiles the step of every bucket that sequences reaching at most `reach` positions
        can take (`step_buckets`), running one synthetic step each, then starts from fresh
        pools. Call it with no sequence in flight; the page tables are left as they were.

        Args:
          reach: The longest sequence the load can hold.
          between: Called after each bucket (e.g. to stop on a signal a compile held back);
            what it raises ends the warm-up, the tables and pools restored.

        Returns:
          The number of buckets run.
        """
        tables = self.tables.copy()
        # Distinct pages per slot where the pool has them; what the synthetic rows write is
        # dropped with the pools at the end.
        spread = np.arange(self.slots_per_rank * self.pages_per_sequence) % self.pages_per_rank
        self.tables[:] = spread.reshape(self.tables.shape[1:]).astype(np.int32)
        shapes = self.step_buckets(reach)
        try:
            for rows, pages in shapes:
                span = pages * self.page_size
                chunks, slot, left = [], 0, rows
                while left and slot < self.slots_per_rank:
                    count = min(left, span)
                    chunks.append(Chunk(0, slot, (0,) * count, span - count, False, first=True))
                    slot, left = slot + 1, left - count
                self.step(chunks, {})
                if between is not None:
                    between()
        finally:
            self.tables[:] = tables
            self.reset()
        return len(shapes)

    def compiled_shapes(self) -> int:
        """Step programs compiled so far (one per rows bucket, per pages bucket)."""
        return sum(program.compiled_shapes() for program in self._programs.values())

    def _program(self, rows: int) -> Callable:
        if rows not in self._programs:
            self._programs[rows] = self._build()
        return self._programs[rows]

    def _build(self) -> Callable:
        runner = self.runner
        row_spec = runner.row_spec
        blocks = self._blocks
        specs = self._specs
        pool_specs = tuple(tuple(jax.tree_util.tree_leaves(spec)) for spec in self._specs)

        def body(
            model,
            rows,
            from_previous,
            drawn,
            batch,
            adjusts,
            pools,
            history,
            written,
            table,
            last,
            *slot,
        ):
            # The rows whose token the previous step drew read it here, on the device.
            taken = drawn[jnp.maximum(from_previous, 0)]
            ids = jnp.where(from_previous >= 0, taken, rows.ids)
            rows = TokenRows(
                ids, rows.positions, rows.segment_ids, rows.phase, adapters=rows.adapters
            )
            caches = []
            for block, spec, pool in zip(blocks, specs, pools, strict=True):
                caches.append(step_cache(spec, pool, table, block.scanned))
            hidden, caches = model.hidden(rows, batch, tuple(caches), last)
            logits = model.lm_head(hidden).astype(jnp.float32)
            temperature, top_k, top_p, seeds, counters, min_p, *penalties, held = slot[:-1]

            def adjusted(logits, counts, prompted):
                counts, prompted = record_rows(
                    counts, prompted, ids, rows.positions, rows.segment_ids, slot[-1]
                )
                bias, stops = written
                scored = penalize(logits + bias, counts, prompted, *penalties)
                scored = hold_stops(scored, stops, counters, slot[-1], held)
                return scored, counts, prompted

            # A step where no sequence has a penalty, a bias or held stops skips them (and
            # records no history: a penalized sequence's rows always run with it).
            scored, *history = lax.cond(
                adjusts > 0, adjusted, lambda *unchanged: unchanged, logits, *history
            )
            tokens = sample_rows(scored, temperature, top_k, top_p, seeds, counters, min_p)
            tokens = jnp.where(last >= 0, tokens, 0)
            chosen, top_ids, top = token_logprobs(logits, tokens)
            pools = tuple(cache_pools(c) for c in caches)
            return (tokens, chosen, top_ids, top), pools, tuple(history)

        slot_spec = PartitionSpec(row_spec[0])
        top_spec = PartitionSpec(row_spec[0], None)
        history_specs = (top_spec, top_spec)
        return runner.sharded_program(
            body,
            in_specs=(
                row_spec,
                row_spec,
                slot_spec,
                PartitionSpec(),
                PartitionSpec(),
                pool_specs,
                history_specs,
                history_specs,
                page_table_spec(runner.topology),
                *(slot_spec,) * (1 + len(SLOT_PARAMS)),
            ),
            out_specs=((slot_spec, slot_spec, top_spec, top_spec), pool_specs, history_specs),
            check_vma=runner.check_vma,
            donate_argnums=(5, 6),
        )
