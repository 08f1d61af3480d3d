"""GPU forms of `attend_paged`: the paged cache read where its pages lie by JAX's shipped Pallas
paged decode kernel (`attend_paged_kernel`), or each row's pages gathered into a contiguous
view for cuDNN (`attend_paged_cudnn`).

Both take `attend_paged`'s arguments and treat every row as one decode query over its
sequence's positions 0..position (a prompt chunk's rows too: each row is causal on its own), so
they are exact for `RowsPhase.EXTEND` rows. Neither takes a sliding window or sinks: those
layers stay on the `jnp` reference (`attend_paged`), and these functions refuse them.

The Pallas kernel reads pools laid out [kv heads, pages, page_size, head_dim]; the cache keeps
[pages, page_size, kv heads, head_dim] (pages split over attention DP), so the wrapper
transposes the pools on every call. `benchmarks/bench_paged_attention.py` times both forms
with and without that transpose against the contiguous-cache cuDNN decode.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.compat import pallas_paged_attention
from pallas_kernels.impl import Impl

from .cudnn import decode_attention_cudnn
from .paged import PagedKVCache

KERNEL_IMPLS = (Impl.PALLAS_TRITON, Impl.PALLAS_INTERPRET)
"""The backends `attend_paged_kernel` runs on: the Triton kernel, or its body interpreted."""


def _refuse_unsupported(sliding_window: int | None, sinks: jax.Array | None, name: str) -> None:
    if sliding_window is not None or sinks is not None:
        raise NotImplementedError(
            f"{name} attends to every position up to the row's own, without sinks; got "
            f"{sliding_window=}, sinks given: {sinks is not None}. Use attend_paged (the jnp "
            "reference) for layers with a sliding window or sinks"
        )


def kernel_blocks(pages: int, k_splits: int, pages_per_compute_block: int) -> tuple[int, int, int]:
    """(padded pages per sequence, k_splits, pages per compute block) that the Pallas kernel
    accepts for a page table `pages` wide: the splits at most `pages`, the table padded to a
    multiple of them, the compute block a divisor of each split."""
    splits = max(1, min(k_splits, pages))
    padded = -(-pages // splits) * splits
    block = math.gcd(padded // splits, pages_per_compute_block)
    return padded, splits, block


@functools.partial(
    jax.jit, static_argnames=("scale", "impl", "k_splits", "pages_per_compute_block")
)
def attend_paged_kernel(
    q: jax.Array,
    cache: PagedKVCache,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    impl: Impl = Impl.PALLAS_TRITON,
    k_splits: int = 16,
    pages_per_compute_block: int = 8,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`attend_paged` by JAX's Pallas paged decode kernel, each row one query.

    Args:
      q: [T, kv, group, D] queries, grouped by the kv head they use.
      cache: The layer's cache, holding this call's keys already.
      positions: [T] position of each row in its sequence.
      segment_ids: [T] slot of each row's sequence; -1 for padding (zero output).
      scale: Factor of the scores.
      impl: PALLAS_TRITON (GPU), or PALLAS_INTERPRET (the same kernel interpreted, any platform).
      k_splits: Parts of each sequence's pages the kernel reduces in parallel (see
        `kernel_blocks`).
      pages_per_compute_block: Pages per step of the kernel's inner loop (see `kernel_blocks`).
      sliding_window: Must be None.
      sinks: Must be None.

    Returns:
      [T, kv, group, D].

    Raises:
      NotImplementedError: A sliding window or sinks; on the GPU, compute blocks under 16
        positions (small pages).
      ValueError: An impl other than KERNEL_IMPLS.
    """
    _refuse_unsupported(sliding_window, sinks, "attend_paged_kernel")
    if impl not in KERNEL_IMPLS:
        raise ValueError(f"attend_paged_kernel runs on {KERNEL_IMPLS}; got {impl=}")
    rows, kv, group, head_dim = q.shape
    valid = segment_ids >= 0
    table = cache.page_table[jnp.maximum(segment_ids, 0)]  # [T, pages per sequence]
    padded, splits, block = kernel_blocks(table.shape[1], k_splits, pages_per_compute_block)
    if impl is Impl.PALLAS_TRITON and block * cache.k.shape[1] < 16:
        raise NotImplementedError(
            "the Triton kernel's dots take blocks of >= 16 positions; got pages of "
            f"{cache.k.shape[1]} positions, {block} per compute block. Use pages of >= 16 "
            "positions or a wider page table (attend_paged_cudnn takes any)"
        )
    table = jnp.pad(table, ((0, 0), (0, padded - table.shape[1])))
    lengths = jnp.where(valid, positions + 1, 0).astype(jnp.int32)
    out = pallas_paged_attention()(
        (q * scale).reshape(rows, kv * group, head_dim),
        cache.k.transpose(2, 0, 1, 3).astype(q.dtype),
        cache.v.transpose(2, 0, 1, 3).astype(q.dtype),
        table,
        lengths,
        k_splits=splits,
        pages_per_compute_block=block,
        interpret=impl is Impl.PALLAS_INTERPRET,
    )
    out = out.reshape(rows, kv, group, head_dim)
    return jnp.where(valid[:, None, None, None], out, 0).astype(q.dtype)


def attend_paged_cudnn(
    q: jax.Array,
    cache: PagedKVCache,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`attend_paged` with each row's pages gathered into a contiguous view
    ([T, pages per sequence * page_size, kv, D]) for cuDNN's decode attention (GPU only).

    Arguments and result as `attend_paged_kernel`'s (without its tiling).

    Raises:
      NotImplementedError: A sliding window or sinks.
    """
    _refuse_unsupported(sliding_window, sinks, "attend_paged_cudnn")
    rows, kv, group, head_dim = q.shape
    keys, values = cache.gather(segment_ids)
    valid = segment_ids >= 0
    # cuDNN takes lengths >= 1: padding rows read position 0 and are zeroed after.
    lengths = jnp.where(valid, positions + 1, 1).astype(jnp.int32)
    out = decode_attention_cudnn(
        q.reshape(rows, kv * group, head_dim),
        keys.astype(q.dtype),
        values.astype(q.dtype),
        lengths,
        grouped=True,
        scale=scale,
    )
    out = out.reshape(rows, kv, group, head_dim)
    return jnp.where(valid[:, None, None, None], out, 0).astype(q.dtype)
