"""The routed experts' matmuls of one rank, as pure functions: each (token, choice)'s output of
the experts this rank holds (`expert_outputs`), or their combine computed on the spot
(`finalized_expert_outputs`).

A rank holds a contiguous block of the experts, `[expert_offset, expert_offset + local_experts)`,
and of each of those experts possibly only a slice of the width (the intermediate features). It
sees complete token rows `x` [T, hidden] and returns, per token and per top-k choice, the output of
the chosen expert if this rank holds it and zero otherwise; the boundary completes the sum over
the ranks. No collective and no mesh axis name here.

    expert_e(x) = (silu(x @ gate_e) * (x @ up_e)) @ down_e      (ExpertActivation.SWIGLU)
    expert_e(x) = relu(x @ up_e)^2 @ down_e                    (RELU2: Nemotron-H, no gate)

An expert with biases (`ExpertBiases`: GPT-OSS) adds its gate/up bias before the activation and
its down bias after the down projection; the activation may be another (`ClampedSwiGlu`). A rank
holding a slice of an expert's width adds its slice of the gate/up bias (its columns are
complete), and the down bias only where the caller says (`ExpertBiases.down` is zero on every
rank of the width group but one), so the sum over the width ranks counts it once; an expert
held elsewhere adds nothing (its rows come out zero).

Each expert's gate and up projections are stored stacked, `gate_up` [experts, hidden, 2, width],
so both are one matmul of 2 x width columns (the rows are read once), and a width slice over
ranks cuts the same features out of both; an ungated (relu^2) expert stores its up projection
alone, `gate_up` [experts, hidden, 1, width]. Choices of experts no rank holds (the
zero-computation experts) come out zero.

Grouped matmuls (`GroupedMatmulImpl`): the (token, choice) rows are sorted by expert
(`SortedRows`), so each local expert's rows are contiguous, and the three projections run as
ragged matmuls over the groups (`grouped_expert_outputs`), or, padded to a capacity
(`capacity_buckets`), as batched matmuls (`padded_expert_outputs`, `PADDED_BATCHED`). `DENSE` runs
every row through every local expert and masks: the test reference. The grouped matmuls
themselves (the Pallas kernels, their tuned tilings, the choice by size) are
`pallas_kernels.grouped_matmul`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import boundary_jax as bj
from pallas_kernels.grouped_matmul import (
    TRITON_MAX_ROUTED_ROWS,
    GroupedMatmulImpl,
    Tiling,
    TilingTable,
    grouped_matmul,
)

from ..activations import ExpertActivation
from ..clamped_swiglu import ClampedSwiGlu
from .routing import MoeOutput, Routing, finalize

Activation = ExpertActivation | ClampedSwiGlu
"""What an expert computes between its projections."""


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["gate_up", "down"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class ExpertBiases:
    """The biases of a rank's experts.

    Attributes:
      gate_up: [local_experts, parts, width] added to the first projection's outputs (this
        rank's width slice, stacked as `gate_up`'s parts).
      down: [local_experts, hidden] added to the down projection's output: part of each
        chosen expert's output, so the finalize weighs it by the routing weight. Zero on the
        ranks that must not count it (all but one of an expert's width group).
    """

    gate_up: jax.Array
    down: jax.Array


CAPACITY_FACTORS = (1.25, 1.5)
"""`PADDED_BATCHED`'s capacities as multiples of the even share, smallest first."""


def capacity_buckets(even_share: float, rows: int) -> tuple[int, ...]:
    """The static per-expert capacities `PADDED_BATCHED` picks from, smallest first.

    Each is a `CAPACITY_FACTORS` multiple of `even_share` (the rows each local expert gets when
    the routing is even) rounded up to a multiple of 64 rows (of 8 below 64, for small models),
    and at most `rows` (the routed rows in all, which no expert can exceed).
    """
    buckets = []
    for factor in CAPACITY_FACTORS:
        want = max(1.0, factor * even_share)
        step = 64 if want > 64 else 8
        buckets.append(min(rows, step * int(np.ceil(want / step))))
    return tuple(sorted(set(buckets)))


def expert_outputs(
    x: jax.Array,
    routing: Routing,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    expert_offset: int | jax.Array = 0,
    impl: GroupedMatmulImpl = GroupedMatmulImpl.RAGGED_DOT,
    even_share: float | None = None,
    tiling: Tiling | TilingTable | None = None,
    activation: Activation = ExpertActivation.SWIGLU,
    biases: ExpertBiases | None = None,
) -> jax.Array:
    """Each (token, choice)'s expert output from the experts this rank holds, unweighted.

    Args:
      x: [T, hidden] complete token rows.
      routing: Their routing (global expert ids).
      gate_up: [local_experts, hidden, 2, width] this rank's experts' gate (`[:, :, 0]`) and up
        (`[:, :, 1]`) projections, for global experts `expert_offset + 0 .. expert_offset +
        local_experts - 1`; `width` may be a slice of the expert's intermediate features.
        [local_experts, hidden, 1, width] (the up projection alone) for a RELU2 `activation`.
      down: [local_experts, width, hidden] the down projections (same slice, as rows).
      expert_offset: Global id of this rank's first expert; a Python int or a traced int32
        scalar (for example `axis_index * local_experts`, computed by the caller).
      impl: How the grouped matmuls run.
      even_share: The rows each local expert gets when the routing is even, which sizes the
        capacities of `PADDED_BATCHED` (`capacity_buckets`); e.g. `T * k / num_experts` when
        every rank sees all T tokens. None: `T * k / local_experts` (this rank holds every
        expert).
      tiling: The Pallas grouped matmuls' tiling, as `pallas_kernels.grouped_matmul` takes it
        (a table by shape serves both projections); None for the tuned tables.
      activation: What each expert computes between its projections.
      biases: The experts' biases, or None for none.

    Returns:
      [T, k, hidden] in `x.dtype`: row (t, j) is `down(silu(gate(x_t)) * up(x_t))` (or
      `down(relu(up(x_t))^2)`) of expert
      `routing.experts[t, j]` over this rank's width slice if this rank holds that expert, zero
      otherwise. The sum over the ranks that split the experts and the width completes it.
    """
    settings = (expert_offset, impl, even_share, tiling, activation, biases)
    return _routed_outputs(x, routing, gate_up, down, *settings, lambda out: out)


def finalized_expert_outputs(
    x: jax.Array,
    routing: Routing,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    shared: jax.Array | None = None,
    expert_offset: int | jax.Array = 0,
    impl: GroupedMatmulImpl = GroupedMatmulImpl.RAGGED_DOT,
    even_share: float | None = None,
    dtype: jnp.dtype | None = None,
    tiling: Tiling | TilingTable | None = None,
    activation: Activation = ExpertActivation.SWIGLU,
    biases: ExpertBiases | None = None,
) -> jax.Array:
    """`finalize(MoeOutput(expert_outputs(...), routing, shared), dtype)`, combined where the
    expert outputs are made: for a MoE that finalizes on the spot rather than handing the
    finalize on.

    Under `PADDED_BATCHED` the combine runs inside the capacity branch, so the branch returns
    [T, hidden] rather than the [T * k, hidden] per-choice rows, which XLA would otherwise write
    out of the branch and read back (on an H200, 4096 tokens of a 128-expert top-8 layer: 877
    against 971 us, benchmarks/RESULTS.md run 16).

    Args: as `expert_outputs`, plus `shared` ([T, hidden] this rank's shared-expert share, or
    None) and `dtype` (the result's; None keeps `x.dtype`).

    Returns:
      [T, hidden]: this rank's finalized share, owing the same sum as `expert_outputs`.
    """

    def combine(outputs: jax.Array) -> jax.Array:
        return finalize(MoeOutput(outputs, routing, shared), dtype)

    settings = (expert_offset, impl, even_share, tiling, activation, biases)
    return _routed_outputs(x, routing, gate_up, down, *settings, combine)


def _routed_outputs(
    x, routing, gate_up, down, expert_offset, impl, even_share, tiling, activation, biases, epilogue
):
    """`epilogue` of `expert_outputs`'s [T, k, hidden], applied inside PADDED_BATCHED's branch."""
    local, hidden, width = _check_expert_weights(x, gate_up, down, activation)
    flat_biases = _flat_biases(biases, local, activation.parts * width, hidden)
    tokens, top_k = routing.experts.shape
    flat = routing.experts.reshape(-1) - expert_offset  # [T*k] local expert ids
    held = (flat >= 0) & (flat < local)
    if impl is GroupedMatmulImpl.DENSE:
        dense = _dense_expert_outputs(x, flat, held, gate_up, down, activation, flat_biases)
        return epilogue(dense.reshape(tokens, top_k, hidden))

    def finish(rows: jax.Array) -> jax.Array:  # [T*k, hidden], held elsewhere unspecified
        rows = jnp.where(held[:, None], rows, jnp.zeros_like(rows))
        return epilogue(rows.reshape(tokens, top_k, hidden))

    # The grouped matmuls: the impl itself, or PADDED_BATCHED's fallback past its buckets.
    fallback = impl
    if impl is GroupedMatmulImpl.GPU_BY_SIZE and tokens * top_k > TRITON_MAX_ROUTED_ROWS:
        impl = GroupedMatmulImpl.PADDED_BATCHED
    elif impl is GroupedMatmulImpl.PADDED_BATCHED:
        fallback = GroupedMatmulImpl.RAGGED_DOT
    # Sort the (token, choice) rows by local expert; rows of experts held elsewhere go last, as
    # group `local`, which no matmul covers (ragged_dot leaves such rows zero; masked anyway).
    order, positions, sizes = bj.ops.group_order(jnp.where(held, flat, local), local + 1)
    sorted_rows = SortedRows(order, positions, sizes[:local], jnp.where(held, flat, 0), top_k)
    parts = activation.parts
    weights = (gate_up.reshape(local, hidden, parts * width), down)  # gate | up as one matmul

    def grouped() -> jax.Array:
        rows = grouped_expert_outputs(
            x, sorted_rows, weights, fallback, tiling, activation, flat_biases
        )
        return finish(rows)

    def padded(capacity: int) -> jax.Array:
        rows = padded_expert_outputs(x, sorted_rows, weights, capacity, activation, flat_biases)
        return finish(rows)

    if impl is not GroupedMatmulImpl.PADDED_BATCHED:
        return grouped()
    share = tokens * top_k / local if even_share is None else even_share
    return by_capacity(sorted_rows.sizes, capacity_buckets(share, tokens * top_k), padded, grouped)


def by_capacity(
    sizes: jax.Array,
    buckets: tuple[int, ...],
    padded: Callable[[int], jax.Array],
    grouped: Callable[[], jax.Array],
) -> jax.Array:
    """`padded(capacity)` for the first of `buckets` that holds the busiest expert (`sizes`: rows
    per local expert), or `grouped()` past the last, so no row is dropped: one `lax.switch`."""
    branches = [functools.partial(padded, capacity) for capacity in buckets]
    pick = jnp.sum(jnp.asarray(buckets, jnp.int32) < jnp.max(sizes))
    return jax.lax.switch(pick, [*branches, grouped])


# --------------------------------------------------------------------------------------------
# Internals: the weight checks and the branches of `_routed_outputs`
# --------------------------------------------------------------------------------------------


def _check_expert_weights(x, gate_up, down, activation) -> tuple[int, int, int]:
    want = activation.parts
    for array, rank, what in (
        (x, 2, "x [T, hidden]"),
        (gate_up, 4, f"gate_up [local_experts, hidden, {want}, width]"),
    ):
        if array.ndim != rank:
            raise ValueError(f"{what} must have rank {rank}; got shape {array.shape}")
    local, hidden, parts, width = gate_up.shape
    if parts != want or down.shape != (local, width, hidden) or x.shape[1] != hidden:
        raise ValueError(
            f"{activation.value} expert weights must be gate_up [local_experts, hidden, {want}, "
            "width] and down "
            f"[local_experts, width, hidden] with hidden = x.shape[1]; got {gate_up.shape=}, "
            f"{down.shape=}, {x.shape=}"
        )
    return local, hidden, width


def _flat_biases(
    biases: ExpertBiases | None, local: int, columns: int, hidden: int
) -> tuple[jax.Array, jax.Array] | None:
    """`biases` as [local, parts x width] (the first matmul's columns) and [local, hidden],
    checked; None for None."""
    if biases is None:
        return None
    if biases.gate_up.size != local * columns or biases.down.shape != (local, hidden):
        raise ValueError(
            f"expert biases must be gate_up [local_experts={local}, parts, width] "
            f"({columns} columns) and down [{local}, {hidden}]; got {biases.gate_up.shape=}, "
            f"{biases.down.shape=}"
        )
    return biases.gate_up.reshape(local, columns), biases.down


def _dense_expert_outputs(x, flat, held, gate_up, down, activation, biases) -> jax.Array:
    """[T*k, hidden]: every token through every local expert, then each row's own expert."""
    hp = jax.lax.Precision.HIGHEST
    projected = jnp.einsum("th,lhpi->tlpi", x, gate_up, precision=hp)
    projected = projected.reshape(*projected.shape[:2], -1)
    hidden_rows = activation.apply(projected, None if biases is None else biases[0][None])
    all_out = jnp.einsum("tli,lih->tlh", hidden_rows, down, precision=hp)  # [T, L, hidden]
    if biases is not None:
        all_out = all_out + biases[1][None].astype(all_out.dtype)
    local = gate_up.shape[0]
    top_k = flat.shape[0] // x.shape[0]
    mask = (flat[:, None] == jnp.arange(local)[None, :]) & held[:, None]  # [T*k, L]
    per_row = jnp.repeat(all_out, top_k, axis=0)  # row t*k + j is token t
    return jnp.einsum("rl,rlh->rh", mask.astype(all_out.dtype), per_row, precision=hp)


@dataclasses.dataclass(frozen=True)
class SortedRows:
    """The (token, choice) rows of one rank ordered by local expert (`bj.ops.group_order`).

    Attributes:
      order: [T*k] the row at each place of the sorted order.
      positions: [T*k] each row's place (`order`'s inverse).
      sizes: [local experts] rows per local expert; the rows of experts held elsewhere come
        after all of them.
      local_expert: [T*k] each row's local expert (0 for rows held elsewhere).
      top_k: Rows per token.
    """

    order: jax.Array
    positions: jax.Array
    sizes: jax.Array
    local_expert: jax.Array
    top_k: int


def grouped_expert_outputs(
    x: jax.Array,
    rows: SortedRows,
    weights: tuple[jax.Array, jax.Array],
    impl: GroupedMatmulImpl,
    tiling: Tiling | TilingTable | None = None,
    activation: Activation = ExpertActivation.SWIGLU,
    biases: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """[T*k, hidden] in (token, choice) order, through grouped matmuls over the sorted rows
    (`weights`: gate | up [local, hidden, parts x width] and down; `biases`, or None: gate |
    up [local, parts x width] and down [local, hidden]); rows held elsewhere come back
    unspecified (zero for RAGGED_DOT without biases). One branch of `expert_outputs`."""
    gate_up, down = weights
    sorted_x = jnp.take(x, rows.order // rows.top_k, axis=0)
    matmul = functools.partial(grouped_matmul, group_sizes=rows.sizes, impl=impl, tiling=tiling)
    projected = matmul(sorted_x, gate_up)
    bias = None
    if biases is not None:  # each sorted row's own expert's bias
        bias = jnp.take(biases[0], jnp.take(rows.local_expert, rows.order), axis=0)
    out = matmul(activation.apply(projected, bias), down)
    return _down_biased(jnp.take(out, rows.positions, axis=0), rows, biases)


def capacity_places(rows: SortedRows, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Where the rows go when each local expert gets `capacity` places, expert-major.

    Returns:
      `(source, slot)`: source [local * capacity] the token whose row fills each place (expert
      e's rows in its first `sizes[e]` places, any token in the rest, which no row reads back),
      and slot [T * k] the place of each (token, choice) row's output (any place for rows held
      elsewhere). Both materialized: fused into the gathers that use them, XLA recomputed them
      per element (2 ms instead of 40 us for a 32768-row layer on an H200).
    """
    local = rows.sizes.shape[0]
    routed = rows.order.shape[0]
    starts = jnp.cumsum(rows.sizes) - rows.sizes
    place = jnp.arange(capacity, dtype=starts.dtype)
    sorted_place = jnp.minimum(starts[:, None] + place[None, :], routed - 1)  # [local, C]
    source = jnp.take(rows.order, sorted_place.reshape(-1)) // rows.top_k
    expert = rows.local_expert
    slot = expert * capacity + rows.positions - jnp.take(starts, expert)
    slot = jnp.clip(slot, 0, local * capacity - 1)
    return jax.lax.optimization_barrier((source, slot))


def padded_expert_outputs(
    x: jax.Array,
    rows: SortedRows,
    weights: tuple[jax.Array, jax.Array],
    capacity: int,
    activation: Activation = ExpertActivation.SWIGLU,
    biases: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """As `grouped_expert_outputs`, through batched matmuls over [local experts, `capacity`,
    hidden]: expert e's rows in its first `sizes[e]` places (each at most `capacity`), the
    rest padding that no row reads back. One branch of `expert_outputs` (PADDED_BATCHED)."""
    gate_up, down = weights
    local, hidden, _ = gate_up.shape
    source, slot = capacity_places(rows, capacity)
    padded = jnp.take(x, source, axis=0).reshape(local, capacity, hidden)
    # Full precision keeps float32 models exact; 16-bit matmuls take XLA's default.
    full = jnp.finfo(x.dtype).bits > 16
    batched = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST if full else None)
    projected = batched("eck,ekn->ecn", padded, gate_up.astype(x.dtype))
    bias = None if biases is None else biases[0][:, None]
    out = batched("ecw,ewh->ech", activation.apply(projected, bias), down.astype(x.dtype))
    out = jnp.take(out.reshape(local * capacity, hidden), slot, axis=0)
    return _down_biased(out, rows, biases)


def _down_biased(
    out: jax.Array, rows: SortedRows, biases: tuple[jax.Array, jax.Array] | None
) -> jax.Array:
    """`out` [T*k, hidden] in (token, choice) order plus each row's expert's down bias, added
    in the gather that puts the rows back in order rather than as a pass over the product."""
    if biases is None:
        return out
    return out + jnp.take(biases[1], rows.local_expert, axis=0).astype(out.dtype)
