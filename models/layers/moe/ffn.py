"""The sparse FFN of an MoE decoder layer on a topology: experts over EP, both dispatch modes.

`MoeFfn` is `models.layers.moe.sparse.SparseMoe` (same parameters, same checkpoint paths) with its
weights split by the topology, not by mesh axes it names: the experts over the expert-parallel group
(`SumGroup.MOE_EP`) and each expert's width over `SumGroup.MOE_TP`. Its call
takes the stage's normalized input and the exit's `defer_moe_finalize`:

- `MoeDispatch.GATHER`: every rank of the full TP group holds every attention-DP rank's rows;
  it runs its experts (its slice of their width) on all of them and returns its share, zero for
  experts held elsewhere. The boundary sums the shares over the MoE output group.
- `MoeDispatch.ALL_TO_ALL`: each rank holds only its own rows; every (token, choice) row is sent
  to the expert-parallel rank holding its expert and the answer comes back (`boundary_jax.ops`
  `dispatch_to_experts` / `combine_from_experts`; with `moe_tp > 1` the `moe_tp` ranks of an
  expert share their received rows and sum their width shares of the answers), so the output
  is complete on its own rows.

A shared expert is split over the full TP group on gathered rows when its width divides it,
otherwise computed whole on every rank: a replicated part of the stage's output
(`boundary_jax.declare.Replicated`, `replicated_parts`), which the stage boundary counts once: on
gathered rows on the first rank of the MoE output sum, on own rows on every rank (each rank's
rows are its own). Zero-computation (identity) experts (`MoeConfig.zero_experts`) are a
replicated part the same way; their choices are never sent all-to-all.

Expert biases (`MoeConfig.expert_bias`) go with their experts: the gate/up bias is split like
the columns it is added to, and the down bias, whole on each rank of an expert's width group, is
a replicated part over that group (`SumGroup.MOE_TP`, whose ranks sum their width shares at the
boundary or, under an all-to-all, inside compute); only the rank that holds an expert computes
its outputs, so the EP ranks need no such rule. Either dispatch then sums each chosen expert's
output, bias included, once before the routing weight scales it.

The MoE asks its stage boundary which of these parts this rank adds (`__call__`'s `counts`, the
boundary's `counts(name, stream)`); its stage declares them (`replicated_parts`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import boundary_jax as bj

from ...config import MoeConfig
from ..activations import ExpertActivation
from .experts import Activation
from .routing import MoeOutput, Routing, finalize
from .sparse import GroupedMatmulImpl, PartsCounted, SparseMoe

SHARED_EXPERT = "shared expert"
ZERO_EXPERTS = "zero-computation experts"
EXPERT_DOWN_BIAS = "expert down bias"

Counts = Callable[[str], bool | jax.Array]
"""Whether this rank adds the named replicated part: a stage boundary's `counts(name, stream)`."""


def splits_shared_expert(moe: MoeConfig, topology: bj.Topology, dispatch: bj.MoeDispatch) -> bool:
    """Whether the shared expert's width is split over the full TP group (gathered rows, a
    width the group divides); otherwise every rank computes it whole."""
    shared = moe.shared_expert_intermediate_size
    own_rows = dispatch is bj.MoeDispatch.ALL_TO_ALL
    return not own_rows and shared is not None and shared % topology.tp_size == 0


def replicated_parts(
    moe: MoeConfig, topology: bj.Topology, dispatch: bj.MoeDispatch
) -> tuple[bj.declare.Replicated, ...]:
    """The replicated parts a sparse FFN's stage declares (for its model's `stage_facts`): a
    shared expert computed whole on every rank, zero-computation experts, and the experts' down
    biases (whole over `SumGroup.MOE_TP`)."""
    parts = []
    whole_shared = moe.shared_expert_intermediate_size is not None and not splits_shared_expert(
        moe, topology, dispatch
    )
    if whole_shared:
        parts.append(bj.declare.Replicated(SHARED_EXPERT))
    if moe.zero_experts:
        parts.append(bj.declare.Replicated(ZERO_EXPERTS))
    if moe.expert_bias:
        parts.append(bj.declare.Replicated(EXPERT_DOWN_BIAS, bj.SumGroup.MOE_TP))
    return tuple(parts)


def deferred_finalize(output: MoeOutput) -> bj.DeferredFinalize:
    """The finalize of `output` handed on to the boundary: the shared expert (if any) becomes
    one more choice of weight one, so `DeferredFinalize.complete()` equals `finalize(output)`."""
    outputs, weights = output.expert_outputs, output.routing.weights
    if output.shared is not None:
        outputs = jnp.concatenate([outputs, output.shared[:, None]], axis=1)
        weights = jnp.concatenate([weights, jnp.ones_like(weights[:, :1])], axis=1)
    return bj.DeferredFinalize(outputs, weights)


class MoeFfn(SparseMoe):
    """One rank's sparse FFN on `topology`, returning what its stage's exit takes.

    Attributes (besides `SparseMoe`'s):
      topology: Where the experts and their width are split.
      dispatch: Where the experts get their tokens (must match the stage's declaration).
      capacity: For ALL_TO_ALL, rows each rank sends each rank (None: drop nothing).
      replicated: The replicated parts its stage declares (`replicated_parts`), which `__call__`
        asks the boundary about.
    """

    def __init__(
        self,
        hidden_size: int,
        moe: MoeConfig,
        topology: bj.Topology,
        *,
        dispatch: bj.MoeDispatch = bj.MoeDispatch.GATHER,
        capacity: int | None = None,
        impl: GroupedMatmulImpl = GroupedMatmulImpl.RAGGED_DOT,
        activation: Activation = ExpertActivation.SWIGLU,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        topology.experts_per_rank(moe.num_experts)  # raises for an EP size not dividing them
        own_rows = dispatch is bj.MoeDispatch.ALL_TO_ALL
        if capacity is not None and not own_rows:
            raise ValueError(f"capacity is an all-to-all setting; got {capacity=} with {dispatch}")
        width_entry = topology.shard_entry(bj.SumGroup.MOE_TP)
        if width_entry is not None and moe.expert_intermediate_size % topology.moe_tp:
            raise ValueError(
                f"the expert width ({moe.expert_intermediate_size}) must divide over moe_tp "
                f"({topology.moe_tp} = TP {topology.tp_size} / moe_ep {topology.moe_ep}); "
                "choose a larger moe_ep"
            )
        split_shared = splits_shared_expert(moe, topology, dispatch)
        super().__init__(
            hidden_size,
            moe.num_experts,
            moe.expert_intermediate_size,
            top_k=moe.top_k,
            renormalize=moe.renormalize,
            shared_width=moe.shared_expert_intermediate_size,
            shared_gated=moe.shared_expert_gate,
            expert_entry=topology.shard_entry(bj.SumGroup.MOE_EP),
            width_entry=width_entry,
            shared_width_entry=topology.shard_entry(bj.SumGroup.FULL_TP) if split_shared else None,
            zero_experts=moe.zero_experts,
            router_bias=moe.router_bias,
            expert_bias=moe.expert_bias,
            impl=impl,
            activation=activation,
            dtype=dtype,
            init_std=init_std,
            rngs=rngs,
        )
        self.topology = topology
        self.dispatch = dispatch
        self.capacity = capacity
        self.replicated = replicated_parts(moe, topology, dispatch)

    def __call__(
        self, x: jax.Array, *, defer: bool, counts: Counts
    ) -> jax.Array | bj.DeferredFinalize:
        """[T, hidden] normalized rows -> this rank's output: finalized, or a `DeferredFinalize`
        when `defer` (the exit's `defer_moe_finalize`).

        Args:
          x: The stage's compute input.
          defer: The exit's `defer_moe_finalize`.
          counts: The stage boundary's `counts(name, stream)` for the replicated parts its
            stage declares (`replicated_parts`).
        """
        counted = self.counted(counts)
        if self.dispatch is bj.MoeDispatch.ALL_TO_ALL:
            output = self._own_rows(x, counted)
            return deferred_finalize(output) if defer else finalize(output)
        local = self.gate_up_proj.shape[0]
        offset = bj.ops.shard_index(self.topology, bj.SumGroup.MOE_EP) * local
        if not defer:  # combined where the experts run (SparseMoe.finalized)
            return self.finalized(x, expert_offset=offset, counted=counted)
        return deferred_finalize(super().__call__(x, expert_offset=offset, counted=counted))

    def counted(self, counts: Counts) -> PartsCounted:
        """Which replicated parts this rank adds, as the stage boundary counts them; a part
        this MoE does not hold is counted everywhere (it adds nothing)."""

        def ask(name: str) -> bool | jax.Array:
            return counts(name) if name in {part.name for part in self.replicated} else True

        return PartsCounted(ask(SHARED_EXPERT), ask(ZERO_EXPERTS), ask(EXPERT_DOWN_BIAS))

    def _own_rows(self, x: jax.Array, counted: PartsCounted) -> MoeOutput:
        """Routes this rank's own rows, sends each choice to its expert's rank and back."""
        routing = self.route(x)
        tokens, top_k = routing.experts.shape
        local = self.gate_up_proj.shape[0]
        chosen = routing.experts.reshape(-1)
        dispatched = bj.ops.dispatch_to_experts(
            jnp.repeat(x, top_k, axis=0),
            chosen % local,
            # A zero-computation expert's choice is not sent; its answer comes back zero.
            jnp.where(chosen < self.num_experts, chosen // local, -1),
            self.topology,
            max_rows_per_rank=tokens * min(top_k, local),
            capacity=self.capacity,
        )
        received = dispatched.rows.shape[0]
        answers = self.routed(  # each received row is one choice of its tagged local expert
            dispatched.rows,
            Routing(jnp.ones((received, 1), jnp.float32), dispatched.tags[:, None]),
            # Each EP rank sends T * k rows, spread evenly over all experts; the width group's
            # ranks gather theirs.
            even_share=tokens * top_k * self.topology.moe_tp / local,
            count_down_bias=counted.down_bias,
        )[:, 0]
        returned = bj.ops.combine_from_experts(answers, dispatched, self.topology)
        shared = self._shared(x, routing, counted)
        return MoeOutput(returned.reshape(tokens, top_k, -1), routing, shared)
