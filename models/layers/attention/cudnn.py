"""cuDNN fused attention (GPU): packed variable-length causal prefill and decode over a cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.compat import cudnn_fused_attention

from .kv_cache import KVCache

_cudnn = cudnn_fused_attention()


def prefill_attention_cudnn(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    max_segments: int,
    scale: float,
    window_rows: int | None = None,
) -> jax.Array:
    """Causal attention within each segment of packed rows, through cuDNN.

    q is [T, heads, D], k [T, kv, D], v [T, kv, Dv] with Dv <= D (latent attention's value is
    narrower than its key); returns [T, heads, Dv]. Each segment must be contiguous with
    positions 0, 1, ... (causality is by row order), and the rows packed from row 0
    (`RowsPhase.PREFILL`); padding rows (-1) come out 0. Segment ids must be < `max_segments`
    (static).

    cuDNN takes the rows in one of two forms (`benchmarks/RESULTS.md`, runs 21 and 26):
    - Windows, when every segment fills a window from its first row: `window_rows` (static)
      rows each (`TokenRows.window_rows`), or all T rows for a single segment. The rows go as
      [T // window_rows, window_rows] under a plain causal mask, the fastest form, and the
      value as it is. A window is then one segment or all padding, so zeroing the padding
      rows' values zeroes their outputs: a pass over the value instead of the wider output.
    - The ragged layout otherwise: one batch row, each segment found by its offset and length.
      cuDNN schedules work for every segment entry, so a tight `max_segments` (the cache slots)
      keeps empty entries cheap, and it skips the score blocks between segments, so packing
      costs no T x T work. JAX computes the value's offsets with the key's row stride, so a
      narrower value is zero-padded to the key's width.
    """
    if window_rows is not None and window_rows < 1:
        raise ValueError(f"window_rows must be >= 1; got {window_rows}")
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    valid = (segment_ids >= 0)[:, None, None]
    if window_rows is not None:
        return _causal_windows(q, k, jnp.where(valid, v, 0), window_rows, scale)
    if max_segments == 1:
        # Padding rows after the one segment attend to it.
        return jnp.where(valid, _causal_windows(q, k, v, q.shape[0], scale), 0)
    width, v_width = q.shape[-1], v.shape[-1]
    if v_width < width:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, width - v_width)))
    rows = segment_ids.shape[0]
    segments = max_segments
    index = jnp.arange(rows, dtype=jnp.int32)
    seg = jnp.where(segment_ids >= 0, segment_ids, segments)
    lengths = jax.ops.segment_sum(jnp.ones(rows, jnp.int32), seg, segments + 1)[:segments]
    first = jax.ops.segment_min(index, seg, segments + 1)[:segments]
    # cuDNN wants the segments in row order, the real ones first, the rest -1.
    first = jnp.where(lengths > 0, first, rows)
    order = jnp.argsort(first)
    first, lengths = first[order], lengths[order]
    offsets = jnp.where(lengths > 0, first, -1)
    offsets = jnp.concatenate([offsets, jnp.full((1,), -1, jnp.int32)])[None]
    seqlen = jnp.where(lengths > 0, lengths, -1)[None]
    out = _cudnn.dot_product_attention(
        q[None],
        k[None],
        v[None],
        q_seqlen=seqlen,
        kv_seqlen=seqlen,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=scale,
        mask_type=_cudnn.MaskType.PADDING_CAUSAL,
    )
    # cuDNN leaves rows outside every segment unwritten.
    return jnp.where(valid, out[0, ..., :v_width], 0)


def _causal_windows(
    q: jax.Array, k: jax.Array, v: jax.Array, window: int, scale: float
) -> jax.Array:
    """Causal attention within consecutive windows of `window` rows; rows past the last whole
    window (padding) come out 0."""
    rows = q.shape[0]
    whole = rows // window * window
    if whole == 0:
        return jnp.zeros((*q.shape[:2], v.shape[-1]), q.dtype)

    def grid(x: jax.Array) -> jax.Array:
        return x[:whole].reshape(whole // window, window, *x.shape[1:])

    out = _cudnn.dot_product_attention(
        grid(q), grid(k), grid(v), scale=scale, mask_type=_cudnn.MaskType.CAUSAL
    )
    out = out.reshape(whole, *out.shape[2:])
    return jnp.pad(out, ((0, rows - whole), (0, 0), (0, 0)))


def decode_cache_cudnn(
    q: jax.Array, cache: KVCache, positions: jax.Array, scale: float
) -> jax.Array:
    """Row i's query [heads, D] over slot i's cached keys 0..positions[i], through cuDNN.

    The cache is read in place ([slots, max_len, kv, D] is cuDNN's BSNH layout); an idle row
    reads its slot's first key.
    """
    lengths = jnp.clip(positions + 1, 1, cache.k.shape[1]).astype(jnp.int32)
    return decode_attention_cudnn(
        q, cache.k.astype(q.dtype), cache.v.astype(q.dtype), lengths, scale=scale
    )


def decode_attention_cudnn(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    grouped: bool = False,
    scale: float | None = None,
) -> jax.Array:
    """One query row per slot over its cache: [B, heads, D] x [B, S, kv, D] -> [B, heads, D].

    Slot b attends to keys 0..lengths[b]-1 (lengths >= 1); scores are scaled by `scale` (None:
    `D ** -0.5`). With `grouped`, the
    query heads that share a kv head become that many query rows of one kv head: cuDNN then
    reads each slot's keys once per kv head, instead of once per query head.
    """
    batch, heads, head_dim = q.shape
    kv = k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    if not grouped:
        out = jax.nn.dot_product_attention(
            q[:, None],
            k_cache,
            v_cache,
            scale=scale,
            query_seq_lengths=jnp.ones_like(lengths),
            key_value_seq_lengths=lengths,
            implementation="cudnn",
        )
        return out[:, 0]
    group = heads // kv
    rows = q.reshape(batch, kv, group, head_dim).transpose(0, 2, 1, 3)  # [B, group, kv, D]
    out = jax.nn.dot_product_attention(
        rows,
        k_cache,
        v_cache,
        scale=scale,
        query_seq_lengths=jnp.full_like(lengths, group),
        key_value_seq_lengths=lengths,
        implementation="cudnn",
    )
    return out.transpose(0, 2, 1, 3).reshape(batch, heads, head_dim)
