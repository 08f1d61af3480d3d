"""Attention kernels on rows: causal visibility, masked softmax attention, packed prefill.

Each takes optional attention sinks: one learned logit per head that joins the softmax's
denominator only (no value), so a head may put weight on nothing (GPT-OSS):

    weights[s] = exp(score[s]) / (exp(sink) + sum_s' exp(score[s']))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

PREFILL_KEY_BLOCK = 64
"""Query rows per block of the `jnp` prefill when a static reach bounds its keys."""


def causal_visibility(
    query_positions: jax.Array, key_positions: jax.Array, sliding_window: int | None = None
) -> jax.Array:
    """[..., T, S] causal (and sliding-window) visibility of key positions [..., S] from query
    positions [..., T]: `0 <= query - key (< sliding_window)`."""
    distance = query_positions[..., :, None] - key_positions[..., None, :]
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    return visible


def attend_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    max_sequence_rows: int | None = None,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention within each sequence of packed rows (the `jnp` prefill of `Attention`
    and of `models.layers.attention.latent`); v's head width may differ from q's.

    Rows of a sequence are contiguous, so a row's keys lie at most `reach - 1` rows back, where
    `reach` is the shorter of the bounds `max_sequence_rows` and `sliding_window`. When that
    reach is static and well short of T, queries go in blocks of `block` rows and each block
    attends to the `width` key blocks ending at its own, so scores cost T x width * block
    instead of T x T (forward and backward).

    Args:
      q: [T, kv, group, D] queries, grouped by the kv head they use.
      k: [T, kv, D] keys.
      v: [T, kv, Dv] values.
      positions: [T] position of each row in its sequence; rows of a sequence contiguous.
      segment_ids: [T] sequence of each row; -1 for padding (zero output).
      scale: Factor of the scores.
      max_sequence_rows: Static bound on a sequence's rows, or None.
      sliding_window: A row attends to the `sliding_window` positions ending at its own; None
        for full causal attention.
      sinks: [kv, group] each head's sink logit, or None.

    Returns:
      [T, kv, group, Dv].
    """
    rows = q.shape[0]
    bounds = [b for b in (max_sequence_rows, sliding_window) if b is not None]
    reach = min(bounds) if bounds else rows
    block = min(PREFILL_KEY_BLOCK, 1 << max(reach - 1, 1).bit_length())
    width = -(-(reach - 1) // block) + 1
    if width * block >= rows:
        mask = segment_ids[:, None] == segment_ids[None, :]
        mask &= causal_visibility(positions, positions, sliding_window)
        mask &= (segment_ids >= 0)[:, None]
        return attend(q, k, v, mask, "skd", scale, sinks=sinks)
    blocks = -(-rows // block)
    pad = blocks * block - rows

    def blocked(x: jax.Array, fill: int) -> jax.Array:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(blocks, block, *x.shape[1:])

    def windows(x: jax.Array, fill: int) -> jax.Array:
        """[blocks, block, ...] -> [blocks, width * block, ...]: key blocks i-width+1..i."""
        before = jnp.full((width - 1, *x.shape[1:]), fill, x.dtype)
        x = jnp.concatenate([before, x])
        stacked = jnp.stack([x[j : j + blocks] for j in range(width)], axis=1)
        return stacked.reshape(blocks, width * block, *x.shape[2:])

    segments, where = blocked(segment_ids, -1), blocked(positions, 0)
    mask = segments[:, :, None] == windows(segments, -1)[:, None, :]
    mask &= causal_visibility(where, windows(where, 0), sliding_window)
    mask &= (segments >= 0)[:, :, None]
    out = attend_blocks(
        blocked(q, 0), windows(blocked(k, 0), 0), windows(blocked(v, 0), 0), mask, scale, sinks
    )
    return out.reshape(blocks * block, *out.shape[2:])[:rows]


def accumulation_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """FP32 accumulation, or the input's dtype where that is wider: the dtype of attention
    scores and weighted sums here (and in `models.layers.attention.latent`)."""
    return jnp.promote_types(dtype, jnp.float32)


def attend(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    key_axes: str,
    scale: float,
    *,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Softmax(q k^T * scale) v with FP32 scores and weights.

    q is [T, kv, group, D]; keys/values are [S, kv, D] (`key_axes` "skd") or one set per row,
    [T, S, kv, D] ("tskd"); mask is [T, S]; sinks (or None) is [kv, group], each head's sink
    logit in the denominator. Returns [T, kv, group, D].
    """
    acc = accumulation_dtype(q.dtype)
    scores = jnp.einsum(f"tkgd,{key_axes}->tkgs", q, keys, preferred_element_type=acc)
    probs = _masked_softmax(scores * scale, mask, sinks)
    return jnp.einsum(
        f"tkgs,{key_axes}->tkgd", probs.astype(values.dtype), values, preferred_element_type=acc
    )


def attend_latent(
    q: jax.Array, latents: jax.Array, mask: jax.Array, scale: float, value_width: int
) -> jax.Array:
    """`attend` for one shared key per position whose value is its first `value_width` columns
    (MLA's absorbed decode over its latent cache): q [T, heads, C], latents [T, S, C] (one set
    per row), mask [T, S]. Returns [T, heads, value_width].

    The weights multiply the whole latent rows and the output keeps the first columns, so the
    cache is read as it is, never copied into a value slice."""
    acc = accumulation_dtype(q.dtype)
    scores = jnp.einsum("thc,tsc->ths", q, latents, preferred_element_type=acc)
    probs = _masked_softmax(scores[:, None] * scale, mask)[:, 0]
    out = jnp.einsum(
        "ths,tsc->thc", probs.astype(latents.dtype), latents, preferred_element_type=acc
    )
    return out[..., :value_width]


def attend_blocks(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    scale: float,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`attend` per query block: q [N, B, kv, group, D] against that block's keys and values
    [N, S, kv, D] under mask [N, B, S] (sinks as `attend`'s). Returns [N, B, kv, group, D]."""
    acc = accumulation_dtype(q.dtype)
    scores = jnp.einsum("nbkgd,nskd->nbkgs", q, keys, preferred_element_type=acc)
    probs = _masked_softmax(scores * scale, mask, sinks)
    return jnp.einsum(
        "nbkgs,nskd->nbkgd", probs.astype(values.dtype), values, preferred_element_type=acc
    )


def _masked_softmax(
    scores: jax.Array, mask: jax.Array, sinks: jax.Array | None = None
) -> jax.Array:
    """Softmax of [..., T, kv, group, S] scores over S where `mask` [..., T, S] allows, with
    each head's sink logit (`sinks` [kv, group], or None) in the denominator only; all-masked
    rows (padding) get all-zero weights, with no NaN in the value or its gradient."""
    allowed = mask[..., :, None, None, :]
    scores = jnp.where(allowed, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    sink = None
    if sinks is not None:  # [..., 1, kv, group, 1], in the scores' dtype
        sink = sinks.astype(scores.dtype).reshape((1,) * (scores.ndim - 3) + (*sinks.shape, 1))
        peak = jnp.maximum(peak, sink)  # as transformers: the max over scores and sink
    peak = lax.stop_gradient(jnp.where(jnp.isfinite(peak), peak, 0.0))
    weights = jnp.exp(scores - peak)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - peak)
    return weights / jnp.where(total > 0, total, 1.0)
