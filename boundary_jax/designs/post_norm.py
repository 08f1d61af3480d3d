"""The post-norm design: a plain read and the update `residual + norm(output)`.

Post-norm decoders (OLMo 2, EXAONE 4.0) normalize each stage's complete output before adding it;
the stage's compute reads the residual as it is (`AddNormRead` with no norm: append the stage
as `(declare_attn(update=PostNormUpdate(norm)), None)`). The norm is a parameter of the producer's
update, so its weight is state of the stage that owns the update, with gradients. The update is
not plain: the norm cannot move before the sum, so no fused add + norm kernel takes it and
`snapshot()` rejects it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .norm import RMSNorm, accumulation_dtype
from .protocols import ReadState


class PostNormUpdate(nnx.Module):
    """The update `residual + norm(value)`, added in FP32 and rounded to the residual's dtype.

    Attributes:
      norm: The norm applied to the complete output (HF `post_attention_layernorm` /
        `post_feedforward_layernorm` of a post-norm decoder).
    """

    plain = False

    def __init__(self, norm: RMSNorm):
        self.norm = norm

    def apply(self, residual: jax.Array, value: jax.Array, state: ReadState = None) -> jax.Array:
        acc = accumulation_dtype(jnp.promote_types(residual.dtype, value.dtype))
        return (residual.astype(acc) + self.norm(value).astype(acc)).astype(residual.dtype)
