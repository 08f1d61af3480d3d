"""cuDNN fused attention (GPU): packed variable-length causal prefill and decode over a cache,
with or without a sliding window and attention sinks.

cuDNN's attention has no sink term, but it returns each row's log-sum-exp `L` of its scaled
scores; a sink logit `s` in the denominator scales the row's output by
`exp(L) / (exp(L) + exp(s)) = sigmoid(L - s)`. cuDNN's backward ignores a cotangent on `L`, so
a layer with sinks takes its gradient from the `jnp` reference (`attend`, `attend_packed`) over
the same rows: exact, at the reference's cost, in training only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.compat import cudnn_fused_attention
from pallas_kernels.vjp import with_reference_vjp

from .attend import attend, attend_packed
from .kv_cache import KVCache

_cudnn = cudnn_fused_attention()


@functools.cache
def max_head_dim() -> int:
    """The widest query/key head cuDNN's flash attention takes on this machine's GPU: 256 from
    Hopper (compute capability 9.0) on, 128 before; 128 without an NVIDIA GPU."""
    try:
        capability = getattr(jax.devices("gpu")[0], "compute_capability", None)
    except RuntimeError:
        return 128
    return 256 if capability is not None and float(capability) >= 9.0 else 128


@dataclasses.dataclass(frozen=True)
class _Prefill:
    """The static form of one packed prefill call (see `prefill_attention_cudnn`)."""

    max_segments: int
    scale: float
    window_rows: int | None
    sliding_window: int | None


def prefill_attention_cudnn(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    max_segments: int,
    scale: float,
    window_rows: int | None = None,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention within each segment of packed rows, through cuDNN.

    q is [T, heads, D], k [T, kv, D], v [T, kv, Dv] with Dv <= D (latent attention's value is
    narrower than its key); returns [T, heads, Dv]. Each segment must be contiguous with
    positions 0, 1, ... (causality is by row order), and the rows packed from row 0
    (`RowsPhase.PREFILL`); padding rows (-1) come out 0. Segment ids must be < `max_segments`
    (static). `sliding_window`: a row attends to the `sliding_window` rows ending at its own.
    `sinks`: [heads] each query head's sink logit, or None (needs Dv == D).

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
    form = _Prefill(max_segments, scale, window_rows, sliding_window)
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    if sinks is None:
        return _prefill(q, k, v, segment_ids, form, with_stats=False)[0]
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"attention sinks need a value as wide as the key; got {v.shape=}")

    def fused(q, k, v, sinks, segment_ids):
        out, stats = _prefill(q, k, v, segment_ids, form, with_stats=True)
        return _sunk(out, stats, sinks)

    def reference(q, k, v, sinks, segment_ids):
        rows = jnp.arange(segment_ids.shape[0], dtype=jnp.int32)
        seg = jnp.where(segment_ids >= 0, segment_ids, max_segments)
        first = jax.ops.segment_min(rows, seg, max_segments + 1)
        out = attend_packed(
            _grouped(q, k),
            k,
            v,
            rows - first[seg],
            segment_ids,
            scale=scale,
            sliding_window=sliding_window,
            sinks=sinks.reshape(k.shape[1], -1),
        )
        return out.reshape(q.shape).astype(q.dtype)

    return with_reference_vjp(fused, reference)(q, k, v, sinks, segment_ids)


def _prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    form: _Prefill,
    *,
    with_stats: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """`prefill_attention_cudnn` without sinks: the output [T, heads, Dv] and, `with_stats`,
    each row's log-sum-exp of its scaled scores [T, heads] (None otherwise)."""
    valid = (segment_ids >= 0)[:, None, None]
    rows = segment_ids.shape[0]
    if form.window_rows is not None or form.max_segments == 1:
        window = rows if form.window_rows is None else form.window_rows
        # Padding rows after one segment attend to it: their outputs are zeroed after.
        value = v if form.window_rows is None else jnp.where(valid, v, 0)
        out, stats = _causal_windows(q, k, value, window, form, with_stats)
        return jnp.where(valid, out, 0) if form.window_rows is None else out, stats
    width, v_width = q.shape[-1], v.shape[-1]
    if v_width < width:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, width - v_width)))
    segments = form.max_segments
    index = jnp.arange(rows, dtype=jnp.int32)
    seg = jnp.where(segment_ids >= 0, segment_ids, segments)
    lengths = jax.ops.segment_sum(jnp.ones(rows, jnp.int32), seg, segments + 1)[:segments]
    first = jax.ops.segment_min(index, seg, segments + 1)[:segments]
    # cuDNN wants the segments in row order, the real ones first, the rest -1.
    first = jnp.where(lengths > 0, first, rows)
    order = jnp.argsort(first)
    offsets = jnp.where(lengths[order] > 0, first[order], -1)
    offsets = jnp.concatenate([offsets, jnp.full((1,), -1, jnp.int32)])[None]
    seqlen = jnp.where(lengths[order] > 0, lengths[order], -1)[None]
    result = _cudnn.dot_product_attention(
        q[None],
        k[None],
        v[None],
        q_seqlen=seqlen,
        kv_seqlen=seqlen,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=form.scale,
        mask_type=_cudnn.MaskType.PADDING_CAUSAL,
        sliding_window_length=form.sliding_window,
        return_residual=with_stats,
    )
    out, stats = (result[0], result[1]) if with_stats else (result, None)
    if stats is not None:
        # [segments, heads, T]: segment j (in row order) keeps its rows' stats from column 0.
        rank = jnp.argsort(order)
        entry = jnp.minimum(seg, segments - 1)
        local = jnp.clip(index - first[entry], 0, rows - 1)
        stats = stats[rank[entry], :, local]
    # cuDNN leaves rows outside every segment unwritten.
    return jnp.where(valid, out[0, ..., :v_width], 0), stats


def _causal_windows(
    q: jax.Array, k: jax.Array, v: jax.Array, window: int, form: _Prefill, with_stats: bool
) -> tuple[jax.Array, jax.Array | None]:
    """Causal attention within consecutive windows of `window` rows; rows past the last whole
    window (padding) come out 0. With `with_stats` also each row's log-sum-exp [T, heads]."""
    rows, heads = q.shape[:2]
    whole = rows // window * window
    if whole == 0:
        out = jnp.zeros((rows, heads, v.shape[-1]), q.dtype)
        return out, jnp.zeros((rows, heads), jnp.float32) if with_stats else None

    def grid(x: jax.Array) -> jax.Array:
        return x[:whole].reshape(whole // window, window, *x.shape[1:])

    result = _cudnn.dot_product_attention(
        grid(q),
        grid(k),
        grid(v),
        scale=form.scale,
        mask_type=_cudnn.MaskType.CAUSAL,
        sliding_window_length=form.sliding_window,
        return_residual=with_stats,
    )
    out, stats = (result[0], result[1]) if with_stats else (result, None)
    out = jnp.pad(out.reshape(whole, *out.shape[2:]), ((0, rows - whole), (0, 0), (0, 0)))
    if stats is not None:  # [windows, heads, window]
        stats = jnp.pad(stats.transpose(0, 2, 1).reshape(whole, heads), ((0, rows - whole), (0, 0)))
    return out, stats


def decode_cache_cudnn(
    q: jax.Array,
    cache: KVCache,
    positions: jax.Array,
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Row i's query [heads, D] over slot i's cached keys 0..positions[i] (the last
    `sliding_window` of them with a window), through cuDNN; `sinks` as `prefill_attention_cudnn`'s.

    The cache is read in place ([slots, max_len, kv, D] is cuDNN's BSNH layout); a window shorter
    than the cache is first gathered per row (`window_of_cache`). An idle row reads its slot's
    first key.
    """
    k_cache, v_cache = cache.k.astype(q.dtype), cache.v.astype(q.dtype)
    max_len = k_cache.shape[1]
    last = jnp.minimum(positions, max_len - 1)
    if sliding_window is not None and sliding_window < max_len:
        k_cache, v_cache, start = window_of_cache(k_cache, v_cache, positions, sliding_window)
        lengths = last - start + 1
    else:
        lengths = last + 1
    lengths = jnp.maximum(lengths, 1).astype(jnp.int32)
    if sinks is None:
        return decode_attention_cudnn(q, k_cache, v_cache, lengths, scale=scale)

    def fused(q, k, v, sinks, lengths):
        out, stats = _cudnn.dot_product_attention(
            q[:, None],
            k,
            v,
            q_seqlen=jnp.ones_like(lengths),
            kv_seqlen=lengths,
            scale=scale,
            mask_type=_cudnn.MaskType.PADDING,
            return_residual=True,
        )
        return _sunk(out[:, 0], stats[..., 0], sinks)

    def reference(q, k, v, sinks, lengths):
        mask = jnp.arange(k.shape[1])[None, :] < lengths[:, None]
        out = attend(_grouped(q, k), k, v, mask, "tskd", scale, sinks=sinks.reshape(k.shape[2], -1))
        return out.reshape(q.shape).astype(q.dtype)

    return with_reference_vjp(fused, reference)(q, k_cache, v_cache, sinks, lengths)


def window_of_cache(
    k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, window: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's last `window` cached keys and values ([B, window, kv, D] each, from cache
    position `start` [B] on): row b's keys at positions `start[b]`.. `positions[b]`, a prefix of
    its window (positions past the cache read its last entry and are to be masked)."""
    start = jnp.maximum(positions - window + 1, 0)
    at = jnp.minimum(start[:, None] + jnp.arange(window)[None, :], k_cache.shape[1] - 1)
    rows = jnp.arange(k_cache.shape[0])[:, None]
    return k_cache[rows, at], v_cache[rows, at], start


def _grouped(q: jax.Array, k: jax.Array) -> jax.Array:
    """[..., heads, D] -> [..., kv, group, D], k's heads being the kv heads (its axis -2)."""
    return q.reshape(*q.shape[:-2], k.shape[-2], -1, q.shape[-1])


def _sunk(out: jax.Array, stats: jax.Array, sinks: jax.Array) -> jax.Array:
    """cuDNN's output [..., heads, D] with each head's sink in its denominator, from the rows'
    log-sum-exp `stats` [..., heads]."""
    sinks = sinks.astype(jnp.float32).reshape((1,) * (stats.ndim - 1) + sinks.shape)
    keep = jax.nn.sigmoid(stats - sinks)
    return (out.astype(jnp.float32) * keep[..., None]).astype(out.dtype)


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
