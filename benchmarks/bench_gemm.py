"""Decode-sized weight matmuls on one GPU: XLA against a split-K Pallas kernel (issue 8).

A decode step multiplies 8-64 rows by each layer's weight shard; those matmuls read the
weights once and are bound by HBM. This measures how close XLA's own kernels come to the
bandwidth (its default choice, and cuBLAS alone), for the Llama-3-8B shapes a TP rank holds,
with the projections separate and fused (q/k/v in one matrix, gate/up in one), and against a
Pallas Triton kernel that splits K over programs so that even a narrow N fills the GPU.

    python3 -m benchmarks.bench_gemm --tp 1     # on the GPU machine (default: TP 2's shards)
    python3 -m benchmarks.bench_gemm --smoke    # CPU: the kernel in interpret mode, tiny shapes
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import header, kernel_ms, relative_error


def shapes(tp: int) -> tuple[tuple[str, int, int], ...]:
    """(name, K, N) of each weight shard a TP `tp` rank holds at the Llama-3-8B shape (hidden
    4096, 32 heads, 8 kv heads, head 128, intermediate 14336, vocab 128256)."""
    q, kv, ffn, vocab = 4096 // tp, 1024 // tp, 14336 // tp, 128256 // tp
    return (
        ("q", 4096, q),
        ("k or v", 4096, kv),
        ("qkv fused", 4096, q + 2 * kv),
        ("o", q, 4096),
        ("gate or up", 4096, ffn),
        ("gate+up fused", 4096, 2 * ffn),
        ("down", ffn, 4096),
        ("lm head", 4096, vocab),
    )


# (block_n, block_k, split_k, num_warps, num_stages)
CONFIGS = (
    (128, 128, 1, 4, 4),
    (128, 128, 4, 4, 4),
    (64, 256, 4, 4, 4),
    (128, 256, 2, 4, 4),
    (128, 256, 8, 4, 4),
    (256, 128, 4, 8, 4),
    (64, 128, 8, 4, 4),
    (256, 256, 2, 8, 3),
    (64, 128, 4, 4, 4),
    (128, 128, 2, 4, 4),
    (128, 128, 8, 4, 4),
    (64, 256, 8, 4, 3),
)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def split_k_matmul(x: jax.Array, w: jax.Array, *, config: tuple, interpret: bool = False):
    """x [M, K] @ w [K, N] with K split over `split_k` programs per N block, summed after."""
    from jax.experimental.pallas import triton as plgpu

    block_n, block_k, split_k, num_warps, num_stages = config
    m, k = x.shape
    n = w.shape[1]
    rows = max(16, -(-m // 16) * 16)
    x = jnp.pad(x, ((0, rows - m), (0, 0)))
    part = k // split_k
    if k % split_k or part % block_k or n % block_n:
        raise ValueError(f"config {config} does not tile K={k}, N={n}")

    def kernel(x_ref, w_ref, o_ref):
        def body(i, acc):
            xs = x_ref[:, pl.ds(i * block_k, block_k)]
            ws = w_ref[pl.ds(i * block_k, block_k), :]
            return acc + jnp.dot(xs, ws, preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, part // block_k, body, jnp.zeros((rows, block_n), jnp.float32))
        o_ref[0] = acc

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split_k, rows, n), jnp.float32),
        grid=(n // block_n, split_k),
        in_specs=[
            pl.BlockSpec((rows, part), lambda j, s: (0, s)),
            pl.BlockSpec((part, block_n), lambda j, s: (s, j)),
        ],
        out_specs=pl.BlockSpec((1, rows, block_n), lambda j, s: (s, 0, j)),
        compiler_params=None
        if interpret
        else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(x, w)
    return out.sum(0)[:m].astype(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--tp", type=int, default=2, help="the TP size whose shards to time")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args()
    if args.smoke:
        x = jax.random.normal(jax.random.key(0), (8, 256), jnp.float32)
        w = jax.random.normal(jax.random.key(1), (256, 128), jnp.float32)
        got = split_k_matmul(x, w, config=(64, 64, 2, 4, 3), interpret=True)
        print("smoke rel err", relative_error(got, x @ w))
        return
    print(header(f"decode-sized matmuls, one GPU, TP {args.tp} shards"))
    xla = jax.jit(lambda x, w: x @ w)
    columns = ("shape (K x N)", "M", "MB", "XLA us", "XLA TB/s", "cuBLAS us", "best Pallas us")
    print("| " + " | ".join((*columns, "TB/s", "config", "vs XLA")) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, k, n in shapes(args.tp):
        nbytes = k * n * 2
        copies = max(2, -(-240_000_000 // nbytes))
        ws = [
            jax.random.normal(jax.random.key(i), (k, n), jnp.bfloat16) / k**0.5
            for i in range(copies)
        ]
        for m in args.rows:
            x = jax.random.normal(jax.random.key(99), (m, k), jnp.bfloat16)
            sets = [(x, w) for w in ws]
            want = xla(x, ws[0])
            base = kernel_ms(xla, sets)
            cublas = (
                jax.jit(lambda x, w: x @ w)
                .lower(x, ws[0])
                .compile(compiler_options={"xla_gpu_enable_triton_gemm": False})
            )
            cublas_ms = kernel_ms(cublas, sets)
            best = None
            for config in CONFIGS:
                block_n, block_k, split_k = config[:3]
                if n % block_n or k % split_k or (k // split_k) % block_k:
                    continue
                fn = jax.jit(functools.partial(split_k_matmul, config=config))
                try:
                    err = relative_error(fn(x, ws[0]), want)
                except Exception as error:  # a config Triton cannot compile
                    print(f"  {name} M={m} {config}: {type(error).__name__}: {error}"[:300])
                    continue
                if err > 2e-2:
                    print(f"  {name} M={m} {config}: wrong (rel err {err:.1e})")
                    continue
                ms = kernel_ms(fn, sets)
                if best is None or ms < best[0]:
                    best = (ms, config)
            cells = [f"{name} ({k} x {n})", m, f"{nbytes / 1e6:.1f}"]
            cells += [f"{base * 1e3:.1f}", f"{nbytes / base / 1e9:.2f}", f"{cublas_ms * 1e3:.1f}"]
            if best is None:
                cells += ["-", "-", "-", "-"]
            else:
                ms, config = best
                cells += [f"{ms * 1e3:.1f}", f"{nbytes / ms / 1e9:.2f}", str(config)]
                cells.append(f"{base / ms:.2f}")
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
