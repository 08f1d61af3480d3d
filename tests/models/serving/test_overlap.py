"""Two-batch overlap (TBO): the batch as two microbatches, each with its own stream, equals one
batch (forward logits, greedy tokens through prefill and decode) on TP 2, TP 4 and attention
DP 2 x TP 2; the compiled schedule interleaves them, one microbatch's collectives beside the
other's matmuls; the packing and the adapters' misuse errors."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import boundary_jax as bj
from boundary_jax import residual_stream
from boundary_jax.adapters import complete_now, merge_streams, split_stream, yield_point
from models.build import build_model
from models.config import PRESETS
from models.inputs.rows import decode_rows
from models.options import BuildOptions
from models.serving.overlap import PARTS, pack_two_batches, split_sequences
from models.serving.runtime import ShardedCausalLM

CONFIG = dataclasses.replace(
    PRESETS["tiny-qwen3"], num_layers=2, initializer_range=0.5, tie_word_embeddings=False
)
"""Two layers; weights large enough that greedy decoding does not repeat one token."""
LENGTHS = (13, 3, 22, 7, 5)
PARALLEL = [
    pytest.param(1, 2, marks=pytest.mark.slow),
    pytest.param(1, 4, marks=pytest.mark.slow),
    (2, 2),
]
"""(attn_dp, attn_tp) meshes; TP 2 and TP 4 (DP 2 x TP 2's path on one DP rank) under -m slow."""
TOL = 1e-5


def prompts(config=CONFIG) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, config.vocab_size, n).tolist() for n in LENGTHS]


@functools.cache
def runner(dp: int, tp: int, tbo: bool, name: str = "", scattered: bool = False) -> ShardedCausalLM:
    config = PRESETS[name] if name else CONFIG
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    return ShardedCausalLM(
        build_model(config, topology, BuildOptions(two_batch_overlap=tbo)),
        bj.make_mesh(topology),
        input_scattered=scattered,
    )


@functools.cache
def logits(dp: int, tp: int, tbo: bool, name: str = "", scattered: bool = False) -> np.ndarray:
    config = PRESETS[name] if name else CONFIG
    return runner(dp, tp, tbo, name, scattered).forward(prompts(config))


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize(
    ("dp", "tp", "scattered"),
    [
        pytest.param(1, 2, False, marks=pytest.mark.slow),
        pytest.param(1, 4, False, marks=pytest.mark.slow),
        (2, 2, False),
        (1, 2, True),
    ],
)
def test_two_batch_overlap_logits_equal_one_batch(dp, tp, scattered):
    """Every row's logits under TBO (each microbatch input-scattered where asked) equal the
    one-batch forward (one device's: the same up to float32 rounding on every mesh)."""
    assert relative(logits(dp, tp, True, scattered=scattered), logits(1, 1, False)) <= TOL


@pytest.mark.slow
def test_two_batch_overlap_of_a_moe_family_equals_one_batch():
    """A Qwen3-MoE (sparse and dense layers) under TBO on TP 2 equals one batch."""
    name = "tiny-qwen3-moe"
    assert relative(logits(1, 2, True, name), logits(1, 2, False, name)) <= TOL


@functools.cache
def one_batch_tokens() -> np.ndarray:
    tokens = runner(1, 1, False).generate(prompts(), 4)
    assert len({tuple(row) for row in tokens}) == len(LENGTHS)
    return tokens


@pytest.mark.parametrize(("dp", "tp"), PARALLEL)
def test_two_batch_overlap_generates_one_batchs_tokens(dp, tp):
    """Greedy tokens through a TBO prefill and TBO decode steps (each microbatch in its half
    of the cache slots) equal one batch's."""
    np.testing.assert_array_equal(runner(dp, tp, True).generate(prompts(), 4), one_batch_tokens())


# -- the compiled schedule --------------------------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%\S+ = .*? (?P<op>[a-z-]+)\(")
_SCOPE = re.compile(r"microbatch_(\d)/layer_(\d+)/(\w+)")


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One instruction of the entry computation, in schedule order.

    Attributes:
      op: The HLO opcode.
      kind: "collective" (its start, for an async pair), "done" (an async pair's end),
        "matmul" (a dot or a fusion holding one) or "other".
      microbatch: Whose phase traced it; None outside the phases.
      step: The TBO step it belongs to: its phase, plus one for microbatch 1.
      scope: "layer_<i>/<part>".
    """

    op: str
    kind: str
    microbatch: int | None
    step: int | None
    scope: str


def schedule(text: str) -> list[Scheduled]:
    """The entry computation's instructions of compiled HLO text, in their scheduled order."""
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}\n")]
    found = []
    for line in entry.splitlines()[1:]:
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        op = match["op"]
        name = re.search(r'op_name="([^"]*)"', line)
        name = name[1] if name else ""
        kind = "other"
        if op.removesuffix("-start") in COLLECTIVES:
            kind = "collective"
        elif op.endswith("-done"):
            kind = "done"
        elif "dot_general" in name:
            kind = "matmul"
        scopes = set(_SCOPE.findall(name))
        assert len(scopes) <= 1, f"one instruction of several phases: {line.strip()}"
        if not scopes:
            found.append(Scheduled(op, kind, None, None, ""))
            continue
        ((microbatch, layer, part),) = scopes
        phase = 0 if part == "entry" else 1 + len(PARTS) * int(layer) + PARTS.index(part)
        found.append(
            Scheduled(op, kind, int(microbatch), phase + int(microbatch), f"layer_{layer}/{part}")
        )
    return found


@functools.cache
def tbo_schedule(dp: int, tp: int) -> list[Scheduled]:
    compiled = runner(dp, tp, True).lower_forward(prompts()).compile()
    return schedule(compiled.as_text())


@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (2, 2)])
def test_each_microbatchs_collectives_run_between_the_others_matmuls(dp, tp):
    """In the compiled forward's schedule (the CPU's collectives are synchronous), the
    microbatches' collectives and matmuls run in TBO steps, in order: each step's collectives
    are one microbatch's and its matmuls the other's; and between each all-reduce of a layer
    and its own microbatch's next matmul runs a matmul of the other microbatch (except the
    first microbatch's stack entry and the second's last exit, which have nothing beside
    them). Run one microbatch after the other (no yield points) and both fail."""
    scheduled = tbo_schedule(dp, tp)
    work = [s for s in scheduled if s.kind in ("collective", "matmul") and s.step is not None]
    steps = [s.step for s in work]
    assert steps == sorted(steps), steps
    last = max(steps)
    for step in range(last + 1):
        at = [s for s in work if s.step == step]
        communicating = {s.microbatch for s in at if s.kind == "collective"}
        computing = {s.microbatch for s in at if s.kind == "matmul"}
        assert len(communicating) <= 1 and not communicating & computing, (step, at)
    checked = 0
    for index, op in enumerate(scheduled):
        if op.op.removesuffix("-start") != "all-reduce" or op.step in (0, last):
            continue
        mine, beside = op.microbatch, 0
        for later in scheduled[index + 1 :]:
            if later.kind == "matmul" and later.microbatch == mine:
                break
            beside += later.kind == "matmul" and later.microbatch == 1 - mine
        assert beside, f"microbatch {mine}'s {op.scope} all-reduce has no other matmul beside"
        checked += 1
    assert checked >= 2 * CONFIG.num_layers


# -- packing ----------------------------------------------------------------------------------


def test_two_batch_packing_puts_each_microbatch_in_its_half():
    """Each DP block is microbatch 0's rows then microbatch 1's, each from its half's first
    row, with each microbatch's token counts; sequences unpack as packed; decode rows put
    microbatch 1's slots after microbatch 0's."""
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    sequences = prompts()
    groups = split_sequences(sequences)
    assert sorted(groups[0] + groups[1]) == list(range(len(LENGTHS)))
    loads = [sum(LENGTHS[i] for i in group) for group in groups]
    assert abs(loads[0] - loads[1]) <= max(LENGTHS)
    packed = pack_two_batches(sequences, topology)
    half = packed.rows_per_rank // 2
    assert half % topology.attn_tp == 0
    segments = packed.rows.segment_ids.reshape(2, 2, half)
    for side in range(2):
        for rank in range(2):
            count = packed.microbatch_counts[side, rank]
            assert (segments[rank, side, :count] >= 0).all()
            assert (segments[rank, side, count:] == -1).all()
    assert packed.microbatch_counts.sum() == sum(LENGTHS)
    ids = packed.unpack(packed.rows.ids)
    for index, tokens in enumerate(sequences):
        assert ids[index, : len(tokens)].tolist() == tokens
    slots = packed.decode_rows_per_rank // 2
    lengths = np.asarray(packed.lengths)
    decode = decode_rows(packed, np.arange(len(lengths)), lengths)
    for index, group in enumerate(groups):
        assert all((packed.slot[i] >= slots) == bool(index) for i in group)
    assert decode.microbatch_counts.tolist() == [
        [sum(packed.rank[i] == r for i in group) for r in range(2)] for group in groups
    ]


# -- rejections and misuse --------------------------------------------------------------------


def test_two_batch_overlap_rejects_what_it_cannot_run():
    """One sequence, context parallelism, scanned layers and a pipeline stage are rejected,
    naming the fix."""
    with pytest.raises(ValueError, match="got 1 sequence"):
        runner(1, 2, True).forward([[1, 2, 3]])
    with pytest.raises(NotImplementedError, match="attn_cp=2"):
        pack_two_batches(prompts(), bj.Topology(attn_cp=2))
    topology = bj.Topology(attn_tp=2)
    mesh = bj.make_mesh(topology)
    scanned = dataclasses.replace(CONFIG, num_layers=4)
    with pytest.raises(NotImplementedError, match="without scan_layers"):
        ShardedCausalLM(
            build_model(scanned, topology, BuildOptions(scan_layers=True, two_batch_overlap=True)),
            mesh,
        )
    with pytest.raises(NotImplementedError, match="attn_cp=2"):
        ShardedCausalLM(
            build_model(CONFIG, bj.Topology(attn_cp=2), BuildOptions(two_batch_overlap=True)),
            bj.make_mesh(bj.Topology(attn_cp=2)),
        )
    with pytest.raises(NotImplementedError, match="not built under two-batch overlap"):
        runner(1, 2, True).forward_captured(prompts(), [0])


def trace(body, dp: int = 1, tp: int = 2) -> None:
    """Traces `body(model, rows, batches)` inside the TP runner's `shard_map`, not compiled:
    misuse raises while tracing."""
    tbo = runner(dp, tp, True)
    packed = tbo.pack(prompts())
    rows, batches = tbo.place(packed)
    spec = bj.BatchFacts(bj.BatchVariant.ORDINARY, tbo.topology, PartitionSpec())
    module = bj.ShardedModule(tbo.model, tbo.mesh)
    program = module.program(
        lambda model, rows, batches: body(model, rows, batches) * 0,
        in_specs=(tbo.topology.row_spec(tbo.topology.attention_rows()), (spec, spec)),
        out_specs=PartitionSpec(),
    )
    jax.eval_shape(program, module.leaves, rows, batches)


def test_handoff_misuse_fails_while_tracing():
    """The handoff rejects an odd split, a merge of streams of different batches (or out of
    order), one stream shared by both microbatches at a yield point, and an owed sum left
    across one; complete_now leaves nothing owed."""

    def split(model, rows, batches):
        return split_stream(model.embed(rows.ids), residual_stream.start(batches[0]), batches)

    def odd(model, rows, batches):
        split_stream(model.embed(rows.ids)[1:], residual_stream.start(batches[0]), batches)
        return jnp.zeros(())

    with pytest.raises(ValueError, match="halves each rank's rows"):
        trace(odd)

    def entered(model, pair):
        (x, stream) = pair
        return model.layers[0].attn_boundary.prepare(x, stream)

    def ffn_done(model, pair, rows):
        layer = model.layers[0]
        h, stream = entered(model, pair)
        y, _ = layer.attend(h, jax.tree.map(lambda v: v[: h.shape[0]], rows), None, stream)
        x, stream = layer.attn_boundary.finish(y, stream)
        h, stream = layer.ffn_boundary.prepare(x, stream)
        return layer, layer.ffn_compute(h, stream), stream

    def foreign(model, rows, batches):
        first, _ = split(model, rows, batches)
        _, second = split(model, rows, batches)
        layer, y, one = ffn_done(model, first, rows)
        layer, z, two = ffn_done(model, second, rows)
        merge_streams(
            complete_now(layer.ffn_boundary, y, one),
            complete_now(layer.ffn_boundary, z, two),
            batches[0],
        )
        return jnp.zeros(())

    with pytest.raises(ValueError, match="merging streams of different batches"):
        trace(foreign)

    def swapped(model, rows, batches):
        first, second = split(model, rows, batches)
        layer, y, one = ffn_done(model, first, rows)
        layer, z, two = ffn_done(model, second, rows)
        done = complete_now(layer.ffn_boundary, y, one), complete_now(layer.ffn_boundary, z, two)
        assert all(s.pending.placement.complete for _, s in done)
        output, merged = merge_streams(*done, batches[0])
        assert merged.residual.shape[0] == rows.ids.shape[0]
        again = split_stream(output, merged, batches)
        for (_, half), (_, old) in zip(again, done, strict=True):
            assert half.pending.value.shape == old.pending.value.shape
        merge_streams(done[1], done[0], batches[0])
        return jnp.zeros(())

    with pytest.raises(ValueError, match="wrong order"):
        trace(swapped)

    def shared(model, rows, batches):
        first, _ = split(model, rows, batches)
        yield_point(first, first)
        return jnp.zeros(())

    with pytest.raises(ValueError, match="do not share one stream"):
        trace(shared)

    def owed(model, rows, batches):
        first, second = split(model, rows, batches)
        layer = model.layers[0]
        h, stream = entered(model, first)
        y, _ = layer.attend(h, jax.tree.map(lambda v: v[: h.shape[0]], rows), None, stream)
        partial = layer.attn_boundary.finish(y, stream)
        yield_point(partial, second)
        return jnp.zeros(())

    with pytest.raises(RuntimeError, match="owed sum left across a yield point"):
        trace(owed)
