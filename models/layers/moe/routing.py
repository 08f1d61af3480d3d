"""A MoE's routing and combine, around the experts: which experts each token goes to, and how
their outputs come back together.

`route` picks each token's top-k experts (a `Routing`, alike on every rank); the experts a rank
holds (`models.layers.moe.experts`) hand on a `MoeOutput`, their per-choice outputs,
unweighted; and `finalize` combines it: the weighted sum over the k choices, plus the shared
expert's slot (where the zero-computation experts' part, `zero_expert_output`, joins it). Pure
functions of one rank, with no collective and no mesh axis name.

Because the finalize is linear, it commutes with the sum over the ranks the experts are split over:
`finalize(sum_r outputs_r) == sum_r finalize(outputs_r)`; the boundary may do either.

The math, as Hugging Face transformers 5 computes it for a softmax top-k router:

    probs = softmax(float32(x @ router (+ bias)))     # [T, E], over ALL experts
    weights, experts = top_k(probs, k)                # descending; ties to the lower index
    weights /= sum(weights)   if renormalize          # HF norm_topk_prob
    y[t] = sum_j weights[t, j] * expert_outputs[t, j] + shared[t]

A router with a bias and renormalized weights is GPT-OSS's, which transformers writes as a softmax
over the top-k logits: the same weights, since softmax is monotone and its normalizer cancels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


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


def route(
    x: jax.Array,
    router: jax.Array,
    *,
    top_k: int,
    renormalize: bool,
    bias: jax.Array | None = None,
) -> Routing:
    """Softmax over all experts, then top-k, then (optionally) renormalisation of the k weights.

    Args:
      x: [T, hidden] complete token rows.
      router: [hidden, num_experts] the router's kernel, the whole of it (every rank routes every
        token to all experts, so every rank holds the same routing).
      top_k: Experts per token.
      renormalize: Divide the k weights by their sum (HF `norm_topk_prob`); False keeps the
        softmax probabilities as they are.
      bias: [num_experts] added to the logits (whole on every rank), or None.

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
    logits = x @ router.astype(x.dtype)
    if bias is not None:
        if bias.shape != router.shape[1:]:
            raise ValueError(
                f"bias must be [num_experts] of router {router.shape}; got {bias.shape}"
            )
        logits = logits + bias.astype(x.dtype)[None]
    logits = logits.astype(_accumulation_dtype(x.dtype))
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights=weights, experts=experts.astype(jnp.int32))


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


def _accumulation_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _check_rank(array: jax.Array, rank: int, what: str) -> None:
    if array.ndim != rank:
        raise ValueError(f"{what} must have rank {rank}; got shape {array.shape}")
