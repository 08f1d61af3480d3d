"""The gated delta rule (Gated DeltaNet) over packed rows: the chunked WY / UT form against a
row-by-row `lax.scan` of the recurrence, at 4096 and 32768 rows (issue 45 asks for >= 20x on
one H200); the chunked form carries its state across chunks with a `jnp` `lax.scan` or with
the Pallas Triton kernel (`pallas_kernels.delta_rule_scan`), both timed, each with the terms
between its matmuls stored in float32 and in bf16 (flash-linear-attention's, and the default
for these bf16 inputs).

The shapes are one Qwen3-Next-80B-A3B Gated DeltaNet layer on one GPU (16 key heads of 128, 32
value heads of 128; bf16 q, k, v, float32 gates and state): four sequences packed into the
rows, so that the chunked form also pays for its sequence resets and per-slot final states.

    python3 -m benchmarks.bench_delta_rule            # on the GPU machine
    python3 -m benchmarks.bench_delta_rule --smoke    # CPU: tiny shapes, the two forms compared
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from models.layers.mixers.delta_rule import gated_delta_rule_chunked, gated_delta_rule_reference

from .common import header, kernel_ms, print_table, relative_error

K_HEADS, V_HEADS, K_DIM, V_DIM = 16, 32, 128, 128
ROWS = (4096, 32768)
SHARES = (0.5, 0.25, 0.17)  # of the rows, for three sequences; the fourth takes the rest
CHUNKS = (64,)
STORAGES = (jnp.float32, jnp.bfloat16)  # the chunked form's row-sized terms (bf16 the default here)


def lengths_of(rows: int) -> tuple[int, ...]:
    """Four sequence lengths that fill `rows`."""
    first = [int(rows * share) for share in SHARES]
    return (*first, rows - sum(first))


def inputs(rows: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, dtype):
    """Random delta-rule inputs over packed rows (positions and segment ids as `TokenRows`
    gives): gates -exp(a) softplus(x), write strengths sigmoid(x)."""
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (rows, k_heads, k_dim), dtype)
    k = jax.random.normal(keys[1], (rows, k_heads, k_dim), dtype)
    v = jax.random.normal(keys[2], (rows, v_heads, v_dim), dtype)
    g = -jax.nn.softplus(jax.random.normal(keys[3], (rows, v_heads)) - 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (rows, v_heads)))
    lengths = lengths_of(rows)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    segments = np.concatenate([np.full(n, s) for s, n in enumerate(lengths)]).astype(np.int32)
    return q, k, v, g, beta, jnp.asarray(positions), jnp.asarray(segments)


def chunked_flops(rows: int, chunk: int, v_heads: int, k_dim: int, v_dim: int) -> float:
    """Multiply-adds x 2 of the chunked form's matmuls (the triangular solves as full ones)."""
    padded = -(-rows // chunk) * chunk
    pairs = padded * chunk * v_heads * k_dim  # k_beta k^T, q k^T
    solves = padded * chunk * v_heads * (k_dim + v_dim)  # U and W
    state = padded * v_heads * k_dim * v_dim  # W S, q S, k^T new (each)
    within = padded * chunk * v_heads * v_dim  # scores @ new
    return 2.0 * (2 * pairs + solves + 3 * state + within)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    args = parser.parse_args()
    if args.smoke:
        shape, all_rows, chunks = (2, 4, 16, 16), (96, 200), (16, 32)
        scans = ("jnp", "interpret")
    else:
        shape, all_rows, chunks = (K_HEADS, V_HEADS, K_DIM, V_DIM), ROWS, CHUNKS
        scans = ("jnp", "pallas")
    slots = len(SHARES) + 1
    print(header(f"gated delta rule, k_heads/v_heads/k_dim/v_dim {shape}"))
    table = []
    for rows in all_rows:
        args_ = inputs(rows, *shape, jnp.bfloat16)
        reference = jax.jit(functools.partial(gated_delta_rule_reference, num_slots=slots))
        want = reference(*args_)
        base = kernel_ms(reference, [args_], wall=True, repeats=4)
        table.append((rows, "lax.scan, row by row", "-", base, "-", 1.0, 0.0))
        for chunk in chunks:
            for scan, storage in itertools.product(scans, STORAGES):
                fn = jax.jit(
                    functools.partial(
                        gated_delta_rule_chunked,
                        chunk_size=chunk,
                        num_slots=slots,
                        scan=scan,
                        storage=storage,
                    )
                )
                err = relative_error(fn(*args_), want)
                ms = kernel_ms(fn, [args_], wall=True, repeats=16)
                tflops = chunked_flops(rows, chunk, *shape[1:]) / ms / 1e9
                form = f"chunked, {scan} scan, {jnp.dtype(storage).name} storage"
                table.append((rows, form, chunk, ms, f"{tflops:.1f}", base / ms, err))
    headers = ("rows", "form", "chunk", "ms", "TFLOP/s", "x lax.scan", "rel err vs lax.scan")
    print_table(headers, table)


if __name__ == "__main__":
    main()
