"""Zigzag CP row order and attention across attention-CP shards (all-gather and ring) against
one device's `attend_packed`, forward and gradients, with mutants the comparison must catch."""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import boundary_jax as bj
from boundary_jax.sharding import place
from models.inputs.zigzag import zigzag_order
from models.layers.attention.attend import attend_packed
from models.layers.attention.context_parallel import (
    CpAttentionMode,
    SoftmaxPartial,
    attend_context_parallel,
    cp_mask,
)

LENGTHS = (13, 3, 22)
"""Packed sequences: one (3 rows) shorter than 2C chunks for C = 2 and 4."""
PACKED_ROWS = 40  # two padding rows after the sequences
KV, GROUP, HEAD_DIM, VALUE_DIM = 2, 2, 8, 6
SCALE = HEAD_DIM**-0.5
TOL = 1e-5
MODES = tuple(CpAttentionMode)


def causal_pairs(positions: np.ndarray, segment_ids: np.ndarray) -> int:
    """(query, key) pairs of causal attention over the rows: a real row at position p sees p+1."""
    return int(np.sum(np.where(segment_ids >= 0, positions + 1, 0)))


def packed_rows() -> tuple[np.ndarray, np.ndarray]:
    """Positions and segment ids of `LENGTHS` packed from row 0, padded to `PACKED_ROWS`."""
    positions = np.zeros(PACKED_ROWS, np.int32)
    segments = np.full(PACKED_ROWS, -1, np.int32)
    start = 0
    for segment, length in enumerate(LENGTHS):
        positions[start : start + length] = np.arange(length)
        segments[start : start + length] = segment
        start += length
    return positions, segments


def packed_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random q [T, kv, group, D], k [T, kv, D], v [T, kv, Dv]: every row (so every rank)
    different."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((PACKED_ROWS, KV, GROUP, HEAD_DIM), np.float32)
    k = rng.standard_normal((PACKED_ROWS, KV, HEAD_DIM), np.float32)
    v = rng.standard_normal((PACKED_ROWS, KV, VALUE_DIM), np.float32)
    return q, k, v


def reference(q, k, v, sliding_window: int | None = None) -> jax.Array:
    positions, segments = packed_rows()
    return attend_packed(q, k, v, positions, segments, scale=SCALE, sliding_window=sliding_window)


def cp_rows(cp: int):
    """The zigzag order (one padding row per CP rank beyond the fullest) and CP-ordered rows."""
    order = zigzag_order(LENGTHS, cp, rows_per_cp_rank=-(-sum(LENGTHS) // cp) + 1)
    positions, segments = packed_rows()
    return order, order.to_cp(positions, 0), order.to_cp(segments, -1)


@functools.cache
def sharded(cp: int, mode: CpAttentionMode, sliding_window: int | None = None):
    """Jitted (forward, gradient of <out, cotangent>) over a mesh of `cp` CP ranks."""
    topology = bj.Topology(attn_cp=cp)
    rows = topology.row_spec(topology.layout(bj.TokenAxis.ATTN_CP))

    def body(q, k, v, positions, segments):
        return attend_context_parallel(
            q,
            k,
            v,
            positions,
            segments,
            topology=topology,
            mode=mode,
            scale=SCALE,
            sliding_window=sliding_window,
        )

    mesh = bj.make_mesh(topology)
    forward = jax.shard_map(body, mesh=mesh, in_specs=(rows,) * 5, out_specs=rows)

    def loss(q, k, v, positions, segments, cotangent):
        return jnp.sum(forward(q, k, v, positions, segments) * cotangent)

    return OnMesh(forward, mesh, rows), OnMesh(jax.grad(loss, argnums=(0, 1, 2)), mesh, rows)


class OnMesh:
    """`fn` jitted, its arguments first split over the CP ranks by rows."""

    def __init__(self, fn, mesh, rows):
        self.jitted, self.mesh, self.rows = jax.jit(fn), mesh, rows

    def placed(self, args: tuple) -> tuple:
        return place(args, self.mesh, (self.rows,) * len(args))

    def __call__(self, *args):
        return self.jitted(*self.placed(args))

    def lower(self, *args):
        return self.jitted.lower(*self.placed(args))


def cp_inputs(order, *packed: np.ndarray) -> list[np.ndarray]:
    """Packed inputs in CP order, CP padding rows filled with random values (not zeros, which
    would hide a padding key that leaks into a real row, or a padding query that is not
    zeroed)."""
    rng = np.random.default_rng(2)
    padding = order.source.reshape(-1) < 0
    out = []
    for x in packed:
        x = order.to_cp(x, 0)
        x[padding] = rng.standard_normal(x[padding].shape, np.float32)
        out.append(x)
    return out


def cotangent(rows: int) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((rows, KV, GROUP, VALUE_DIM), np.float32)


def test_zigzag_round_trips_and_keeps_positions():
    """Every real packed row lands on exactly one CP row and comes back; CP rank i holds chunks
    i and 2C-1-i of every sequence with their positions."""
    positions, segments = packed_rows()
    for cp in (1, 2, 3, 4):
        order = zigzag_order(LENGTHS, cp)
        real = order.source[order.source >= 0]
        np.testing.assert_array_equal(np.sort(real), np.arange(sum(LENGTHS)))
        rows = np.arange(PACKED_ROWS)
        np.testing.assert_array_equal(order.from_cp(order.to_cp(rows, -1)), rows[: sum(LENGTHS)])
        cp_positions = order.to_cp(positions, 0).reshape(cp, -1)
        cp_segments = order.to_cp(segments, -1).reshape(cp, -1)
        for rank in range(cp):
            for segment, length in enumerate(LENGTHS):
                held = np.sort(cp_positions[rank][cp_segments[rank] == segment])
                chunks = np.arange(2 * cp + 1) * length // (2 * cp)
                want = np.r_[
                    chunks[rank] : chunks[rank + 1],
                    chunks[2 * cp - 1 - rank] : chunks[2 * cp - rank],
                ]
                np.testing.assert_array_equal(held, want)
    with pytest.raises(ValueError, match="rows_per_cp_rank must hold"):
        zigzag_order(LENGTHS, 2, rows_per_cp_rank=5)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_work(cp):
    """Each CP rank's causal (query, key) pairs are within 10% of the mean on long sequences,
    where contiguous chunks would give the last rank most of the work."""
    lengths = (4096, 1000, 2500)
    order = zigzag_order(lengths, cp)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    segments = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    cp_positions = order.to_cp(positions, 0).reshape(cp, -1)
    cp_segments = order.to_cp(segments, -1).reshape(cp, -1)
    work = np.array([causal_pairs(cp_positions[r], cp_segments[r]) for r in range(cp)])
    assert work.sum() == causal_pairs(positions, segments)
    assert np.abs(work / work.mean() - 1).max() < 0.1, work
    # Control: each sequence cut into C contiguous pieces, piece r on rank r.
    contiguous = np.sum(
        [[np.sum(piece + 1) for piece in np.array_split(np.arange(n), cp)] for n in lengths],
        axis=0,
    )
    assert max(contiguous) / np.mean(contiguous) > 1.3, contiguous


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_one_device(cp, mode):
    """Attention over zigzag CP shards, mapped back to packed order, equals `attend_packed` over
    the packed rows within 1e-5 (float32); padding rows (packed and CP) are zero."""
    q, k, v = packed_inputs()
    want = np.asarray(reference(q, k, v))
    order, positions, segments = cp_rows(cp)
    forward, _ = sharded(cp, mode)
    got = np.asarray(forward(*cp_inputs(order, q, k, v), positions, segments))
    chex.assert_trees_all_close(order.from_cp(got), want[: sum(LENGTHS)], atol=TOL, rtol=TOL)
    np.testing.assert_array_equal(got[segments < 0], 0)
    # Mutant: the inverse of the contiguous order (no zigzag) puts rows in the wrong places.
    wrong = zigzag_order(LENGTHS, 1, rows_per_cp_rank=order.source.size)
    assert not np.allclose(wrong.from_cp(got), want[: sum(LENGTHS)], atol=1e-2)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_gradients_equal_one_device(cp, mode):
    """Gradients of <out, cotangent> wrt q, k and v through the CP collectives (all-gather's
    transpose, the ring's reversed ppermutes) equal one device's, per packed row."""
    q, k, v = packed_inputs()
    order, positions, segments = cp_rows(cp)
    packed_cotangent = order.from_cp(cotangent(order.source.size))
    full_cotangent = np.zeros((PACKED_ROWS, *packed_cotangent.shape[1:]), np.float32)
    full_cotangent[: sum(LENGTHS)] = packed_cotangent
    want = jax.grad(
        lambda q, k, v: jnp.sum(reference(q, k, v) * full_cotangent), argnums=(0, 1, 2)
    )(q, k, v)
    _, grad = sharded(cp, mode)
    got = grad(*cp_inputs(order, q, k, v), positions, segments, cotangent(order.source.size))
    for name, g, w in zip("qkv", got, want, strict=True):
        chex.assert_trees_all_close(
            order.from_cp(np.asarray(g)), np.asarray(w)[: sum(LENGTHS)], atol=TOL, rtol=TOL
        )
        assert np.abs(np.asarray(w)).max() > 0.1, name


@functools.cache
def ring_missing_last_step(cp: int):
    """A mutant ring, built from the same pieces, that never folds in the last block."""
    topology = bj.Topology(attn_cp=cp)
    rows = topology.row_spec(topology.layout(bj.TokenAxis.ATTN_CP))
    names = topology.group_names(bj.SumGroup.ATTN_CP)
    onward = [(r, (r + 1) % cp) for r in range(cp)]

    def body(q, k, v, positions, segments):
        block = (k, v, positions, segments)
        partial = SoftmaxPartial.over(
            q, k, v, cp_mask(positions, segments, positions, segments), SCALE
        )
        for _ in range(cp - 2):
            block = lax.ppermute(block, names, onward)
            mask = cp_mask(positions, segments, block[2], block[3])
            partial = partial.merge(SoftmaxPartial.over(q, block[0], block[1], mask, SCALE))
        return partial.result()

    mesh = bj.make_mesh(topology)
    return OnMesh(jax.shard_map(body, mesh=mesh, in_specs=(rows,) * 5, out_specs=rows), mesh, rows)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_missing_a_step_is_caught(cp):
    """A ring that skips one block's keys differs from one device by far more than the
    tolerance, so the equality above holds the ring to every step."""
    q, k, v = packed_inputs()
    want = np.asarray(reference(q, k, v))[: sum(LENGTHS)]
    order, positions, segments = cp_rows(cp)
    got = ring_missing_last_step(cp)(*cp_inputs(order, q, k, v), positions, segments)
    assert np.abs(order.from_cp(np.asarray(got)) - want).max() > 1e-2


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_each_mode_issues_its_collectives(mode):
    """All-gather: K/V (with positions and segments) gathered once, no ring. Ring: C-1 steps of
    sends (k, v, positions, segments), each step's send issued before that step's block of
    attention, so the transfer can run under it; no all-gather."""
    cp = 4
    q, k, v = packed_inputs()
    order, positions, segments = cp_rows(cp)
    forward, _ = sharded(cp, mode)
    text = forward.lower(*cp_inputs(order, q, k, v), positions, segments).as_text()
    ops = re.findall(r"stablehlo\.(collective_permute|all_gather|dot_general)", text)
    sends = ops.count("collective_permute")
    if mode is CpAttentionMode.ALL_GATHER:
        assert sends == 0 and ops.count("all_gather") >= 1, ops
        return
    assert "all_gather" not in ops and sends == 4 * (cp - 1), ops
    steps = "".join({"collective_permute": "s", "dot_general": "d"}[op] for op in ops)
    assert re.fullmatch(r"(s{4}d{2}){3}d{2}", steps), steps


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_cp_attention_sliding_window_equals_one_device(mode):
    """With a sliding window (shorter than a sequence, longer than a zigzag chunk) the CP
    attention still equals one device's."""
    cp, window = 4, 5
    q, k, v = packed_inputs()
    want = np.asarray(reference(q, k, v, window))[: sum(LENGTHS)]
    order, positions, segments = cp_rows(cp)
    forward, _ = sharded(cp, mode, window)
    got = np.asarray(forward(*cp_inputs(order, q, k, v), positions, segments))
    chex.assert_trees_all_close(order.from_cp(got), want, atol=TOL, rtol=TOL)
    assert np.abs(want - np.asarray(reference(q, k, v))[: sum(LENGTHS)]).max() > 1e-2
