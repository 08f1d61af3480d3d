"""Two-batch overlap (TBO) of a decoder: the batch packed as two microbatches, each with its own
residual stream, run layer by layer in one program with one microbatch's collectives beside the
other's compute (`boundary_jax.adapters.overlap`).

Each DP rank's block of rows is two halves: microbatch 0's sequences packed from the block's
first row, microbatch 1's from its middle row. Each microbatch has KV caches of its own (half
of each rank's cache slots, numbered from 0 in each), so the microbatches share no state; a
decode block is one row per slot, microbatch 0's slots first.

The phases of one microbatch alternate between communication and compute: the stack entry
(completing the embedding's sum), then per layer the attention, its exit with the FFN's entry,
the FFN, and its exit (`complete_now`: the FFN's sum completes there) with the next entry; the
last is the final read. Microbatch 1 runs one phase behind microbatch 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import boundary_jax as bj
from boundary_jax import residual_stream
from boundary_jax.adapters import complete_now, overlap_phases, split_stream

from ..decoder.model import CausalLM, DecoderLayer, pick_rows
from ..inputs.rows import PackedBatch, TokenRows, pack_sequences
from ..layers.attention.kv_cache import KVCache

MICROBATCHES = 2


def check_two_batch_overlap(model: CausalLM) -> None:
    """Rejects a model two-batch overlap cannot run, naming the fix.

    Raises:
      NotImplementedError: A pipeline stage (part of the layers), context parallelism, a
        scanned run of layers, or a layer that is not an attention + FFN `DecoderLayer` (e.g.
        Nemotron-H's single-stage layers).
    """
    if len(model.layer_range) != model.config.num_layers:
        raise NotImplementedError(
            f"two-batch overlap runs a whole model; this module holds the layers "
            f"{model.layer_range} of {model.config.num_layers} (a pipeline stage). Run the "
            "pipeline without two_batch_overlap (its microbatches already overlap stages)"
        )
    if model.topology.attn_cp > 1:
        raise NotImplementedError(
            f"two-batch overlap splits each rank's rows in halves, and context parallelism lays "
            f"them out in zigzag order; got attn_cp={model.topology.attn_cp}. Use one of them"
        )
    for layers, block in model.blocks():
        if isinstance(block, bj.StackedLayers):
            raise NotImplementedError(
                f"two-batch overlap interleaves the microbatches layer by layer, which a scanned "
                f"run (layers {layers}) does not; build the model without scan_layers"
            )
        if not isinstance(block, DecoderLayer):
            raise NotImplementedError(
                f"two-batch overlap runs attention + FFN decoder layers; layer {layers.start} is "
                f"a {type(block).__name__}. Run {type(model).__name__} without two_batch_overlap"
            )


def hidden_states(
    model: CausalLM,
    rows: TokenRows,
    batch: bj.BatchFacts | tuple[bj.BatchFacts, bj.BatchFacts],
    caches: tuple | None = None,
    last_rows: jax.Array | None = None,
    *,
    tbo: bool,
) -> tuple[jax.Array, tuple | None]:
    """`model.hidden` (the final norm's output and the caches), or under two-batch overlap
    (`batch` a pair of microbatch facts, `caches` a pair) `two_batch_hidden`."""
    if tbo:
        return two_batch_hidden(model, rows, batch, caches, last_rows)
    return model.hidden(rows, batch, caches, last_rows)


def two_batch_hidden(
    model: CausalLM,
    rows: TokenRows,
    batches: tuple[bj.BatchFacts, bj.BatchFacts],
    caches: tuple[tuple[KVCache, ...], tuple[KVCache, ...]] | None = None,
    last_rows: jax.Array | None = None,
) -> tuple[jax.Array, tuple[tuple[KVCache, ...], tuple[KVCache, ...]] | None]:
    """`CausalLM.hidden` of a batch packed as two microbatches, under two-batch overlap.

    Call inside `shard_map`, as `hidden`.

    Args:
      model: The decoder (`check_two_batch_overlap` passes it).
      rows: This DP rank's block: microbatch 0's rows, then microbatch 1's (halves).
      batches: Each microbatch's batch facts (its real rows per DP rank, from its half's first
        row).
      caches: None, or each microbatch's own KV caches (as for `hidden`: one per layer), its
        cache slots numbered from 0 as its rows' segment ids are.
      last_rows: As for `hidden`, row indices within the whole block.

    Returns:
      As `hidden`: the final-norm output [rows or R, hidden], and the caches (a pair).
    """
    check_two_batch_overlap(model)
    layers = [block for _, block in model.blocks()]
    split = split_stream(model.embed(rows.ids), residual_stream.start(batches[0]), batches)
    middle = rows.ids.shape[0] // MICROBATCHES
    halves = (
        jax.tree.map(lambda values: values[:middle], rows),
        jax.tree.map(lambda values: values[middle:], rows),
    )
    own = (None, None) if caches is None else caches
    states = tuple(
        (x, stream, half, cache)
        for (x, stream), half, cache in zip(split, halves, own, strict=True)
    )
    first, second = overlap_phases(_phases(model, layers), states, scope=_scope)
    hidden = jnp.concatenate([first[0], second[0]])
    caches = None if caches is None else (first[1], second[1])
    return pick_rows(hidden, last_rows), caches


def _phases(model: CausalLM, layers: list[DecoderLayer]) -> list:
    """The phases of one microbatch, alternating communication and compute. A state is
    `(value, stream, rows, caches)`: the stack input, compute input or output, or layer output
    handle; the microbatch's stream, rows and caches (or None); the last phase leaves
    `(hidden, caches)`."""

    def enter(state):
        x, stream, rows, caches = state
        h, stream = layers[0].attn_boundary.prepare(x, stream)
        return h, stream, rows, caches

    def attention(index):
        def phase(state):
            h, stream, rows, caches = state
            if caches is None:
                y, _ = layers[index].attend(h, rows, None, stream)
                return y, stream, rows, caches
            y, cache = layers[index].attend(h, rows, caches[index], stream)
            return y, stream, rows, (*caches[:index], cache, *caches[index + 1 :])

        return phase

    def attention_exit(index):
        def phase(state):
            y, stream, rows, caches = state
            layer = layers[index]
            x, stream = layer.attn_boundary.finish(y, stream)
            h, stream = layer.ffn_boundary.prepare(x, stream)
            return h, stream, rows, caches

        return phase

    def ffn(index):
        def phase(state):
            h, stream, rows, caches = state
            return layers[index].ffn_compute(h, stream), stream, rows, caches

        return phase

    def ffn_exit(index):
        def phase(state):
            y, stream, rows, caches = state
            x, stream = complete_now(layers[index].ffn_boundary, y, stream)
            if index + 1 < len(layers):
                h, stream = layers[index + 1].attn_boundary.prepare(x, stream)
                return h, stream, rows, caches
            return model.read_out(x, stream), caches

        return phase

    phases = [enter]
    for index in range(len(layers)):
        phases += [attention(index), attention_exit(index), ffn(index), ffn_exit(index)]
    return phases


PARTS = ("attention", "attention_exit", "ffn", "ffn_exit")
"""The phases of one layer, after the stack entry."""


def _scope(microbatch: int, phase: int) -> str:
    """Names a phase's scope `microbatch_<m>/layer_<i>/<part>` (the stack entry is layer 0's
    `entry`), so a compiled schedule says whose instruction each one is."""
    if phase == 0:
        return f"microbatch_{microbatch}/layer_0/entry"
    layer, part = divmod(phase - 1, len(PARTS))
    return f"microbatch_{microbatch}/layer_{layer}/{PARTS[part]}"


def split_sequences(sequences: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The sequence indices of each microbatch, their token counts balanced (longest first, each
    to the microbatch with fewer tokens so far).

    Raises:
      ValueError: Fewer than two sequences (two-batch overlap splits whole sequences).
    """
    if len(sequences) < MICROBATCHES:
        raise ValueError(
            f"two-batch overlap splits a batch's sequences into two microbatches; got "
            f"{len(sequences)} sequence(s). Run a single sequence without two_batch_overlap"
        )
    load, members = [0, 0], [[], []]
    for index in sorted(range(len(sequences)), key=lambda i: (-len(sequences[i]), i)):
        side = min(range(MICROBATCHES), key=lambda m: (load[m], len(members[m]), m))
        members[side].append(index)
        load[side] += len(sequences[index])
    return tuple(tuple(sorted(m)) for m in members)


def pack_two_batches(
    sequences: Sequence[Sequence[int]],
    topology: bj.Topology,
    *,
    rows_per_half: int | None = None,
    slots_per_half: int | None = None,
) -> PackedBatch:
    """Packs sequences as two microbatches (`split_sequences`), each onto the DP ranks as
    `pack_sequences` does, one after the other in each rank's block.

    Each rank's block is `2 * rows_per_half` rows: microbatch 0's packed rows, then microbatch
    1's, each numbering its cache slots (segment ids) from 0 in its own caches; its decode
    block is `2 * slots_per_half` rows, microbatch 1's slots after microbatch 0's (`slot`
    counts them so). `microbatch_counts` holds each microbatch's real rows per rank,
    `token_counts` their sum. `rank`, `slot` and `start` index the whole block, so `unpack`,
    `last_row_index` and `slot_order` read it as any packed batch.

    Raises:
      ValueError: Fewer than two sequences, or `rows_per_half` / `slots_per_half` too small or
        not a multiple of attention TP.
      NotImplementedError: Context parallelism.
    """
    if topology.attn_cp > 1:
        raise NotImplementedError(
            f"two-batch overlap is not built with context parallelism; got "
            f"attn_cp={topology.attn_cp}"
        )
    groups = split_sequences(sequences)
    exact = [pack_sequences([sequences[i] for i in group], topology) for group in groups]
    rows = rows_per_half or max(p.rows_per_rank for p in exact)
    slots = slots_per_half or max(p.decode_rows_per_rank for p in exact)
    packs = [
        pack_sequences(
            [sequences[i] for i in group], topology, rows_per_rank=rows, slots_per_rank=slots
        )
        for group in groups
    ]
    dp = topology.attn_dp
    blocks = []
    for values in ("ids", "positions", "segment_ids"):
        halves = [np.asarray(getattr(p.rows, values)).reshape(dp, rows) for p in packs]
        blocks.append(np.concatenate(halves, axis=1).reshape(-1))
    rank, slot, start = [0] * len(sequences), [0] * len(sequences), [0] * len(sequences)
    for side, (group, packed) in enumerate(zip(groups, packs, strict=True)):
        for j, index in enumerate(group):
            rank[index] = packed.rank[j]
            slot[index] = packed.slot[j] + side * slots
            start[index] = packed.start[j] + side * rows
    counts = np.stack([p.token_counts for p in packs])
    return PackedBatch(
        rows=TokenRows(*blocks),
        token_counts=counts.sum(axis=0).astype(np.int32),
        rank=tuple(rank),
        slot=tuple(slot),
        start=tuple(start),
        lengths=tuple(len(s) for s in sequences),
        rows_per_rank=2 * rows,
        slots_per_rank=max(p.slots_per_rank for p in packs),
        decode_rows_per_rank=2 * slots,
        microbatch_counts=counts,
    )


def microbatch_facts(
    packed: PackedBatch, variant: bj.BatchVariant, topology: bj.Topology, place
) -> tuple[bj.BatchFacts, bj.BatchFacts]:
    """Each microbatch's batch facts of a two-batch packing, its counts placed by `place`.

    Raises:
      ValueError: `packed` is not a two-batch packing (`pack_two_batches`).
    """
    if packed.microbatch_counts is None:
        raise ValueError(
            "two-batch overlap runs batches packed as two microbatches; pack them with "
            "pack_two_batches (the runner's pack())"
        )
    return tuple(
        bj.BatchFacts(variant, topology, place(np.asarray(counts, np.int32)))
        for counts in packed.microbatch_counts
    )
