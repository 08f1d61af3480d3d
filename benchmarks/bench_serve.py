"""Continuous batching against static batches: the serving engine (`models.serving.engine`, the
device loop behind `boundary-jax serve`, driven in-process without HTTP) on a synthetic load,
and `ShardedCausalLM.generate` of the same requests batched ideally.

The load: `--requests` requests whose prompt and output lengths are drawn uniformly from
`--prompt-tokens` and `--output-tokens` (a fixed seed), arriving as a Poisson process at
`--rate` requests/s, or all at once and held at `--concurrency` in flight (the default).

Parts (`--only`, any of them; all by default, so a long run can be split over calls):
  engine: output tokens/s, time to first token (TTFT) p50 / p99 / mean and inter-token latency
    (ITL) p50 / p99 of the engine serving the load.
  static: the baseline "batched ideally": the requests sorted by output length and cut into
    batches of `--concurrency`, one `generate` call per batch, each decoding its longest
    output (so a batch wastes little on finished rows, and no padding in prefill beyond its
    buckets); only the requested output tokens count. Its output tokens/s, and the engine's
    ratio to it when both run.
  penalties: the engine part's load with every request penalized (presence 0.5, frequency
    0.5, repetition 1.1: each step records the token histories and adjusts the logits, and no
    prefix is reused), and its output tokens/s against the plain engine's when both run.
  prefix: every prompt starts with the same `--shared-prefix` tokens (a system prompt; 1024
    unless given), served with prefix reuse off and then on: mean TTFT of each, and the ratio.

Compile time is kept out of every timing: before the engine runs, `PagedRunner.warm_up`
compiles each step bucket the load can reach with one synthetic step (not the whole load);
`--min-step-rows` and `--min-step-pages` bound the number of buckets. The static baseline runs
its batches once to compile, then again timed.

  python3 -m benchmarks.bench_serve --smoke                        # CPU check, seconds
  python3 -m benchmarks.bench_serve --layers 32 --requests 256 --concurrency 64 \\
      --prompt-tokens 128 2048 --output-tokens 64 512 --kv-cache-gb 40   # one H200
  python3 -m benchmarks.bench_serve --layers 32 --only prefix
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import boundary_jax as bj
from models.build import build_model
from models.options import BuildOptions
from models.serving.engine import Engine
from models.serving.paged import PagedRunner, SlotSampling
from models.serving.runtime import ShardedCausalLM
from models.serving.scheduler import Request

from .common import LLAMA3_8B, LLAMA3_SMOKE, header, print_table

GREEDY_SLOT = SlotSampling()
PENALIZED = SlotSampling(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
"""What the penalties part asks of every request."""


@dataclasses.dataclass
class Timing:
    """When a request arrived and when each of its tokens came."""

    arrived: float = 0.0
    tokens: list[float] = dataclasses.field(default_factory=list)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


def draw_load(
    args: argparse.Namespace, vocab: int, shared_prefix: int = 0
) -> list[tuple[list[int], int]]:
    """The requests' prompts (each starting with the same `shared_prefix` tokens) and output
    lengths (a fixed seed)."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, vocab, shared_prefix).tolist()
    load = []
    for _ in range(args.requests):
        length = int(rng.integers(args.prompt_tokens[0], args.prompt_tokens[1] + 1))
        own = rng.integers(0, vocab, max(length - len(shared), 1)).tolist()
        load.append(
            (shared + own, int(rng.integers(args.output_tokens[0], args.output_tokens[1] + 1)))
        )
    return load


def run_engine(
    engine: Engine, load, args: argparse.Namespace, sampling: SlotSampling
) -> tuple[float, list[Timing]]:
    """Seconds to serve `load`, and each request's timing."""
    timings = [Timing() for _ in load]
    gaps = np.random.default_rng(1).exponential(1 / args.rate, len(load)) if args.rate else None
    in_flight = threading.Semaphore(args.concurrency)

    def listener(timing: Timing):
        def hear(token) -> None:
            timing.tokens.append(time.perf_counter())
            if isinstance(token, BaseException) or token.finish is not None:
                timing.done.set()
                in_flight.release()

        return hear

    start = time.perf_counter()
    for index, ((prompt, new), timing) in enumerate(zip(load, timings, strict=True)):
        if gaps is not None:
            time.sleep(max(0.0, start + gaps[: index + 1].sum() - time.perf_counter()))
        else:
            in_flight.acquire()
        timing.arrived = time.perf_counter()
        request = Request(str(index), prompt, new, sampling=sampling)
        engine.submit(request, listener(timing))
    for timing in timings:
        timing.done.wait()
    return time.perf_counter() - start, timings


def run_static(runner: ShardedCausalLM, load, batch: int) -> float:
    """Seconds of `generate` over `load` in batches of `batch`, sorted by output length."""
    ordered = sorted(load, key=lambda item: item[1])
    start = time.perf_counter()
    for first in range(0, len(ordered), batch):
        group = ordered[first : first + batch]
        runner.generate([prompt for prompt, _ in group], max(new for _, new in group))
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def serve(
    paged: PagedRunner,
    load,
    args: argparse.Namespace,
    *,
    prefix_caching: bool,
    sampling: SlotSampling = GREEDY_SLOT,
):
    """Serves `load` through a fresh engine, each request drawn as `sampling` says: (seconds,
    timings, pages reused, preemptions)."""
    engine = Engine(paged, prefix_caching=prefix_caching)
    engine.start()
    seconds, timings = run_engine(engine, load, args, sampling)
    engine.stop(0.0)
    return seconds, timings, engine.scheduler.reused_pages, engine.scheduler.preemptions


def engine_row(name: str, load, seconds: float, timings: list[Timing], reused, preempted):
    """A table row of one engine run."""
    outputs = sum(new for _, new in load)
    ttft = [t.tokens[0] - t.arrived for t in timings]
    itl = [b - a for t in timings for a, b in zip(t.tokens, t.tokens[1:], strict=False)]
    return [
        name,
        f"{outputs / seconds:.1f}",
        f"{percentile(ttft, 50):.1f}",
        f"{percentile(ttft, 99):.1f}",
        f"{np.mean(ttft) * 1e3:.1f}",
        f"{percentile(itl, 50):.2f}",
        f"{percentile(itl, 99):.2f}",
        f"{reused}",
        f"{preempted}",
    ]


COLUMNS = [
    "run",
    "output tok/s",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "TTFT mean ms",
    "ITL p50 ms",
    "ITL p99 ms",
    "pages reused",
    "preemptions",
]
PARTS = ("engine", "static", "penalties", "prefix")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny config and load (CPU)")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=PARTS, help="parts to run")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals/s (0: all)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(128, 2048))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(64, 512))
    parser.add_argument("--shared-prefix", type=int, default=1024, help="for --only prefix")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-tokens-per-step", type=int, default=512)
    parser.add_argument("--min-step-rows", type=int, default=64, help="smallest rows bucket")
    parser.add_argument(
        "--min-step-pages",
        type=int,
        default=None,
        help="smallest pages bucket (default: PagedRunner's, one bucket as wide as the context "
        "where the GPU kernel reads pages in place)",
    )
    parser.add_argument(
        "--scan-layers",
        action="store_true",
        help="scan the layers: faster compiles; each step copies every layer's weight slices "
        "(run 36 measured 4.5x slower steps, when the page pools were copied as well)",
    )
    parser.add_argument(
        "--compilation-cache",
        help="JAX's persistent compilation cache directory: calls split by --only on one "
        "machine compile each step program once",
    )
    args = parser.parse_args()
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    if args.smoke:
        args.requests, args.concurrency = 16, 4
        args.prompt_tokens, args.output_tokens = (8, 40), (4, 16)
        args.shared_prefix = min(args.shared_prefix, 8)
        args.max_tokens_per_step, args.kv_cache_gb, args.page_size = 64, 0.01, 8
        args.min_step_rows, args.min_step_pages = 16, 2
        config = dataclasses.replace(LLAMA3_SMOKE, max_position_embeddings=256)
    else:
        config = dataclasses.replace(LLAMA3_8B, num_layers=args.layers)
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    topology = bj.Topology(attn_dp=args.dp, attn_tp=args.tp)
    mesh = bj.make_mesh(topology)
    options = BuildOptions(dtype=dtype, scan_layers=args.scan_layers)
    model = build_model(config, topology, options, mesh=mesh)
    runner = ShardedCausalLM(model, mesh)
    per_token = model.cache_bytes_per_token(dtype) * config.num_layers
    slots = -(-args.concurrency // args.dp)
    per_sequence = -(-config.max_position_embeddings // args.page_size)
    pages = min(int(args.kv_cache_gb * 2**30) // (per_token * args.page_size), slots * per_sequence)
    paged = PagedRunner(
        runner,
        page_size=args.page_size,
        pages_per_rank=pages,
        slots_per_rank=slots,
        max_rows=args.max_tokens_per_step,
        min_rows=args.min_step_rows,
        min_pages=args.min_step_pages,
    )
    load = draw_load(args, config.vocab_size)
    print(header(f"bench_serve: {config.num_layers}L {jnp.dtype(dtype).name} {topology}"))
    rows = []
    if {"engine", "penalties", "prefix"} & set(args.only):
        reach = args.prompt_tokens[1] + args.output_tokens[1]
        if "prefix" in args.only:
            reach = max(reach, args.shared_prefix + args.prompt_tokens[1] + args.output_tokens[1])
        start = time.perf_counter()
        count = paged.warm_up(reach)
        # The engine's own small programs (outside the step), on two short requests.
        serve(paged, [(prompt[:16], 2) for prompt, _ in load[:2]], args, prefix_caching=False)
        print(f"warm-up: {count} step buckets in {time.perf_counter() - start:.1f} s")
    engine_seconds = None
    if "engine" in args.only:
        result = serve(paged, load, args, prefix_caching=True)
        engine_seconds = result[0]
        rows.append(engine_row("engine", load, *result))
    if "static" in args.only:
        run_static(runner, load, args.concurrency)  # compile
        static = run_static(runner, load, args.concurrency)
        outputs = sum(new for _, new in load)
        rows.append(["static generate", f"{outputs / static:.1f}", *["-"] * 7])
        if engine_seconds is not None:
            rows[0][0] = f"engine ({static / engine_seconds:.2f}x static)"
    if "penalties" in args.only:
        result = serve(paged, load, args, prefix_caching=True, sampling=PENALIZED)
        rows.append(engine_row("engine, penalized", load, *result))
        if engine_seconds is not None:
            rows[-1][0] += f" ({engine_seconds / result[0]:.2f}x plain)"
    if "prefix" in args.only:
        shared = draw_load(args, config.vocab_size, args.shared_prefix)
        means = {}
        for reuse in (False, True):
            result = serve(paged, shared, args, prefix_caching=reuse)
            means[reuse] = np.mean([t.tokens[0] - t.arrived for t in result[1]])
            name = f"prefix {args.shared_prefix}, reuse {'on' if reuse else 'off'}"
            rows.append(engine_row(name, shared, *result))
        rows[-1][0] += f" ({means[False] / means[True]:.2f}x lower mean TTFT)"
    print_table(COLUMNS, rows)
    print(
        f"{len(load)} requests, {sum(new for _, new in load)} output tokens, "
        f"{paged.compiled_shapes()} step programs, {jax.devices()[0].platform}"
    )


if __name__ == "__main__":
    main()
