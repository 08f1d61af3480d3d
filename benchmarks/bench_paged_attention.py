"""Paged decode attention on the GPU: where the pages lie (JAX's Pallas paged kernel) against
gathering each row's pages for cuDNN, with cuDNN's decode over a contiguous cache as the floor.

Llama-3-8B's attention (32 query heads over 8 kv heads, head_dim 128, bf16), `--rows` decode
rows, each at the last position of its own context, its pages scattered over a shuffled pool.
Per (context, page size):

  contiguous cuDNN  `decode_attention_cudnn` on a [rows, context, kv, D] cache (the floor)
  kernel            the Pallas kernel alone, on pools already laid out kv-major
  kernel + T        `attend_paged_kernel`: the pools transposed from the cache's layout first
  gather + cuDNN    `attend_paged_cudnn`: each row's pages gathered, then cuDNN's decode
  jnp               `attend_paged`, the reference the serving step runs today

Columns: device ms (CUPTI), the floor's time over it, the KV bytes the rows read per second,
and the largest difference from the `jnp` reference (bf16).

  JAX_PLATFORMS=cuda,cpu python3 -m benchmarks.bench_paged_attention      # one H200
  python3 -m benchmarks.bench_paged_attention --smoke   # CPU: tiny, the interpreted kernel only
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from models.layers.attention.cudnn import decode_attention_cudnn
from models.layers.attention.paged import PagedKVCache, attend_paged
from models.layers.attention.paged_gpu import (
    attend_paged_cudnn,
    attend_paged_kernel,
    kernel_blocks,
)
from pallas_kernels.compat import pallas_paged_attention
from pallas_kernels.impl import Impl

from .common import header, kernel_ms, print_table

KV, GROUP, HEAD_DIM = 8, 4, 128


def inputs(rows: int, context: int, page_size: int, dtype):
    """Queries, the paged cache (each row its own sequence, pages shuffled over the pool) and
    the same keys and values contiguous."""
    per_row = context // page_size
    pages = rows * per_row
    keys = jax.random.split(jax.random.key(0), 3)
    k = jax.random.normal(keys[0], (pages, page_size, KV, HEAD_DIM), dtype)
    v = jax.random.normal(keys[1], (pages, page_size, KV, HEAD_DIM), dtype)
    table = np.random.default_rng(0).permutation(pages).reshape(rows, per_row).astype(np.int32)
    q = jax.random.normal(keys[2], (rows, KV, GROUP, HEAD_DIM), dtype)
    cache = PagedKVCache(k, v, jnp.asarray(table))
    contiguous = tuple(x[table].reshape(rows, context, KV, HEAD_DIM) for x in (k, v))
    positions = jnp.full((rows,), context - 1, jnp.int32)
    segments = jnp.arange(rows, dtype=jnp.int32)
    return q, cache, contiguous, positions, segments


def forms(args, page_size: int, on_gpu: bool):
    """(name, fn(q, cache, contiguous, positions, segments)) of each form timed."""
    scale = HEAD_DIM**-0.5
    impl = Impl.PALLAS_TRITON if on_gpu else Impl.PALLAS_INTERPRET
    block = max(1, args.compute_positions // page_size)

    def floor(q, cache, contiguous, positions, segments):
        rows = q.shape[0]
        out = decode_attention_cudnn(
            q.reshape(rows, KV * GROUP, HEAD_DIM),
            *contiguous,
            positions + 1,
            grouped=True,
            scale=scale,
        )
        return out.reshape(q.shape)

    def kernel_alone(q, k_major, v_major, table, lengths):
        padded, splits, blocks = kernel_blocks(table.shape[1], args.k_splits, block)
        rows = q.shape[0]
        out = pallas_paged_attention()(
            (q * scale).reshape(rows, KV * GROUP, HEAD_DIM),
            k_major,
            v_major,
            jnp.pad(table, ((0, 0), (0, padded - table.shape[1]))),
            lengths,
            k_splits=splits,
            pages_per_compute_block=blocks,
            interpret=not on_gpu,
        )
        return out.reshape(q.shape)

    def kernel(q, cache, contiguous, positions, segments):
        return attend_paged_kernel(
            q,
            cache,
            positions,
            segments,
            scale=scale,
            impl=impl,
            k_splits=args.k_splits,
            pages_per_compute_block=block,
        )

    def gathered(q, cache, contiguous, positions, segments):
        return attend_paged_cudnn(q, cache, positions, segments, scale=scale)

    def reference(q, cache, contiguous, positions, segments):
        return attend_paged(q, cache, positions, segments, scale=scale)

    listed = [("kernel", kernel_alone), ("kernel + T", kernel), ("jnp", reference)]
    if on_gpu:
        listed = [("contiguous cuDNN", floor), *listed[:2], ("gather + cuDNN", gathered), listed[2]]
    return [(name, jax.jit(fn)) for name, fn in listed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU (interpreted)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=(1024, 4096))
    parser.add_argument("--page-sizes", type=int, nargs="+", default=(16, 64))
    parser.add_argument("--k-splits", type=int, default=16, help="the kernel's splits")
    parser.add_argument(
        "--compute-positions", type=int, default=128, help="positions per kernel compute block"
    )
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    if args.smoke:
        args.rows, args.contexts, args.page_sizes, args.k_splits = 2, (64,), (16,), 2
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    print(header(f"bench_paged_attention: {KV * GROUP}/{KV} heads, {jnp.dtype(dtype).name}"))
    rows = []
    for context in args.contexts:
        for page_size in args.page_sizes:
            q, cache, contiguous, positions, segments = inputs(args.rows, context, page_size, dtype)
            lengths = (positions + 1).astype(jnp.int32)
            k_major, v_major = (x.transpose(2, 0, 1, 3) for x in (cache.k, cache.v))
            want = np.asarray(
                attend_paged(q, cache, positions, segments, scale=HEAD_DIM**-0.5), np.float32
            )
            kv_bytes = 2 * args.rows * context * KV * HEAD_DIM * jnp.dtype(dtype).itemsize
            floor_ms = None
            for name, fn in forms(args, page_size, on_gpu):
                call_args = (
                    (q, k_major, v_major, cache.page_table, lengths)
                    if name == "kernel"
                    else (q, cache, contiguous, positions, segments)
                )
                got = np.asarray(fn(*call_args), np.float32)
                error = float(np.abs(got - want).max())
                ms = kernel_ms(fn, [call_args], repeats=20) if on_gpu else float("nan")
                floor_ms = ms if name == "contiguous cuDNN" else floor_ms
                rows.append(
                    [
                        f"{args.rows} @ {context}",
                        page_size,
                        name,
                        f"{ms:.3f}",
                        f"{floor_ms / ms:.2f}" if floor_ms else "-",
                        f"{kv_bytes / ms / 1e6:.0f}" if on_gpu else "-",
                        f"{error:.1e}",
                    ]
                )
    print_table(
        ["rows @ context", "page", "form", "ms", "floor / form", "KV GB/s", "max diff vs jnp"],
        rows,
    )


if __name__ == "__main__":
    main()
