"""The post-norm design: a plain read and the update `residual + norm(output)`.

Post-norm decoders (OLMo 2, EXAONE 4.0) normalize each stage's complete output before adding it;
the stage's compute reads the residual as it is (`AddNormRead` with no norm). The update is the
norm itself, a module of the layer (`self.post_attn_norm = PostNormUpdate(hidden)`, appended as
`(declare_attn(update=self.post_attn_norm), None)` with `owner=self`), so its weight is the
layer's state, with gradients. The update is not plain: the norm cannot move before the sum, so
no fused add + norm kernel takes it and `snapshot()` rejects it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import round_residual

from .norm import RMSNorm, accumulation_dtype
from .protocols import ReadState


class PostNormUpdate(RMSNorm):
    """The update `residual + norm(value)`, added in FP32 and rounded to the residual's dtype:
    an `RMSNorm` (HF `post_attention_layernorm` / `post_feedforward_layernorm` of a post-norm
    decoder) whose norm of the complete output joins the residual."""

    plain = False
    applied_at_exit = False

    def apply(self, residual: jax.Array, value: jax.Array, state: ReadState = None) -> jax.Array:
        acc = accumulation_dtype(jnp.promote_types(residual.dtype, value.dtype))
        return round_residual(residual.astype(acc) + self(value).astype(acc), residual.dtype)
