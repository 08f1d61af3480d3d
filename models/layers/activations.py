"""What an expert (or a shared expert, or an ungated MLP) computes between its projections."""

from __future__ import annotations

import enum
from collections.abc import Callable

import jax
import jax.numpy as jnp


class ExpertActivation(enum.Enum):
    """What an expert (or a shared expert, or an ungated MLP) computes between its projections.

    SWIGLU: `silu(gate(x)) * up(x)`; its gate and up projections are two stacked parts.
    RELU2: `relu(up(x))^2`; its up projection is the one part (Nemotron-H).
    """

    SWIGLU = "swiglu"
    RELU2 = "relu2"

    @property
    def parts(self) -> int:
        """The projections stacked in the expert's first weight: gate and up, or up alone."""
        return 2 if self is ExpertActivation.SWIGLU else 1

    def apply(self, projected: jax.Array) -> jax.Array:
        """[..., parts x width] first-projection output -> [..., width] activation."""
        if self.parts == 1:
            return self.function(projected)
        gate, up = jnp.split(projected, 2, axis=-1)
        return self.function(gate) * up

    @property
    def function(self) -> Callable[[jax.Array], jax.Array]:
        """The elementwise function: SiLU on the gate, or `relu2` on the up projection."""
        return relu2 if self is ExpertActivation.RELU2 else jax.nn.silu


def relu2(x: jax.Array) -> jax.Array:
    """`relu(x)^2`, Nemotron-H's activation."""
    return jnp.square(jax.nn.relu(x))
