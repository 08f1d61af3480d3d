"""The grouped matmul of MoE experts alone, by expert count: JAX's Hopper kernel against the Triton
expert kernel's tilings, at the routed rows of a prefill step (issue 45).

JAX's Hopper kernel finds each row tile's expert by a loop over all experts, so its cost grows
with their number; the Triton kernel launches one program per (expert with rows, column block).
This times both, and batched matmuls over rows padded to the busiest expert (the ceiling
`PADDED_BATCHED` reaches when routing fits its buckets), for the projections of models with 128,
256 and 512 experts, beside what `GroupedMatmulImpl.GPU_BY_SIZE` runs, so its choice
(`HOPPER_MAX_GROUPS`) and `triton_tiling`'s prefill tilings can be read off one table.

    python3 -m benchmarks.bench_grouped_matmul            # one Hopper GPU
    python3 -m benchmarks.bench_grouped_matmul --smoke    # CPU: tiny shapes, Triton interpreted

Routing: each token picks its top-k of normal logits (even on average, the busiest expert
about 1.3x the mean). Device time by CUPTI; each kernel's output is checked against the Hopper
kernel's (or, with `--smoke`, `lax.ragged_dot`'s).
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import header, kernel_ms, print_table, relative_error
from pallas_kernels.grouped_matmul import (
    GroupedMatmulImpl,
    TritonTiling,
    expert_matmul,
    grouped_matmul,
    grouped_matmul_by_size,
    hopper_ragged_dot,
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One projection of a MoE layer at a prefill step: `tokens` x `top_k` routed rows."""

    name: str
    tokens: int
    experts: int
    top_k: int
    k: int
    n: int


SHAPES = (
    Shape("Qwen3-30B-A3B gate|up", 4096, 128, 8, 2048, 1536),
    Shape("Qwen3-30B-A3B down", 4096, 128, 8, 768, 2048),
    Shape("256 experts gate|up", 4096, 256, 8, 2048, 1024),
    Shape("256 experts down", 4096, 256, 8, 512, 2048),
    Shape("Qwen3-Next gate|up", 4096, 512, 10, 2048, 1024),
    Shape("Qwen3-Next down", 4096, 512, 10, 512, 2048),
    Shape("Qwen3-Next gate|up, 1600 tokens", 1600, 512, 10, 2048, 1024),
)
SMOKE_SHAPES = (Shape("smoke", 64, 16, 4, 128, 256),)

TILINGS = tuple(
    TritonTiling(block_rows=rows, block_n=128, num_warps=8, num_stages=3, columns_inner=inner)
    for rows in (64, 128)
    for inner in (False, True)
)


def group_sizes(shape: Shape, seed: int = 0) -> np.ndarray:
    """Rows per expert when every token takes the top-k of its own normal logits."""
    logits = np.random.default_rng(seed).normal(size=(shape.tokens, shape.experts))
    chosen = np.argsort(-logits, axis=1)[:, : shape.top_k]
    return np.bincount(chosen.ravel(), minlength=shape.experts).astype(np.int32)


def rows_for(shape: Shape, sizes: np.ndarray) -> list[tuple]:
    """The table's rows for one shape: (shape, variant, ms, TFLOP/s, x Hopper, error)."""
    m = int(sizes.sum())
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, shape.k), jnp.bfloat16)
    w = jax.random.normal(kw, (shape.experts, shape.k, shape.n), jnp.bfloat16) * 0.02
    s = jnp.asarray(sizes)
    smoke = jax.default_backend() == "cpu"
    variants = {}
    if smoke:
        reference = jax.jit(jax.lax.ragged_dot)
        variants["Triton, interpreted"] = lambda x, w, s: grouped_matmul(
            x, w, s, impl=GroupedMatmulImpl.PALLAS_INTERPRET
        )
    else:
        reference = jax.jit(hopper_ragged_dot)
        picked = grouped_matmul_by_size(m, shape.k, shape.n, jnp.bfloat16, shape.experts)
        variants[f"GPU_BY_SIZE ({picked.name})"] = lambda x, w, s: grouped_matmul(
            x, w, s, impl=GroupedMatmulImpl.GPU_BY_SIZE
        )
        variants["Hopper"] = reference
        for tiling in TILINGS:
            inner = ", columns inner" if tiling.columns_inner else ""
            label = f"Triton {tiling.block_rows} rows{inner}"
            variants[label] = lambda x, w, s, t=tiling: expert_matmul(x, w, s, tiling=t)
        capacity = -(-int(sizes.max()) // 32) * 32
        padded = jnp.zeros((shape.experts, capacity, shape.k), jnp.bfloat16)
    want = np.asarray(reference(x, w, s), np.float32)
    flops = 2 * m * shape.k * shape.n
    timed = []
    for label, fn in variants.items():
        fn = jax.jit(fn)
        error = relative_error(np.asarray(fn(x, w, s), np.float32), want)
        timed.append((label, kernel_ms(fn, [(x, w, s)], repeats=20), f"{error:.1e}"))
    if not smoke:
        einsum = jax.jit(lambda a, w: jnp.einsum("gck,gkn->gcn", a, w))
        timed.append((f"padded batched, {capacity} rows", kernel_ms(einsum, [(padded, w)]), "-"))
    hopper = dict((label, ms) for label, ms, _ in timed).get("Hopper")
    rows = []
    for label, ms, error in timed:
        speedup = f"{hopper / ms:.2f}" if hopper else "-"
        rows.append((shape.name, label, f"{ms:.3f}", f"{flops / ms / 1e9:.0f}", speedup, error))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    args = parser.parse_args()
    print(header("bench_grouped_matmul: MoE grouped matmuls by expert count, bf16"))
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        sizes = group_sizes(shape)
        print(
            f"\n{shape.name}: {int(sizes.sum())} rows, {sizes.mean():.0f} per expert on "
            f"average, at most {sizes.max()}",
            flush=True,
        )
        headers = ("shape", "kernel", "ms", "TFLOP/s", "x Hopper", "rel err")
        print_table(headers, rows_for(shape, sizes))


if __name__ == "__main__":
    main()
