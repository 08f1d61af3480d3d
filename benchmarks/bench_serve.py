"""Continuous batching against static batches: the serving engine (`models.serving.engine`, the
device loop behind `boundary-jax serve`, driven in-process without HTTP) on a synthetic load,
and `ShardedCausalLM.generate` of the same requests batched ideally.

The load: `--requests` requests whose prompt and output lengths are drawn uniformly from
`--prompt-tokens` and `--output-tokens` (a fixed seed), arriving as a Poisson process at
`--rate` requests/s, or all at once and held at `--concurrency` in flight (the default). With
`--shared-prefix N` every prompt starts with the same N tokens (a system prompt); run it twice,
once with `--no-prefix-caching`, to see what prefix reuse saves in time to first token.

Reported: output tokens/s, time to first token (TTFT) p50 / p99 / mean and inter-token latency
(ITL) p50 / p99 of the engine; the static baseline's output tokens/s (requests sorted by output
length, `--concurrency` per `generate` call, each call running its longest output; only the
requested tokens count), and the ratio. Compile time is kept out of both: each runs the load
once first (the engine without prefix reuse, so the measured run finds no page cached).

  python3 -m benchmarks.bench_serve --smoke                        # CPU check, seconds
  python3 -m benchmarks.bench_serve --layers 32 --requests 256 --concurrency 64 \\
      --prompt-tokens 128 2048 --output-tokens 64 512 --kv-cache-gb 40   # one H200
  python3 -m benchmarks.bench_serve --layers 32 --shared-prefix 1024 [--no-prefix-caching]
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
from models.serving.paged import PagedRunner
from models.serving.runtime import ShardedCausalLM
from models.serving.scheduler import Request

from .common import LLAMA3_8B, LLAMA3_SMOKE, header, print_table


@dataclasses.dataclass
class Timing:
    """When a request arrived and when each of its tokens came."""

    arrived: float = 0.0
    tokens: list[float] = dataclasses.field(default_factory=list)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


def draw_load(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """The requests' prompts and output lengths (a fixed seed)."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, vocab, args.shared_prefix).tolist()
    load = []
    for _ in range(args.requests):
        length = int(rng.integers(args.prompt_tokens[0], args.prompt_tokens[1] + 1))
        own = rng.integers(0, vocab, max(length - len(shared), 1)).tolist()
        load.append(
            (shared + own, int(rng.integers(args.output_tokens[0], args.output_tokens[1] + 1)))
        )
    return load


def run_engine(engine: Engine, load, args: argparse.Namespace) -> tuple[float, list[Timing]]:
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
        engine.submit(Request(str(index), prompt, new), listener(timing))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny config and load (CPU)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals/s (0: all)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(128, 2048))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(64, 512))
    parser.add_argument("--shared-prefix", type=int, default=0)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-tokens-per-step", type=int, default=512)
    parser.add_argument("--kv-cache-gb", type=float, default=40.0)
    parser.add_argument("--no-static", action="store_true", help="skip the generate baseline")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.concurrency = 16, 4
        args.prompt_tokens, args.output_tokens = (8, 40), (4, 16)
        args.shared_prefix = min(args.shared_prefix, 8)
        args.max_tokens_per_step, args.kv_cache_gb, args.page_size = 64, 0.01, 8
        config = dataclasses.replace(LLAMA3_SMOKE, max_position_embeddings=256)
    else:
        config = dataclasses.replace(LLAMA3_8B, num_layers=args.layers)
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    topology = bj.Topology(attn_dp=args.dp, attn_tp=args.tp)
    mesh = bj.make_mesh(topology)
    model = build_model(config, topology, BuildOptions(dtype=dtype), mesh=mesh)
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
    )
    load = draw_load(args, config.vocab_size)
    print(header(f"bench_serve: {config.num_layers}L {jnp.dtype(dtype).name} {topology}"))
    warm = Engine(paged, prefix_caching=False)
    warm.start()
    run_engine(warm, load, args)  # every step shape the load reaches, compiled
    warm.stop(0.0)
    engine = Engine(paged, prefix_caching=not args.no_prefix_caching)
    engine.start()
    seconds, timings = run_engine(engine, load, args)
    engine.stop(0.0)
    outputs = sum(new for _, new in load)
    ttft = [t.tokens[0] - t.arrived for t in timings]
    itl = [b - a for t in timings for a, b in zip(t.tokens, t.tokens[1:], strict=False)]
    rows = [
        [
            "engine",
            f"{outputs / seconds:.1f}",
            f"{percentile(ttft, 50):.1f}",
            f"{percentile(ttft, 99):.1f}",
            f"{np.mean(ttft) * 1e3:.1f}",
            f"{percentile(itl, 50):.2f}",
            f"{percentile(itl, 99):.2f}",
            f"{engine.scheduler.reused_pages}",
            f"{engine.scheduler.preemptions}",
        ]
    ]
    if not args.no_static:
        run_static(runner, load, args.concurrency)  # compile
        static = run_static(runner, load, args.concurrency)
        rows.append(["static generate", f"{outputs / static:.1f}", *["-"] * 7])
        rows[0][0] = f"engine ({static / seconds:.2f}x static)"
    print_table(
        [
            "run",
            "output tok/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "TTFT mean ms",
            "ITL p50 ms",
            "ITL p99 ms",
            "pages reused",
            "preemptions",
        ],
        rows,
    )
    print(f"{len(load)} requests, {outputs} output tokens, {jax.devices()[0].platform}")


if __name__ == "__main__":
    main()
