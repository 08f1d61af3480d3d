"""The mixture-of-experts FFN of one rank: router, grouped expert matmuls, deferred finalize.

(Over 600 lines: the router, the grouped-matmul paths with their dense fallback, the finalize
and `SparseMoe` share private helpers; split apart they would import each other's internals.)

Everything here is the compute of ONE rank and owns no communication: no collective and no mesh
axis name. A rank holds a contiguous block of the experts, `[expert_offset, expert_offset +
local_experts)`, and of each of those experts possibly only a slice of the width (the
intermediate features). It sees complete token rows `x` [T, hidden] and returns, per token and per
top-k choice, the output of the chosen expert if this rank holds it and zero otherwise. The
boundary completes the rest: the sum over the expert-parallel and width-parallel ranks (a psum,
reduce-scatter, or the combine of an all-to-all), and the finalize, the weighted sum over the k
choices, which may be deferred and fused with the next residual add and norm.

Because the finalize is linear, it commutes with the rank sum:
`finalize(sum_r outputs_r) == sum_r finalize(outputs_r)`; the boundary may do either.

The math, as Hugging Face transformers 5 computes it (Mixtral, Qwen3-MoE, Qwen2-MoE):

    probs = softmax(float32(x @ router))              # [T, E], over ALL experts
    weights, experts = top_k(probs, k)                # descending; ties to the lower index
    weights /= sum(weights)   if renormalize          # Mixtral; Qwen3-MoE's norm_topk_prob
    y[t] = sum_j weights[t, j] * expert[experts[t, j]](x[t])
           + sigmoid(x[t] @ shared_gate) * shared_expert(x[t])    # Qwen2-MoE
    expert_e(x) = (silu(x @ gate_e) * (x @ up_e)) @ down_e      (ExpertActivation.SWIGLU)
    expert_e(x) = relu(x @ up_e)^2 @ down_e                    (RELU2: Nemotron-H, no gate)
    expert_e(x) = x    for e >= num_experts    (zero-computation experts: LongCat-Flash)

A zero-computation expert has no weights: no rank holds it, so the grouped matmuls and the
all-to-all skip its choices (their expert outputs are zero), and its part of the combine,
`x * sum of its choices' weights` (`zero_expert_output`), joins the shared expert's slot,
counted once like a shared expert every rank computes whole.

Each expert's gate and up projections are stored stacked, `gate_up` [experts, hidden, 2, width],
so both are one matmul of 2 x width columns (the rows are read once), and a width slice over
ranks cuts the same features out of both; an ungated (relu^2) expert stores its up projection
alone, `gate_up` [experts, hidden, 1, width].

Grouped matmuls (`GroupedMatmulImpl`): the (token, choice) rows are sorted by expert, so each
local expert's rows are contiguous, and the three projections run as ragged matmuls over the
groups, or, padded to a capacity, as batched matmuls (`PADDED_BATCHED`). `DENSE` runs every row
through every local expert and masks: the test reference. The grouped matmuls themselves (the
Pallas kernels, their tuned tilings, the choice by size) are `pallas_kernels.grouped_matmul`'s.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import boundary_jax as bj
from boundary_jax.initializers import Normal, param
from pallas_kernels.grouped_matmul import (
    TRITON_MAX_ROUTED_ROWS,
    GroupedMatmulImpl,
    Tiling,
    TilingTable,
    grouped_matmul,
)

from .activations import ExpertActivation

PartitionEntry = str | tuple[str, ...] | None
"""One entry of a `PartitionSpec`: mesh axis name(s) chosen by the caller, or None."""

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


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["weights", "experts"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class Routing:
    """Each token's top-k choice of experts.

    Attributes:
      weights: [T, k] combine weights in float32 (float64 for float64 inputs), in descending
        probability order; renormalised to sum to 1 per token when the router renormalises.
      experts: [T, k] int32 global expert ids (not offset by any rank's block), all distinct per
        token.
    """

    weights: jax.Array
    experts: jax.Array


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["expert_outputs", "routing", "shared"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class MoeOutput:
    """What one rank's MoE compute hands on: per-choice outputs, not yet combined.

    Attributes:
      expert_outputs: [T, k, hidden] in the activation dtype: row (t, j) is this rank's share of
        expert `routing.experts[t, j]` applied to token t, unweighted; zero where this rank holds
        none of that expert. Owes the sum over the ranks the experts and their width are split
        over, then the finalize.
      routing: The routing the outputs belong to (identical on every rank).
      shared: [T, hidden] this rank's share of the shared expert (gate applied), owing the same
        sum; None without a shared expert. The finalize adds it.
    """

    expert_outputs: jax.Array
    routing: Routing
    shared: jax.Array | None


# --------------------------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------------------------


def route(x: jax.Array, router: jax.Array, *, top_k: int, renormalize: bool) -> Routing:
    """Softmax over all experts, then top-k, then (optionally) renormalisation of the k weights.

    Args:
      x: [T, hidden] complete token rows.
      router: [hidden, num_experts] the router's kernel, the whole of it (every rank routes every
        token to all experts, so every rank holds the same routing).
      top_k: Experts per token.
      renormalize: Divide the k weights by their sum (Mixtral; Qwen3-MoE's `norm_topk_prob`);
        False keeps the softmax probabilities as they are (Qwen2-MoE).

    Returns:
      The `Routing`: float32 weights (float64 for float64 `x`) and int32 expert ids, [T, top_k]
      each.
    """
    _check_rank(x, 2, "x [T, hidden]")
    _check_rank(router, 2, "router [hidden, num_experts]")
    if router.shape[0] != x.shape[1]:
        raise ValueError(
            f"router must be [hidden, num_experts] with hidden = x.shape[1]; got "
            f"{router.shape=}, {x.shape=}"
        )
    if not 1 <= top_k <= router.shape[1]:
        raise ValueError(f"top_k must be in [1, num_experts={router.shape[1]}]; got {top_k=}")
    # As transformers: the logits in the activation dtype, the softmax in (at least) float32.
    logits = (x @ router.astype(x.dtype)).astype(_accumulation_dtype(x.dtype))
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights=weights, experts=experts.astype(jnp.int32))


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
    activation: ExpertActivation = ExpertActivation.SWIGLU,
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

    Returns:
      [T, k, hidden] in `x.dtype`: row (t, j) is `down(silu(gate(x_t)) * up(x_t))` (or
      `down(relu(up(x_t))^2)`) of expert
      `routing.experts[t, j]` over this rank's width slice if this rank holds that expert, zero
      otherwise. The sum over the ranks that split the experts and the width completes it.
    """
    settings = (expert_offset, impl, even_share, tiling, activation)
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
    activation: ExpertActivation = ExpertActivation.SWIGLU,
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

    settings = (expert_offset, impl, even_share, tiling, activation)
    return _routed_outputs(x, routing, gate_up, down, *settings, combine)


def _routed_outputs(
    x, routing, gate_up, down, expert_offset, impl, even_share, tiling, activation, epilogue
):
    """`epilogue` of `expert_outputs`'s [T, k, hidden], applied inside PADDED_BATCHED's branch."""
    local, hidden, width = _check_expert_weights(x, gate_up, down, activation)
    tokens, top_k = routing.experts.shape
    flat = routing.experts.reshape(-1) - expert_offset  # [T*k] local expert ids
    held = (flat >= 0) & (flat < local)
    if impl is GroupedMatmulImpl.DENSE:
        dense = _dense_expert_outputs(x, flat, held, gate_up, down, activation)
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
    order, positions, sizes = bj.group_order(jnp.where(held, flat, local), local + 1)
    sorted_rows = SortedRows(order, positions, sizes[:local], jnp.where(held, flat, 0), top_k)
    parts = activation.parts
    weights = (gate_up.reshape(local, hidden, parts * width), down)  # gate | up as one matmul

    def grouped() -> jax.Array:
        rows = grouped_expert_outputs(x, sorted_rows, weights, fallback, tiling, activation)
        return finish(rows)

    def padded(capacity: int) -> jax.Array:
        return finish(padded_expert_outputs(x, sorted_rows, weights, capacity, activation))

    if impl is not GroupedMatmulImpl.PADDED_BATCHED:
        return grouped()
    share = tokens * top_k / local if even_share is None else even_share
    buckets = capacity_buckets(share, tokens * top_k)
    branches = [functools.partial(padded, capacity) for capacity in buckets]
    # The first bucket that holds the busiest expert; past the last, the grouped matmuls.
    pick = jnp.sum(jnp.asarray(buckets, jnp.int32) < jnp.max(sorted_rows.sizes))
    return jax.lax.switch(pick, [*branches, grouped])


def shared_expert(
    x: jax.Array,
    gate: jax.Array | None,
    up: jax.Array,
    down: jax.Array,
    expert_gate: jax.Array | None = None,
) -> jax.Array:
    """This rank's share of a shared expert: `down(silu(gate(x)) * up(x))`, or without a gate
    projection `down(relu(up(x))^2)`; optionally sigmoid-gated.

    Args:
      x: [T, hidden] complete token rows.
      gate: [hidden, width] the gate projection (None: the ungated relu^2 expert); `width` may
        be a slice of the intermediate features, in which case the output is this rank's
        partial sum.
      up: [hidden, width] the up projection, same slice.
      down: [width, hidden] the down projection, same slice.
      expert_gate: [hidden, 1] Qwen2-MoE's `shared_expert_gate`, whole on every rank: the output
        is scaled by `sigmoid(x @ expert_gate)` per token (a per-token scale, so the partial sums
        stay partial sums); None for no gate.

    Returns:
      [T, hidden] in `x.dtype`, owing the sum over the ranks the width is split over. A shared
      expert computed whole on every rank of a group must be counted once by the caller (added
      on one rank only).
    """
    if gate is None:
        out = ExpertActivation.RELU2.apply(x @ up) @ down
    else:
        out = (jax.nn.silu(x @ gate) * (x @ up)) @ down
    if expert_gate is not None:
        out = jax.nn.sigmoid(x @ expert_gate) * out
    return out


def zero_expert_output(x: jax.Array, routing: Routing, num_experts: int) -> jax.Array:
    """The zero-computation (identity) experts' part of the combine: each row times the sum of
    its weights on choices of an expert id >= `num_experts`.

    Args:
      x: [T, hidden] the rows the experts read.
      routing: Their routing (global ids; the routed experts are 0 .. num_experts - 1).
      num_experts: The routed experts; every id past them is a zero-computation expert.

    Returns:
      [T, hidden] in `x.dtype` (the product taken in float32, float64 for float64 rows): a
      complete value, to be counted once by the sum the MoE's output owes.
    """
    acc = _accumulation_dtype(x.dtype)
    zero = routing.experts >= num_experts
    weight = jnp.sum(jnp.where(zero, routing.weights.astype(acc), 0), axis=-1)
    return (x.astype(acc) * weight[:, None]).astype(x.dtype)


def finalize(output: MoeOutput, dtype: jnp.dtype | None = None) -> jax.Array:
    """The weighted combine of the k choices, plus the shared expert: [T, hidden].

    Linear in `output`: apply it to one rank's partial outputs (then sum over ranks) or to the
    completed outputs (after the sum); both give the same result. Accumulates in float32
    (float64 for float64 outputs).

    Args:
      output: Per-choice outputs, routing and shared expert of a `MoeOutput`.
      dtype: The result's dtype; None keeps `expert_outputs.dtype`.

    Returns:
      `sum_j weights[t, j] * expert_outputs[t, j] (+ shared[t])`, [T, hidden].
    """
    outputs = output.expert_outputs
    weights = output.routing.weights
    if weights.shape != outputs.shape[:2]:
        raise ValueError(
            f"routing weights must be [T, k] of expert_outputs [T, k, hidden]; got "
            f"{weights.shape=}, {outputs.shape=}"
        )
    accumulate = _accumulation_dtype(outputs.dtype)
    combined = jnp.einsum(
        "tk,tkh->th",
        weights.astype(accumulate),
        outputs.astype(accumulate),
        precision=jax.lax.Precision.HIGHEST,
    )
    if output.shared is not None:
        combined = combined + output.shared.astype(accumulate)
    return combined.astype(outputs.dtype if dtype is None else dtype)


def moe_reference(
    x: np.ndarray,
    router: np.ndarray,
    gate_up: np.ndarray,
    down: np.ndarray,
    *,
    top_k: int,
    renormalize: bool,
    shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    shared_gate: np.ndarray | None = None,
) -> np.ndarray:
    """The whole MoE layer in float64 NumPy, one token at a time: the spec the tests check.

    Args: as `route`, `expert_outputs` and `shared_expert`, with all experts and their whole
    width (`gate_up` [E, hidden, 2, width], `down` [E, width, hidden]).

    Returns:
      [T, hidden] float64.
    """
    x = np.asarray(x, np.float64)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    logits = x @ np.asarray(router, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-probs[t], kind="stable")[:top_k]
        weights = probs[t, chosen]
        if renormalize:
            weights = weights / weights.sum()
        for e, weight in zip(chosen, weights, strict=True):
            g, u = np.moveaxis(np.asarray(gate_up[e], np.float64), 1, 0)
            d = np.asarray(down[e], np.float64)
            out[t] += weight * ((silu(x[t] @ g) * (x[t] @ u)) @ d)
    if shared is not None:
        g, u, d = (np.asarray(a, np.float64) for a in shared)
        shared_out = (silu(x @ g) * (x @ u)) @ d
        if shared_gate is not None:
            shared_out = shared_out / (1 + np.exp(-(x @ np.asarray(shared_gate, np.float64))))
        out += shared_out
    return out


# --------------------------------------------------------------------------------------------
# The NNX module
# --------------------------------------------------------------------------------------------


class SharedExpert(nnx.Module):
    """A SwiGLU (or relu^2 MLP) every token goes through, width optionally split, optionally
    sigmoid-gated.

    Attributes:
      gate_proj: [hidden, width] global, columns split over `width_entry`; None for a RELU2
        activation.
      up_proj: As `gate_proj`.
      down_proj: [width, hidden] global, rows split over `width_entry`.
      expert_gate: [hidden, 1], whole on every rank (Qwen2-MoE's `shared_expert_gate`), or None.

    Every weight is drawn from N(0, init_std^2) (None: std 1/sqrt(fan_in)).
    """

    def __init__(
        self,
        hidden_size: int,
        width: int,
        *,
        gated: bool,
        width_entry: PartitionEntry = None,
        activation: ExpertActivation = ExpertActivation.SWIGLU,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        std = init_std
        swiglu = activation is ExpertActivation.SWIGLU
        self.gate_proj = (
            _param(rngs, (hidden_size, width), (None, width_entry), dtype, std=std)
            if swiglu
            else None
        )
        self.up_proj = _param(rngs, (hidden_size, width), (None, width_entry), dtype, std=std)
        self.down_proj = _param(rngs, (width, hidden_size), (width_entry, None), dtype, std=std)
        self.expert_gate = (
            _param(rngs, (hidden_size, 1), (None, None), dtype, std=std) if gated else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """[T, hidden] -> [T, hidden], this rank's share (see `shared_expert`)."""
        expert_gate = None if self.expert_gate is None else self.expert_gate[...]
        gate = None if self.gate_proj is None else self.gate_proj[...]
        return shared_expert(x, gate, self.up_proj[...], self.down_proj[...], expert_gate)


class SparseMoe(nnx.Module):
    """Router + routed experts (+ a shared expert) of one rank; returns an unfinalized output.

    Built outside `jax.shard_map` with global shapes; the caller names the mesh axes the experts
    and their width are split over (`expert_entry`, `width_entry`: `PartitionSpec` entries), so
    inside `shard_map` the module sees its block of `num_experts / expert ranks` experts and
    `width / width ranks` features. The router is whole on every rank. The shared expert's
    width is split over `shared_width_entry` (None: whole on every rank).

    Attributes:
      router: [hidden, num_experts], replicated.
      gate_up_proj: [num_experts, hidden, 2, width] global, each expert's gate and up
        projections stacked on axis 2 ([num_experts, hidden, 1, width], the up projection
        alone, for RELU2 experts); split over `expert_entry` (axis 0) and `width_entry`
        (axis 3).
      down_proj: [num_experts, width, hidden] global; split over `expert_entry` (axis 0) and
        `width_entry` (axis 1).
      shared_expert: A `SharedExpert` or None.
      top_k: Experts per token.
      renormalize: Whether the router renormalises its top-k weights.
      impl: The grouped matmul implementation.
      activation: What the routed and shared experts compute between their projections.
      num_experts: The routed experts (global).
      zero_experts: Zero-computation (identity) experts the router scores after the routed
        ones (`router` has `num_experts + zero_experts` columns); they hold no weights.

    Every weight is drawn from N(0, init_std^2) (None: std 1/sqrt(fan_in)).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        expert_width: int,
        *,
        top_k: int,
        renormalize: bool,
        shared_width: int | None = None,
        shared_gated: bool = False,
        expert_entry: PartitionEntry = None,
        width_entry: PartitionEntry = None,
        shared_width_entry: PartitionEntry = None,
        zero_experts: int = 0,
        impl: GroupedMatmulImpl = GroupedMatmulImpl.RAGGED_DOT,
        activation: ExpertActivation = ExpertActivation.SWIGLU,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        scored = num_experts + zero_experts
        if not 1 <= top_k <= scored or zero_experts < 0:
            raise ValueError(
                "top_k must be in [1, num_experts + zero_experts] and zero_experts >= 0; got "
                f"{top_k=}, {num_experts=}, {zero_experts=}"
            )
        if shared_gated and shared_width is None:
            raise ValueError("shared_gated=True needs a shared expert; got shared_width=None")
        self.router = _param(rngs, (hidden_size, scored), (None, None), dtype, std=init_std)
        self.init_experts(
            num_experts,
            hidden_size,
            expert_width,
            expert_entry=expert_entry,
            width_entry=width_entry,
            activation=activation,
            dtype=dtype,
            init_std=init_std,
            rngs=rngs,
        )
        self.shared_expert = (
            None
            if shared_width is None
            else SharedExpert(
                hidden_size,
                shared_width,
                gated=shared_gated,
                width_entry=shared_width_entry,
                activation=activation,
                dtype=dtype,
                init_std=init_std,
                rngs=rngs,
            )
        )
        self.top_k = top_k
        self.renormalize = renormalize
        self.impl = impl
        self.activation = activation
        self.num_experts = num_experts
        self.zero_experts = zero_experts

    def __call__(
        self,
        x: jax.Array,
        *,
        expert_offset: int | jax.Array = 0,
        count_shared: bool | jax.Array = True,
        count_zero: bool | jax.Array = True,
    ) -> MoeOutput:
        """[T, hidden] complete rows -> this rank's `MoeOutput` (unfinalized, owing the sum).

        Args:
          x: [T, hidden] token rows, the same on every rank that splits these experts.
          expert_offset: Global id of this rank's first local expert (0 when the experts are
            not split); the caller computes it, e.g. `axis_index * local_experts`.
          count_shared: Whether this rank adds its shared-expert output (a traced bool where
            the rank decides it, e.g. the first rank of a group that holds it whole).
          count_zero: Whether this rank adds the zero-computation experts' part (every rank
            computes it whole: one rank of the group the output is summed over adds it).
        """
        routing = self.route(x)
        outputs = self.routed(x, routing, **self._settings(x, expert_offset))
        return MoeOutput(outputs, routing, self._shared(x, routing, count_shared, count_zero))

    def finalized(
        self,
        x: jax.Array,
        *,
        expert_offset: int | jax.Array = 0,
        count_shared: bool | jax.Array = True,
        count_zero: bool | jax.Array = True,
    ) -> jax.Array:
        """[T, hidden] complete rows -> this rank's finalized share, owing the sum:
        `finalize(self(x, expert_offset=...))`, combined inside the expert computation
        (`finalized_expert_outputs`).

        Args:
          x, expert_offset, count_shared, count_zero: As for `__call__`.
        """
        routing = self.route(x)
        return self.routed(
            x,
            routing,
            shared=self._shared(x, routing, count_shared, count_zero),
            combine=True,
            **self._settings(x, expert_offset),
        )

    def route(self, x: jax.Array) -> Routing:
        """[T, hidden] complete rows -> their `Routing` (alike on every rank): the softmax
        top-k of `route`; a subclass with another router overrides it."""
        return route(x, self.router[...], top_k=self.top_k, renormalize=self.renormalize)

    def init_experts(
        self,
        num_experts: int,
        hidden_size: int,
        expert_width: int,
        *,
        expert_entry: PartitionEntry,
        width_entry: PartitionEntry,
        activation: ExpertActivation,
        dtype: jnp.dtype,
        init_std: float | None,
        rngs: nnx.Rngs,
    ) -> None:
        """Makes the routed experts' weights (`gate_up_proj`, `down_proj`, split as the entries
        say, drawn from N(0, init_std^2)); a subclass holding them in another form (FP8 blocks)
        overrides it with `routed`."""
        self.gate_up_proj = _param(
            rngs,
            (num_experts, hidden_size, activation.parts, expert_width),
            (expert_entry, None, None, width_entry),
            dtype,
            std=init_std,
            fan_in=hidden_size,
        )
        self.down_proj = _param(
            rngs,
            (num_experts, expert_width, hidden_size),
            (expert_entry, width_entry, None),
            dtype,
            std=init_std,
        )

    def routed(
        self,
        x: jax.Array,
        routing: Routing,
        *,
        expert_offset: int | jax.Array = 0,
        even_share: float | None = None,
        shared: jax.Array | None = None,
        combine: bool = False,
    ) -> jax.Array:
        """This rank's experts applied to rows `x` as `routing` chose them: `expert_outputs`
        [T, k, hidden], or with `combine` their finalize with `shared` added
        (`finalized_expert_outputs`, [T, hidden]).

        Args:
          x, routing, expert_offset, even_share: As for `expert_outputs`.
          shared: With `combine`, this rank's shared-expert share, or None.
          combine: Return the finalized [T, hidden] rather than the per-choice outputs.
        """
        weights = (self.gate_up_proj[...], self.down_proj[...])
        settings = {
            "expert_offset": expert_offset,
            "impl": self.impl,
            "even_share": even_share,
            "activation": self.activation,
        }
        if combine:
            return finalized_expert_outputs(x, routing, *weights, shared=shared, **settings)
        return expert_outputs(x, routing, *weights, **settings)

    def _shared(
        self,
        x: jax.Array,
        routing: Routing,
        count_shared: bool | jax.Array,
        count_zero: bool | jax.Array,
    ) -> jax.Array | None:
        """What joins the combine beside the routed experts: the shared expert's share of rows
        `x` and the zero-computation experts' part, each zero on a rank that does not count
        it; None for a MoE with neither."""
        parts = []
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            parts.append(jnp.where(count_shared, shared, jnp.zeros_like(shared)))
        if self.zero_experts:
            zero = zero_expert_output(x, routing, self.num_experts)
            parts.append(jnp.where(count_zero, zero, jnp.zeros_like(zero)))
        return sum(parts[1:], parts[0]) if parts else None

    def _settings(self, x: jax.Array, expert_offset: int | jax.Array) -> dict:
        """The `routed` keywords for rows `x` of every rank's tokens."""
        return {
            "expert_offset": expert_offset,
            "even_share": x.shape[0] * self.top_k / self.router.shape[1],
        }


# --------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------


def _param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    spec: tuple,
    dtype,
    *,
    std: float | None,
    fan_in: int | None = None,
) -> nnx.Param:
    """N(0, std^2) weights (std None: 1/sqrt(fan_in), fan_in by default the second-to-last
    axis), split as `spec` says."""
    fan_in = shape[-2] if fan_in is None else fan_in
    init = Normal(1 / np.sqrt(fan_in) if std is None else std)
    return param(init, shape, dtype, rngs=rngs, sharding=spec)


def _accumulation_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _check_rank(array: jax.Array, rank: int, what: str) -> None:
    if array.ndim != rank:
        raise ValueError(f"{what} must have rank {rank}; got shape {array.shape}")


def _check_expert_weights(x, gate_up, down, activation) -> tuple[int, int, int]:
    _check_rank(x, 2, "x [T, hidden]")
    want = activation.parts
    _check_rank(gate_up, 4, f"gate_up [local_experts, hidden, {want}, width]")
    local, hidden, parts, width = gate_up.shape
    if parts != want or down.shape != (local, width, hidden) or x.shape[1] != hidden:
        raise ValueError(
            f"{activation.value} expert weights must be gate_up [local_experts, hidden, {want}, "
            "width] and down "
            f"[local_experts, width, hidden] with hidden = x.shape[1]; got {gate_up.shape=}, "
            f"{down.shape=}, {x.shape=}"
        )
    return local, hidden, width


def _dense_expert_outputs(x, flat, held, gate_up, down, activation) -> jax.Array:
    """[T*k, hidden]: every token through every local expert, then each row's own expert."""
    hp = jax.lax.Precision.HIGHEST
    projected = jnp.einsum("th,lhpi->tlpi", x, gate_up, precision=hp)
    hidden_rows = activation.apply(projected.reshape(*projected.shape[:2], -1))
    all_out = jnp.einsum("tli,lih->tlh", hidden_rows, down, precision=hp)  # [T, L, hidden]
    local = gate_up.shape[0]
    top_k = flat.shape[0] // x.shape[0]
    mask = (flat[:, None] == jnp.arange(local)[None, :]) & held[:, None]  # [T*k, L]
    per_row = jnp.repeat(all_out, top_k, axis=0)  # row t*k + j is token t
    return jnp.einsum("rl,rlh->rh", mask.astype(all_out.dtype), per_row, precision=hp)


@dataclasses.dataclass(frozen=True)
class SortedRows:
    """The (token, choice) rows of one rank ordered by local expert (`bj.group_order`).

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
    activation: ExpertActivation = ExpertActivation.SWIGLU,
) -> jax.Array:
    """[T*k, hidden] in (token, choice) order, through grouped matmuls over the sorted rows
    (`weights`: gate | up [local, hidden, parts x width] and down); rows held elsewhere come
    back unspecified (zero for RAGGED_DOT). One branch of `expert_outputs`."""
    gate_up, down = weights
    sorted_x = jnp.take(x, rows.order // rows.top_k, axis=0)
    matmul = functools.partial(grouped_matmul, group_sizes=rows.sizes, impl=impl, tiling=tiling)
    hidden_rows = activation.apply(matmul(sorted_x, gate_up))
    return jnp.take(matmul(hidden_rows, down), rows.positions, axis=0)


def padded_expert_outputs(
    x: jax.Array,
    rows: SortedRows,
    weights: tuple[jax.Array, jax.Array],
    capacity: int,
    activation: ExpertActivation = ExpertActivation.SWIGLU,
) -> jax.Array:
    """As `grouped_expert_outputs`, through batched matmuls over [local experts, `capacity`,
    hidden]: expert e's rows in its first `sizes[e]` places (each at most `capacity`), the
    rest padding that no row reads back. One branch of `expert_outputs` (PADDED_BATCHED)."""
    gate_up, down = weights
    local, hidden, _ = gate_up.shape
    routed = rows.order.shape[0]
    starts = jnp.cumsum(rows.sizes) - rows.sizes
    place = jnp.arange(capacity, dtype=starts.dtype)
    sorted_place = jnp.minimum(starts[:, None] + place[None, :], routed - 1)  # [local, C]
    source = jnp.take(rows.order, sorted_place.reshape(-1)) // rows.top_k
    expert = rows.local_expert
    slot = expert * capacity + rows.positions - jnp.take(starts, expert)
    slot = jnp.clip(slot, 0, local * capacity - 1)  # rows held elsewhere: any slot
    # Materialized: fused into the gathers below, XLA recomputed this per element (2 ms
    # instead of 40 us for a 32768-row layer on an H200).
    source, slot = jax.lax.optimization_barrier((source, slot))
    padded = jnp.take(x, source, axis=0).reshape(local, capacity, hidden)
    # Full precision keeps float32 models exact; 16-bit matmuls take XLA's default.
    full = jnp.finfo(x.dtype).bits > 16
    batched = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST if full else None)
    hidden_rows = activation.apply(batched("eck,ekn->ecn", padded, gate_up.astype(x.dtype)))
    out = batched("ecw,ewh->ech", hidden_rows, down.astype(x.dtype))
    return jnp.take(out.reshape(local * capacity, hidden), slot, axis=0)
