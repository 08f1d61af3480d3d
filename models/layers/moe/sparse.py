"""The mixture-of-experts FFN of one rank as NNX modules (`SparseMoe`, `SharedExpert`), and its
float64 NumPy spec (`moe_reference`).

The modules hold the parameters and call pure functions: the router and the combine (`Routing`,
`route`, `MoeOutput`, `finalize`, `zero_expert_output`) are `models.layers.moe.routing`'s, the
routed experts' grouped matmuls (`expert_outputs`, `finalized_expert_outputs`)
`models.layers.moe.experts`'s; the shared expert's (`shared_expert`) sit here, beside its
module.

Everything here is the compute of ONE rank and owns no communication: no collective and no mesh
axis name. A rank holds a block of the experts and possibly a slice of each one's width, and
returns per token and per top-k choice the chosen expert's output, zero where it holds none of
that expert (`models.layers.moe.experts`). The boundary completes the rest: the sum over the
expert-parallel and width-parallel ranks (a psum, reduce-scatter, or the combine of an
all-to-all), and the finalize, the weighted sum over the k choices, which may be deferred and
fused with the next residual add and norm.

The math, as Hugging Face transformers 5 computes it for a softmax top-k router:

    probs = softmax(float32(x @ router))              # [T, E], over ALL experts
    weights, experts = top_k(probs, k)                # descending; ties to the lower index
    weights /= sum(weights)   if renormalize          # HF norm_topk_prob
    y[t] = sum_j weights[t, j] * expert[experts[t, j]](x[t])
           + sigmoid(x[t] @ shared_gate) * shared_expert(x[t])    # a gated shared expert
    expert_e(x) = (silu(x @ gate_e) * (x @ up_e)) @ down_e      (ExpertActivation.SWIGLU)
    expert_e(x) = relu(x @ up_e)^2 @ down_e                    (RELU2: Nemotron-H, no gate)
    expert_e(x) = x    for e >= num_experts    (zero-computation experts: LongCat-Flash)

With `router_bias` the logits add a bias; with `expert_bias` each expert's projections add
theirs (`models.layers.moe.experts.ExpertBiases`: GPT-OSS, with its clamped SwiGLU).

A zero-computation expert has no weights: no rank holds it, so the grouped matmuls and the
all-to-all skip its choices (their expert outputs are zero), and its part of the combine,
`x * sum of its choices' weights` (`zero_expert_output`), joins the shared expert's slot,
counted once like a shared expert every rank computes whole.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from boundary_jax.initializers import Normal, param
from pallas_kernels.grouped_matmul import GroupedMatmulImpl

from ..activations import ExpertActivation
from .experts import Activation, ExpertBiases, expert_outputs, finalized_expert_outputs
from .routing import MoeOutput, Routing, route, zero_expert_output

PartitionEntry = str | tuple[str, ...] | None
"""One entry of a `PartitionSpec`: mesh axis name(s) chosen by the caller, or None."""


def shared_expert(
    x: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    expert_gate: jax.Array | None = None,
    *,
    activation: ExpertActivation = ExpertActivation.SWIGLU,
) -> jax.Array:
    """This rank's share of a shared expert: `down(silu(gate(x)) * up(x))`, or for RELU2
    `down(relu(up(x))^2)`; optionally sigmoid-gated.

    Args:
      x: [T, hidden] complete token rows.
      gate_up: [hidden, parts, width]: the gate and up projections stacked (one matmul), or the
        up projection alone for RELU2 (`activation.parts`); `width` may be a slice of the
        intermediate features, in which case the output is this rank's partial sum.
      down: [width, hidden] the down projection, same slice.
      expert_gate: [hidden, 1] HF `shared_expert_gate`, whole on every rank: the output
        is scaled by `sigmoid(x @ expert_gate)` per token (a per-token scale, so the partial sums
        stay partial sums); None for no gate.
      activation: What the expert computes between its projections.

    Returns:
      [T, hidden] in `x.dtype`, owing the sum over the ranks the width is split over. A shared
      expert computed whole on every rank of a group must be counted once by the caller (added
      on one rank only).

    Raises:
      ValueError: `gate_up` does not stack `activation.parts` projections.
    """
    hidden, parts, width = gate_up.shape
    if parts != activation.parts:
        raise ValueError(
            f"a {activation.value} shared expert stacks {activation.parts} projection(s) in "
            f"gate_up [hidden, parts, width]; got {gate_up.shape}"
        )
    out = activation.apply(x @ gate_up.reshape(hidden, parts * width)) @ down
    if expert_gate is not None:
        out = jax.nn.sigmoid(x @ expert_gate) * out
    return out


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
    width (`gate_up` [E, hidden, 2, width], `down` [E, width, hidden]; `shared` is the shared
    expert's (`gate_up` [hidden, 2, width], `down` [width, hidden])).

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
        gate_up, d = (np.asarray(a, np.float64) for a in shared)
        g, u = np.moveaxis(gate_up, 1, 0)
        shared_out = (silu(x @ g) * (x @ u)) @ d
        if shared_gate is not None:
            shared_out = shared_out / (1 + np.exp(-(x @ np.asarray(shared_gate, np.float64))))
        out += shared_out
    return out


# --------------------------------------------------------------------------------------------
# The NNX module
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PartsCounted:
    """Which replicated parts of a MoE's output this rank adds (each a bool, or a traced bool
    inside `shard_map`): a part every rank of a sum computes whole is added on one of them
    (`boundary_jax.declare.Replicated`; `ffn.MoeFfn` asks its stage boundary). All True on one
    device.

    Attributes:
      shared: The shared expert's output, where this rank computes it whole.
      zero: The zero-computation experts' part.
      down_bias: The routed experts' down biases, where this rank holds them whole beside the
        other ranks of an expert's width.
    """

    shared: bool | jax.Array = True
    zero: bool | jax.Array = True
    down_bias: bool | jax.Array = True


class SharedExpert(nnx.Module):
    """A SwiGLU (or relu^2 MLP) every token goes through, width optionally split, optionally
    sigmoid-gated.

    Attributes:
      gate_up_proj: [hidden, parts, width] global: the gate and up projections stacked (the up
        projection alone for RELU2), columns split over `width_entry`.
      down_proj: [width, hidden] global, rows split over `width_entry`.
      activation: What the expert computes between its projections.
      expert_gate: [hidden, 1], whole on every rank (HF `shared_expert_gate`), or None.

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
        self.activation = activation
        self.gate_up_proj = _param(
            rngs,
            (hidden_size, activation.parts, width),
            (None, None, width_entry),
            dtype,
            std=std,
            fan_in=hidden_size,
        )
        self.down_proj = _param(rngs, (width, hidden_size), (width_entry, None), dtype, std=std)
        self.expert_gate = (
            _param(rngs, (hidden_size, 1), (None, None), dtype, std=std) if gated else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """[T, hidden] -> [T, hidden], this rank's share (see `shared_expert`)."""
        expert_gate = None if self.expert_gate is None else self.expert_gate[...]
        return shared_expert(
            x,
            self.gate_up_proj[...],
            self.down_proj[...],
            expert_gate,
            activation=self.activation,
        )


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
      router_bias: [num_experts + zero_experts], replicated, added to the logits; or None.
      gate_up_proj_bias: [num_experts, parts, width] global, split as `gate_up_proj`'s expert
        and width axes; or None.
      down_proj_bias: [num_experts, hidden] global, split over `expert_entry`, whole on every
        rank of the width group (added on one of them: `PartsCounted.down_bias`); or None.

    Every weight is drawn from N(0, init_std^2) (None: std 1/sqrt(fan_in)); so are the
    biases, which transformers starts at zero, so that one used wrongly shows in tests.
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
        router_bias: bool = False,
        expert_bias: bool = False,
        impl: GroupedMatmulImpl = GroupedMatmulImpl.RAGGED_DOT,
        activation: Activation = ExpertActivation.SWIGLU,
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
        bias_std = 1 / np.sqrt(hidden_size) if init_std is None else init_std
        self.router_bias = (
            param(Normal(bias_std), (scored,), dtype, rngs=rngs, sharding=(None,))
            if router_bias
            else None
        )
        self.gate_up_proj_bias = (
            param(
                Normal(bias_std),
                (num_experts, activation.parts, expert_width),
                dtype,
                rngs=rngs,
                sharding=(expert_entry, None, width_entry),
            )
            if expert_bias
            else None
        )
        self.down_proj_bias = (
            param(
                Normal(bias_std),
                (num_experts, hidden_size),
                dtype,
                rngs=rngs,
                sharding=(expert_entry, None),
            )
            if expert_bias
            else None
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
        counted: PartsCounted = PartsCounted(),
    ) -> MoeOutput:
        """[T, hidden] complete rows -> this rank's `MoeOutput` (unfinalized, owing the sum).

        Args:
          x: [T, hidden] token rows, the same on every rank that splits these experts.
          expert_offset: Global id of this rank's first local expert (0 when the experts are
            not split); the caller computes it, e.g. `axis_index * local_experts`.
          counted: Which replicated parts this rank adds (all, on one device).
        """
        routing = self.route(x)
        outputs = self.routed(
            x, routing, count_down_bias=counted.down_bias, **self._settings(x, expert_offset)
        )
        return MoeOutput(outputs, routing, self._shared(x, routing, counted))

    def finalized(
        self,
        x: jax.Array,
        *,
        expert_offset: int | jax.Array = 0,
        counted: PartsCounted = PartsCounted(),
    ) -> jax.Array:
        """[T, hidden] complete rows -> this rank's finalized share, owing the sum:
        `finalize(self(x, expert_offset=...))`, combined inside the expert computation
        (`finalized_expert_outputs`).

        Args:
          x, expert_offset, counted: As for `__call__`.
        """
        routing = self.route(x)
        return self.routed(
            x,
            routing,
            shared=self._shared(x, routing, counted),
            combine=True,
            count_down_bias=counted.down_bias,
            **self._settings(x, expert_offset),
        )

    def route(self, x: jax.Array) -> Routing:
        """[T, hidden] complete rows -> their `Routing` (alike on every rank): the softmax
        top-k of `route`; a subclass with another router overrides it."""
        bias = None if self.router_bias is None else self.router_bias[...]
        return route(x, self.router[...], top_k=self.top_k, renormalize=self.renormalize, bias=bias)

    def init_experts(
        self,
        num_experts: int,
        hidden_size: int,
        expert_width: int,
        *,
        expert_entry: PartitionEntry,
        width_entry: PartitionEntry,
        activation: Activation,
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
        count_down_bias: bool | jax.Array = True,
    ) -> jax.Array:
        """This rank's experts applied to rows `x` as `routing` chose them: `expert_outputs`
        [T, k, hidden], or with `combine` their finalize with `shared` added
        (`finalized_expert_outputs`, [T, hidden]).

        Args:
          x, routing, expert_offset, even_share: As for `expert_outputs`.
          shared: With `combine`, this rank's shared-expert share, or None.
          combine: Return the finalized [T, hidden] rather than the per-choice outputs.
          count_down_bias: Whether this rank adds its experts' down biases
            (`PartsCounted.down_bias`).
        """
        weights = (self.gate_up_proj[...], self.down_proj[...])
        settings = {
            "expert_offset": expert_offset,
            "impl": self.impl,
            "even_share": even_share,
            "activation": self.activation,
            "biases": self.expert_biases(count_down_bias),
        }
        if combine:
            return finalized_expert_outputs(x, routing, *weights, shared=shared, **settings)
        return expert_outputs(x, routing, *weights, **settings)

    def expert_biases(self, count_down_bias: bool | jax.Array = True) -> ExpertBiases | None:
        """This rank's experts' biases, the down bias zero where `count_down_bias` says this
        rank does not add it; None without expert biases."""
        if self.gate_up_proj_bias is None:
            return None
        down = self.down_proj_bias[...]
        down = jnp.where(count_down_bias, down, jnp.zeros_like(down))
        return ExpertBiases(self.gate_up_proj_bias[...], down)

    def _shared(
        self,
        x: jax.Array,
        routing: Routing,
        counted: PartsCounted,
    ) -> jax.Array | None:
        """What joins the combine beside the routed experts: the shared expert's share of rows
        `x` and the zero-computation experts' part, each zero on a rank that does not count
        it; None for a MoE with neither."""
        parts = []
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            parts.append(jnp.where(counted.shared, shared, jnp.zeros_like(shared)))
        if self.zero_experts:
            zero = zero_expert_output(x, routing, self.num_experts)
            parts.append(jnp.where(counted.zero, zero, jnp.zeros_like(zero)))
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
