"""The clamped SwiGLU an expert may compute between its projections (GPT-OSS's experts):

    gate = min(gate, limit);  up = clip(up, -limit, limit)
    out = (up + 1) * gate * sigmoid(alpha * gate)

It stands where an `ExpertActivation` stands (`parts`, `apply`, `value`): the expert's gate and up
projections are two stacked parts, and `apply` takes their outputs side by side ([..., gate |
up]). A checkpoint that interleaves the two (gate the even columns, up the odd ones) is read
into that stacked layout by the loader (`models.config.tensors.HFTensor.interleaved`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from .activations import biased_parts


@dataclasses.dataclass(frozen=True)
class ClampedSwiGlu:
    """`(clip(up) + 1) * clamped_gate * sigmoid(alpha * clamped_gate)`: static and hashable.

    Attributes:
      limit: The gate is clamped above at `limit`, the up projection to [-limit, limit] (> 0).
      alpha: The sigmoid's gain (1.702 in GPT-OSS).
      parts: The projections stacked in the expert's first weight: gate and up.
      value: The activation's name in messages.
    """

    limit: float
    alpha: float = 1.702
    parts: ClassVar[int] = 2
    value: ClassVar[str] = "clamped SwiGLU"

    def __post_init__(self):
        if not self.limit > 0:
            raise ValueError(f"the clamped SwiGLU's limit must be positive; got {self.limit=}")

    def apply(self, projected: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        """[..., 2 x width] gate | up projection outputs, plus `bias` (broadcast against them)
        where given -> [..., width], in their dtype."""
        gate, up = biased_parts(projected, bias, 2)
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(self.alpha * gate))
