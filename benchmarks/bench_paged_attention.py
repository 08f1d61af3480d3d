"""Paged attention on the GPU: the Pallas kernel reading pages where they lie, against each
row's pages gathered for cuDNN, with cuDNN over a contiguous cache as the floor.

Llama-3-8B's attention (32 query heads over 8 kv heads, head_dim 128, bf16), pages of
`--page-sizes` positions scattered over a shuffled pool. Two steps per context:

  decode  `--rows` sequences, one row each at the last position of its context.
  mixed   a serving step under a 512-row budget: one prompt chunk (`--chunk` rows ending at
          the context) and `--rows - 1` decode rows of other sequences.

Forms:

  contiguous cuDNN  cuDNN's decode over [rows, context, kv, D] (decode only: the floor)
  kernel q/k        `ragged_paged_attention` with q query rows per program and k positions
                    per step of its walk (`--query-rows`, `--key-positions`)
  gather + cuDNN    each row's pages gathered into a contiguous view, then cuDNN's decode
                    (decode only: the mixed step's chunk rows would each copy the context)
  jnp               `attend_paged`, the reference

Columns: device ms (CUPTI), the floor's time over it, the KV bytes the sequences hold per
second of it, and the largest difference from the reference.

  JAX_PLATFORMS=cuda,cpu python3 -m benchmarks.bench_paged_attention      # one H200
  python3 -m benchmarks.bench_paged_attention --smoke   # CPU: tiny, the interpreted kernel
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.layers.attention.cudnn import decode_attention_cudnn
from models.layers.attention.paged import PagedKVCache, attend_paged
from pallas_kernels.paged_attention import ragged_paged_attention

from .common import header, kernel_ms, print_table

KV, GROUP, HEAD_DIM = 8, 4, 128
SCALE = HEAD_DIM**-0.5


def step_inputs(rows: int, context: int, page_size: int, chunk: int, dtype):
    """Queries, positions, slots and the paged cache (each sequence its own pages, shuffled
    over the pool) of a decode step (`chunk` 0) or a mixed one; the contiguous cache too."""
    per_sequence = context // page_size
    sequences = rows  # a mixed step: the chunk's sequence and rows - 1 decoding ones
    pages = sequences * per_sequence
    keys = jax.random.split(jax.random.key(0), 3)
    k = jax.random.normal(keys[0], (pages, page_size, KV, HEAD_DIM), dtype)
    v = jax.random.normal(keys[1], (pages, page_size, KV, HEAD_DIM), dtype)
    table = np.random.default_rng(0).permutation(pages).reshape(sequences, per_sequence)
    cache = PagedKVCache(k, v, jnp.asarray(table, jnp.int32))
    if chunk:
        segments = np.concatenate([np.zeros(chunk), np.arange(1, rows)]).astype(np.int32)
        positions = np.concatenate(
            [np.arange(context - chunk, context), np.full(rows - 1, context - 1)]
        ).astype(np.int32)
    else:
        segments = np.arange(rows, dtype=np.int32)
        positions = np.full(rows, context - 1, np.int32)
    q = jax.random.normal(keys[2], (len(segments), KV, GROUP, HEAD_DIM), dtype)
    contiguous = tuple(x[table].reshape(sequences, context, KV, HEAD_DIM) for x in (k, v))
    return q, cache, contiguous, jnp.asarray(positions), jnp.asarray(segments)


def gathered_cudnn(q, cache, positions, segments):
    """Each row's pages gathered into [rows, pages * page_size, kv, D], then cuDNN's decode."""
    rows = q.shape[0]
    keys, values = cache.gather(segments)
    out = decode_attention_cudnn(
        q.reshape(rows, KV * GROUP, HEAD_DIM),
        keys,
        values,
        positions + 1,
        grouped=True,
        scale=SCALE,
    )
    return out.reshape(q.shape)


def forms(args, page_size: int, mixed: bool, on_gpu: bool):
    """(name, jitted fn(q, cache, contiguous, positions, segments)) of each form timed."""

    def floor(q, cache, contiguous, positions, segments):
        rows = q.shape[0]
        out = decode_attention_cudnn(
            q.reshape(rows, KV * GROUP, HEAD_DIM),
            *contiguous,
            positions + 1,
            grouped=True,
            scale=SCALE,
        )
        return out.reshape(q.shape)

    def kernel(query_rows, key_positions, q, cache, contiguous, positions, segments):
        return ragged_paged_attention(
            q,
            cache.k,
            cache.v,
            cache.page_table,
            positions,
            segments,
            scale=SCALE,
            rows_per_block=max(1, query_rows // GROUP),
            pages_per_block=max(1, key_positions // page_size),
            interpret=not on_gpu,
        )

    def reference(q, cache, contiguous, positions, segments):
        return attend_paged(q, cache, positions, segments, scale=SCALE)

    listed = [("contiguous cuDNN", floor)] if on_gpu and not mixed else []
    listed += [
        (f"kernel {query_rows}/{keys}", functools.partial(kernel, query_rows, keys))
        for query_rows in args.query_rows
        for keys in args.key_positions
    ]
    if on_gpu and not mixed:
        listed.append(("gather + cuDNN", lambda q, c, _, p, s: gathered_cudnn(q, c, p, s)))
    listed.append(("jnp", reference))
    return [(name, jax.jit(fn)) for name, fn in listed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU (interpreted)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=449, help="the mixed step's chunk rows")
    parser.add_argument("--contexts", type=int, nargs="+", default=(1024, 4096))
    parser.add_argument("--page-sizes", type=int, nargs="+", default=(16,))
    parser.add_argument("--query-rows", type=int, nargs="+", default=(16, 64))
    parser.add_argument("--key-positions", type=int, nargs="+", default=(64, 128))
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    if args.smoke:
        args.rows, args.chunk, args.contexts, args.page_sizes = 3, 5, (32,), (16,)
        args.query_rows, args.key_positions = (16,), (16,)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    print(header(f"bench_paged_attention: {KV * GROUP}/{KV} heads, {jnp.dtype(dtype).name}"))
    table = []
    for context in args.contexts:
        for page_size in args.page_sizes:
            for step, chunk in (("decode", 0), ("mixed", args.chunk)):
                inputs = step_inputs(args.rows, context, page_size, chunk, dtype)
                q, cache, contiguous, positions, segments = inputs
                want = np.asarray(attend_paged(q, cache, positions, segments, scale=SCALE))
                sequences = contiguous[0].shape[0]
                kv_bytes = 2 * sequences * context * KV * HEAD_DIM * jnp.dtype(dtype).itemsize
                floor_ms = None
                for name, fn in forms(args, page_size, chunk > 0, on_gpu):
                    got = np.asarray(fn(*inputs), np.float32)
                    error = float(np.abs(got - want.astype(np.float32)).max())
                    ms = kernel_ms(fn, [inputs], repeats=20) if on_gpu else float("nan")
                    floor_ms = ms if name == "contiguous cuDNN" else floor_ms
                    table.append(
                        [
                            f"{step} {args.rows} @ {context}",
                            page_size,
                            name,
                            f"{ms:.3f}",
                            f"{floor_ms / ms:.2f}" if floor_ms else "-",
                            f"{kv_bytes / ms / 1e6:.0f}" if on_gpu else "-",
                            f"{error:.1e}",
                        ]
                    )
    print_table(["step", "page", "form", "ms", "floor / form", "KV GB/s", "max diff vs jnp"], table)


if __name__ == "__main__":
    main()
