"""Stage outputs that still owe producer-specific work: the deferred MoE finalize."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .designs.norm import accumulation_dtype


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["expert_outputs", "weights"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class DeferredFinalize:
    """A sparse FFN's output before its top-k combine: the finalize travels as array leaves.

    A MoE returns one when its exit's `defer_moe_finalize` is True; the boundary runs `complete`
    where the plan says (the next input, or the final norm), before any sum the output owes.

    Attributes:
      expert_outputs: [rows, top_k, hidden] each row's outputs of the experts it was routed to
        (zero for experts this rank does not hold).
      weights: [rows, top_k] the routing weights of those experts.
    """

    expert_outputs: jax.Array
    weights: jax.Array

    def __post_init__(self):
        outputs, weights = self.expert_outputs, self.weights
        shapes = getattr(outputs, "shape", None), getattr(weights, "shape", None)
        if None in shapes or isinstance(outputs, jax.ShapeDtypeStruct):
            return
        if outputs.ndim != 3 or weights.shape != outputs.shape[:2]:
            raise ValueError(
                "a DeferredFinalize holds expert_outputs [rows, top_k, hidden] and weights "
                f"[rows, top_k]; got {outputs.shape=} and {weights.shape=}"
            )

    @property
    def rows(self) -> int:
        return self.expert_outputs.shape[0]

    def complete(self) -> jax.Array:
        """The unfused finalize: `sum_k weights[:, k] * expert_outputs[:, k]`, summed in FP32."""
        acc = accumulation_dtype(self.expert_outputs.dtype)
        combined = jnp.einsum(
            "rkh,rk->rh", self.expert_outputs.astype(acc), self.weights.astype(acc)
        )
        return combined.astype(self.expert_outputs.dtype)
