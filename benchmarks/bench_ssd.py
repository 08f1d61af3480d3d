"""Mamba2's SSD scan over 4096 packed rows: the chunked matmul form against a row-by-row
`lax.scan` (issue 20 asks for >= 10x on one H200).

The shapes are one Nemotron-H-8B Mamba2 layer on one GPU (128 heads of 64 channels, 8 B/C
groups, state 128; bf16 activations, float32 state): four sequences packed into the rows, so
that the chunked form also pays for its sequence resets and per-slot final states.

    python3 -m benchmarks.bench_ssd            # on the GPU machine
    python3 -m benchmarks.bench_ssd --smoke    # CPU: tiny shapes, the two forms compared
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.layers.mixers.ssd import ssd_chunked_scan, ssd_reference

from .common import header, kernel_ms, print_table, relative_error

HEADS, HEAD_DIM, GROUPS, STATE = 128, 64, 8, 128
ROWS = 4096
LENGTHS = (2048, 1024, 700, 324)  # four sequences packed into the 4096 rows
CHUNKS = (64, 128, 256)


def inputs(rows: int, lengths, heads: int, head_dim: int, groups: int, state: int, dtype):
    """Random SSD inputs over packed rows (positions and segment ids as `TokenRows` gives)."""
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (rows, heads, head_dim), dtype)
    dt = jax.nn.softplus(jax.random.normal(keys[1], (rows, heads)) - 3.0)
    a = -jnp.exp(jax.random.uniform(keys[2], (heads,), minval=0.0, maxval=2.5))
    b = jax.random.normal(keys[3], (rows, groups, state), dtype) / state**0.5
    c = jax.random.normal(keys[4], (rows, groups, state), dtype) / state**0.5
    d = jnp.ones((heads,))
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    segments = np.concatenate([np.full(n, s) for s, n in enumerate(lengths)]).astype(np.int32)
    return x, dt, a, b, c, d, jnp.asarray(positions), jnp.asarray(segments)


def chunked_flops(rows: int, chunk: int, heads: int, head_dim: int, groups: int, state: int):
    """Multiply-adds x 2 of the chunked form's matmuls."""
    chunks = -(-rows // chunk)
    padded = chunks * chunk
    scores = padded * chunk * groups * state  # C B^T per chunk
    within = padded * chunk * heads * head_dim  # scores @ x
    summaries = padded * heads * head_dim * state  # chunk end states
    entering = chunks * chunks * heads * head_dim * state
    reads = padded * heads * head_dim * state  # C @ entering states
    return 2 * (scores + within + summaries + entering + reads)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    args = parser.parse_args()
    if args.smoke:
        shape, rows, lengths, chunks = (8, 16, 2, 16), 96, (50, 30, 16), (16, 32)
    else:
        shape, rows, lengths, chunks = (HEADS, HEAD_DIM, GROUPS, STATE), ROWS, LENGTHS, CHUNKS
    slots = len(lengths)
    print(header(f"SSD scan, {rows} packed rows, heads/head_dim/groups/state {shape}"))
    args_ = inputs(rows, lengths, *shape, jnp.bfloat16)
    reference = jax.jit(functools.partial(ssd_reference, num_slots=slots))
    want = reference(*args_)
    base = kernel_ms(reference, [args_], wall=True, repeats=16)
    rows_out = [("lax.scan, row by row", "-", base, "-", 1.0, 0.0)]
    for chunk in chunks:
        fn = jax.jit(functools.partial(ssd_chunked_scan, chunk_size=chunk, num_slots=slots))
        err = relative_error(fn(*args_), want)
        ms = kernel_ms(fn, [args_], wall=True, repeats=16)
        tflops = chunked_flops(rows, chunk, *shape) / ms / 1e9
        rows_out.append(("chunked", chunk, ms, f"{tflops:.1f}", base / ms, err))
    headers = ("form", "chunk", "ms", "TFLOP/s", "x lax.scan", "rel err vs lax.scan")
    print_table(headers, rows_out)


if __name__ == "__main__":
    main()
