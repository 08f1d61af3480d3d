"""Manifold-constrained hyper-connections (MHC), as in DeepSeek-V4: an expanded residual.

The residual is `hc_mult` streams per row, [rows, hc_mult, hidden]. Each stage's read computes
three weights from the streams (an RMS-normalized projection): `pre` collapses the streams into
the stage's input, `post` expands the stage's output back into streams, and `comb` (made doubly
stochastic by Sinkhorn iterations) mixes the input streams into the output streams. The read
hands `post` and `comb` to the same stage's update, `post * output + comb^T @ streams`, which is
nonlinear in the streams: no fused add + norm kernel takes it and `snapshot()` rejects it, and a
sum the output owes completes before it. `MhcHead` collapses the streams before the final norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..initializers import Constant, Normal, param
from .norm import accumulation_dtype
from .protocols import Norm


def _unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _flat_streams(streams: jax.Array, eps: float) -> jax.Array:
    """[rows, hc_mult * hidden]: the streams side by side, RMS-normalized, in FP32 or wider."""
    flat = streams.reshape(streams.shape[0], -1)
    return _unweighted_rms_norm(flat.astype(accumulation_dtype(flat.dtype)), eps)


class MhcRead(nnx.Module):
    """Collapses the streams into a stage's input and hands `(post, comb)` to its update.

    Attributes:
      hc_mult: Streams per row.
      projection: [(2 + hc_mult) * hc_mult, hc_mult * hidden] the projection of the normalized
        streams to the pre, post and comb logits (HF `fn`).
      base: [(2 + hc_mult) * hc_mult] their biases.
      scale: [3] the pre, post and comb logit scales.
      sinkhorn_iters: Sinkhorn iterations that make `comb` doubly stochastic.
      eps: Added to the weights and the normalizations.
      norm_eps: The RMS normalization's epsilon.
    """

    reads_before_dp_gather = True
    reads_after_attn_tp_gather = False
    completing_fusions = ()
    gathering_reads = ()  # the streams are read row by row
    input_format = None  # the collapsed streams feed a nonlinear mix: no quantized input

    def __init__(
        self,
        hidden: int,
        hc_mult: int,
        *,
        sinkhorn_iters: int = 20,
        eps: float = 1e-6,
        norm_eps: float = 1e-6,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        width = (2 + hc_mult) * hc_mult
        self.hc_mult = hc_mult
        self.projection = param(
            Normal((hc_mult * hidden) ** -0.5), (width, hc_mult * hidden), param_dtype, rngs=rngs
        )
        self.base = param(Constant(0.0), (width,), param_dtype)
        self.scale = param(Constant(1.0), (3,), param_dtype)
        self.sinkhorn_iters = sinkhorn_iters
        self.eps = eps
        self.norm_eps = norm_eps

    def weights(self, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`(pre [rows, hc], post [rows, hc], comb [rows, hc, hc])` in FP32 or wider."""
        hc = self.hc_mult
        flat = _flat_streams(streams, self.norm_eps)
        logits = flat @ self.projection[...].astype(flat.dtype).T
        base = self.base[...].astype(flat.dtype)
        pre_scale, post_scale, comb_scale = self.scale[...].astype(flat.dtype)
        pre = jax.nn.sigmoid(logits[:, :hc] * pre_scale + base[None, :hc]) + self.eps
        post = 2 * jax.nn.sigmoid(logits[:, hc : 2 * hc] * post_scale + base[None, hc : 2 * hc])
        comb_logits = logits[:, 2 * hc :].reshape(-1, hc, hc) * comb_scale
        comb = jax.nn.softmax(comb_logits + base[2 * hc :].reshape(1, hc, hc), axis=-1) + self.eps
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + self.eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + self.eps)
            comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + self.eps)
        return pre, post, comb

    def init_residual(
        self, x: jax.Array, norm: Norm | None
    ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
        """The stack input [rows, hidden] becomes `hc_mult` equal streams, then is read."""
        streams = jnp.broadcast_to(x[:, None, :], (x.shape[0], self.hc_mult, x.shape[1]))
        return self.read(streams, norm)

    def read(
        self, residual: jax.Array, norm: Norm | None
    ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
        pre, post, comb = self.weights(residual)
        collapsed = jnp.einsum("rk,rkd->rd", pre, residual.astype(pre.dtype)).astype(residual.dtype)
        return (collapsed if norm is None else norm(collapsed)), residual, (post, comb)

    def update_and_read(self, update, value, residual, norm, state):
        return self.read(update.apply(residual, value, state), norm)


class MhcUpdate(nnx.Module):
    """The update `post * output + comb^T @ streams`, with the weights its stage's read made.

    Stateless itself: its weights are the read's state, handed on through the stream.
    """

    plain = False
    applied_at_exit = False

    def apply(
        self, residual: jax.Array, value: jax.Array, state: tuple[jax.Array, jax.Array]
    ) -> jax.Array:
        post, comb = state
        dtype = residual.dtype
        expanded = post.astype(dtype)[:, :, None] * value.astype(dtype)[:, None, :]
        return expanded + jnp.einsum("rjk,rjd->rkd", comb.astype(dtype), residual)


class MhcHead(nnx.Module):
    """Collapses the streams before the final norm (HF `DeepseekV4HyperHead`), then applies it.

    Pass it as the norm of `final_norm`: the stack's final read applies it to the streams.

    Attributes:
      hc_mult: Streams per row.
      projection: [hc_mult, hc_mult * hidden] (HF `hc_fn`).
      base: [hc_mult] (HF `hc_base`).
      scale: [1] (HF `hc_scale`).
      norm: The final norm applied to the collapsed rows (None: none).
      eps: Added to the collapse weights.
      norm_eps: The RMS normalization's epsilon.
    """

    def __init__(
        self,
        hidden: int,
        hc_mult: int,
        norm: Norm | None,
        *,
        eps: float = 1e-6,
        norm_eps: float = 1e-6,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.hc_mult = hc_mult
        self.projection = param(
            Normal((hc_mult * hidden) ** -0.5), (hc_mult, hc_mult * hidden), param_dtype, rngs=rngs
        )
        self.base = param(Constant(0.0), (hc_mult,), param_dtype)
        self.scale = param(Constant(1.0), (1,), param_dtype)
        self.norm = norm
        self.eps = eps
        self.norm_eps = norm_eps

    def collapse(self, streams: jax.Array) -> jax.Array:
        """[rows, hidden]: the streams weighted by their sigmoid collapse weights."""
        flat = _flat_streams(streams, self.norm_eps)
        logits = flat @ self.projection[...].astype(flat.dtype).T
        scale, base = self.scale[...].astype(flat.dtype), self.base[...].astype(flat.dtype)
        pre = jax.nn.sigmoid(logits * scale[0] + base[None, :]) + self.eps
        return jnp.einsum("rk,rkd->rd", pre, streams.astype(pre.dtype)).astype(streams.dtype)

    def __call__(self, streams: jax.Array) -> jax.Array:
        collapsed = self.collapse(streams)
        return collapsed if self.norm is None else self.norm(collapsed)
