"""Timing, reporting and roofline helpers shared by the GPU benchmarks.

Kernel times come from CUPTI (through Mosaic GPU's profiler): device time of the kernels a call
launches, without host dispatch. Where CUPTI is unavailable they fall back to wall-clock time of
many back-to-back calls, which includes dispatch; the header line says which clock was used.
"""

import collections
import dataclasses
import datetime
import functools
import glob
import gzip
import json
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from models.config import DecoderConfig
from models.inputs.rows import RowsPhase, TokenRows
from models.serving.runtime import ShardedCausalLM

PEAK_FLOPS = 990e12
"""An H100's or H200's dense bf16 peak: the prefill and train rooflines' denominator."""
COPY_BYTES = 2**32
"""Bytes `hbm_bytes_per_s` copies on a GPU (4 MiB elsewhere, where the figure only fills the
header)."""

LLAMA3_8B = DecoderConfig(
    architecture="LlamaForCausalLM",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=5e5,
    rope_scaling=None,
    qk_norm=False,
    tie_word_embeddings=False,
    sliding_window=None,
    max_position_embeddings=8192,
)
"""The Llama-3-8B shape the benchmarks measure (random weights; no checkpoint)."""


def smoke_widths(config: DecoderConfig, **changes) -> DecoderConfig:
    """`config` with the vocabulary, widths and heads of a `--smoke` run (seconds of CPU compile
    time per layer), and `changes` (the parts that must shrink with them)."""
    return dataclasses.replace(
        config,
        **changes,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
    )


LLAMA3_SMOKE = smoke_widths(dataclasses.replace(LLAMA3_8B, num_layers=2))
"""`--smoke`: the Llama shape shrunk to seconds of CPU compile time (2 layers)."""


def attention_kernel() -> str:
    """`jax.nn.dot_product_attention`'s implementation for the baselines: "cudnn" on GPU, "xla"
    elsewhere (a CPU smoke run). Asked when called, so that importing a benchmark starts no
    backend (a smoke run may still set the number of CPU devices)."""
    return "cudnn" if jax.default_backend() == "gpu" else "xla"


# -- the Llama shape's cases, rooflines and decode inputs -----------------------------------


@dataclasses.dataclass(frozen=True)
class Cases:
    """The whole-model cases `bench_e2e` and `bench_fp8` time: the GPU's by default, tiny ones
    (`SMOKE_CASES`) for a CPU smoke run.

    Attributes:
      prefill_length: Tokens per prefill sequence.
      prefill_sequences: Sequences of each prefill case ("prefill <sequences x length>").
      decode_caches: Cache length of each decode case ("decode <sequences> @ <cache>").
      decode_sequences: Sequences of each decode case, at every cache length.
      steps: Greedy steps of one timed decode call (a jitted loop: dispatch is amortized).
      prefill_repeats: Timed calls of a prefill case.
      decode_repeats: Timed calls of a decode case.
    """

    prefill_length: int = 512
    prefill_sequences: tuple[int, ...] = (1, 8)
    decode_caches: tuple[int, ...] = (1024, 8192)
    decode_sequences: tuple[int, ...] = (8, 64)
    steps: int = 32
    prefill_repeats: int = 7
    decode_repeats: int = 5

    def __post_init__(self):
        if min(self.decode_caches, default=self.steps + 1) <= self.steps:
            raise ValueError(
                f"every decode cache must hold more than {self.steps=} tokens (the loop starts "
                f"steps + 1 before its end); got {self.decode_caches=}. Lengthen the caches "
                "or take fewer steps"
            )

    def naming(self, names: Sequence[str] | None) -> "Cases":
        """These cases with the decode sequences and cache lengths that `names` ("decode
        <sequences> @ <cache>") name, where any does, so a run can time sizes the defaults leave
        out (the other names still only filter)."""
        sizes = []
        for name in names or ():
            words = name.split()
            if words[:1] != ["decode"]:
                continue
            if len(words) != 4 or words[2] != "@" or not (words[1] + words[3]).isdigit():
                raise ValueError(
                    f"decode cases are named 'decode <sequences> @ <cache>'; got {name!r}"
                )
            sizes.append((int(words[1]), int(words[3])))
        if not sizes:
            return self
        return dataclasses.replace(
            self,
            decode_sequences=tuple(sorted({n for n, _ in sizes})),
            decode_caches=tuple(sorted({c for _, c in sizes})),
        )

    def prefills(self) -> tuple[tuple[str, int], ...]:
        """(case name, sequences) of each prefill case."""
        return tuple(
            (f"prefill {sequences * self.prefill_length}", sequences)
            for sequences in self.prefill_sequences
        )

    def decodes(self) -> tuple[tuple[str, int, int], ...]:
        """(case name, sequences, cache length) of each decode case."""
        return tuple(
            (f"decode {sequences} @ {cache}", sequences, cache)
            for cache in self.decode_caches
            for sequences in self.decode_sequences
        )


SMOKE_CASES = Cases(
    prefill_length=16,
    prefill_sequences=(2,),
    decode_caches=(16,),
    decode_sequences=(4,),
    steps=2,
    prefill_repeats=1,
    decode_repeats=1,
)
"""A smoke run's cases: one packed prefill of two sequences and one decode, each timed once."""


def weight_bytes_per_gpu(config: DecoderConfig, tp: int) -> float:
    """Bytes of the weights a decode step reads per GPU (bf16; the embedding reads few rows)."""
    h, d = config.hidden_size, config.head_dim
    attn = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)
    mlp = 3 * h * config.intermediate_size
    return 2 * (config.num_layers * (attn + mlp) + h * config.vocab_size) / tp


def kv_bytes_per_gpu(config: DecoderConfig, tp: int, sequences: int, context: float) -> float:
    """Bytes of bf16 KV cache a decode step reads per GPU, `context` tokens per sequence."""
    per_token = 2 * 2 * config.num_kv_heads * config.head_dim * config.num_layers / tp
    return sequences * context * per_token


def prefill_flops_per_gpu(config: DecoderConfig, tp: int, sequences: int, length: int) -> float:
    """Matmul and causal attention FLOPs of a prefill of `sequences` x `length` tokens, per GPU."""
    h, d = config.hidden_size, config.head_dim
    params = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)
    params += 3 * h * config.intermediate_size
    tokens = sequences * length
    matmul = 2 * tokens * params * config.num_layers
    causal = 2 * 2 * config.num_heads * d * sequences * length * (length + 1) / 2
    head = 2 * sequences * h * config.vocab_size
    return (matmul + causal * config.num_layers + head) / tp


def decode_ids(vocab_size: int, sequences: int) -> np.ndarray:
    """Each decode row's token: random and fixed (a seed), so that rows differ. Rows alike
    would all choose the same experts and a MoE step would read a few experts' weights, not the
    ones a real batch reaches."""
    return np.random.default_rng(7).integers(0, vocab_size, sequences).astype(np.int32)


def decode_inputs(runner: ShardedCausalLM, sequences: int, start: int):
    """Placed DECODE rows: `sequences` slots at position `start` (tokens `decode_ids`), and
    their batch facts."""
    slots = sequences // runner.topology.attn_dp
    ids = decode_ids(runner.config.vocab_size, sequences)
    positions = np.full(sequences, start, np.int32)
    segments = np.tile(np.arange(slots, dtype=np.int32), runner.topology.attn_dp)
    rows = TokenRows(
        runner.place_array(ids),
        runner.place_array(positions),
        runner.place_array(segments),
        RowsPhase.DECODE,
    )
    return rows, runner.place_batch(np.full(runner.topology.attn_dp, slots, np.int32))


# -- timing ---------------------------------------------------------------------------------


def header(title: str) -> str:
    """Machine, JAX version and date, for RESULTS.md."""
    try:
        gpus = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except FileNotFoundError:  # a CPU smoke run
        gpus = "none"
    return (
        f"== {title}\n"
        f"date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}\n"
        f"jax {jax.__version__}, devices: {jax.devices()}\n"
        f"nvidia-smi: {gpus.replace(chr(10), ' | ')}\n"
        f"HBM roofline: {hbm_bytes_per_s() / 1e12:.2f} TB/s, a device copy measured here"
    )


@functools.cache
def hbm_bytes_per_s() -> float:
    """The bandwidth a device copy reaches on the default device, measured once per process: the
    decode rooflines' denominator, as issue 47 defines it (4.3 TB/s on an H200, RESULTS run 3).

    Bytes read and written per second by the faster of two copies of COPY_BYTES: XLA's plain
    copy (a device-to-device memcpy, by the wall clock of blocking calls, which CUPTI's kernel
    timer does not see) and an elementwise pass (`x + 1` on uint32, CUPTI time). On an H200 XLA's
    elementwise fusions reached 3.37 TB/s where a memcpy reached 4.26 (runs 1-3), so the
    elementwise pass alone would understate the ceiling there. Measured rather than the data
    sheet's peak, which no kernel reaches."""
    on_gpu = jax.default_backend() == "gpu"
    words = (COPY_BYTES if on_gpu else 2**22) // 4
    values = [jnp.full((words,), i, jnp.uint32) for i in range(2)]
    elementwise = kernel_ms(jax.jit(lambda x: x + 1), [(x,) for x in values], wall=not on_gpu)
    copy = jax.jit(jnp.copy)
    memcpy = median_wall_ms(lambda: copy(values[0]), 10)
    return 2 * 4 * words / (min(elementwise, memcpy) * 1e-3)


def _cupti_ms(fn: Callable, args: Sequence) -> float:
    _, ms = profiler.measure(fn)(*args)
    return float(ms)


def kernel_ms(
    fn: Callable,
    arg_sets: Sequence[Sequence],
    *,
    warmup: int = 3,
    repeats: int = 40,
    wall: bool = False,
) -> float:
    """Median device time of `fn` in ms, rotating over `arg_sets` so caches don't flatter.

    By CUPTI, or with `wall` (and where CUPTI fails) by the wall clock of 16 calls dispatched
    back to back. CUPTI does not see the kernels of a branch XLA runs from a conditional
    (`lax.switch`, `lax.cond`): time such programs with `wall`.
    """
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    times = []
    if not wall:
        try:
            times = [_cupti_ms(fn, arg_sets[i % len(arg_sets)]) for i in range(repeats)]
        except Exception as error:  # CUPTI missing or busy: fall back to the wall clock
            print(f"  (CUPTI failed: {type(error).__name__}: {error}; wall clock instead)")
    if not times:
        times = [_burst_ms(fn, arg_sets, 16) for _ in range(max(5, repeats // 8))]
    return statistics.median(times)


def _burst_ms(fn: Callable, arg_sets: Sequence[Sequence], calls: int) -> float:
    """Wall-clock ms per call of `calls` calls of `fn` dispatched back to back."""
    start = time.perf_counter()
    jax.block_until_ready([fn(*arg_sets[i % len(arg_sets)]) for i in range(calls)])
    return (time.perf_counter() - start) * 1e3 / calls


def interleaved_wall_ms(
    contenders: dict[str, tuple[Callable, Sequence[Sequence]]],
    *,
    warmup: int = 3,
    rounds: int = 12,
    calls: int = 16,
) -> dict[str, float]:
    """Median wall-clock ms per call of each contender (name -> (fn, arg sets)), timed in turns:
    each round times `calls` calls of every contender dispatched back to back, so a drift of the
    GPU's speed during the run reaches all of them alike (a ratio of two programs timed one after
    the other moved by 4% between timings of one program, `benchmarks/RESULTS.md` run 40)."""
    for fn, arg_sets in contenders.values():
        for i in range(warmup):
            jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    times = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, (fn, arg_sets) in contenders.items():
            times[name].append(_burst_ms(fn, arg_sets, calls))
    return {name: statistics.median(values) for name, values in times.items()}


def wall_ms(fn: Callable, args: Sequence, *, warmup: int = 3, repeats: int = 30) -> float:
    """Median wall-clock time in ms of one blocking call of `fn` (for jitted loops)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def kernel_table(trace_dir: pathlib.Path, top: int = 25) -> dict[str, list[tuple[str, float, int]]]:
    """Per GPU timeline kind ("Stream" kernels, "XLA Ops"): (name, total ms, count), largest
    first, from the Perfetto trace of `jax.profiler.trace`."""
    files = glob.glob(str(trace_dir / "**" / "*.json.gz"), recursive=True)
    if not files:
        return {}
    with gzip.open(sorted(files)[-1]) as stream:
        events = json.load(stream)
    events = events["traceEvents"] if isinstance(events, dict) else events
    processes, threads = {}, {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            threads[event["pid"], event["tid"]] = event["args"]["name"]
    totals = collections.defaultdict(collections.Counter)
    counts = collections.defaultdict(collections.Counter)
    for event in events:
        process = processes.get(event.get("pid"), "")
        if event.get("ph") != "X" or "GPU" not in process:
            continue
        thread = threads.get((event["pid"], event.get("tid")), "")
        kind = "XLA Ops" if "XLA Op" in thread else ("Stream" if "Stream" in thread else thread)
        name = event["name"][:90]
        totals[kind][name] += event.get("dur", 0) / 1e3
        counts[kind][name] += 1
    return {
        kind: [(name, ms, counts[kind][name]) for name, ms in totals[kind].most_common(top)]
        for kind in totals
    }


_PROFILE_DIR: list[pathlib.Path] = []


def profile_into(directory: str | pathlib.Path) -> None:
    """Makes `median_wall_ms` also trace each labelled case into `directory` and print its
    largest GPU kernels (what `--profile DIR` of a model benchmark turns on). A directory that
    cannot be made or written ends the benchmark with one line and exit status 2, before any
    model is built."""
    path = pathlib.Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / ".writable").touch()
        (path / ".writable").unlink()
    except OSError as error:
        print(f"--profile: cannot write traces to {path}: {error.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    _PROFILE_DIR[:] = [path]


def median_wall_ms(call: Callable, repeats: int = 7, *, label: str = "") -> float:
    """Median wall time in ms of `call()` (which returns something to block on), after 2
    warm-ups; under `profile_into`, then 3 more calls traced and their kernel table printed."""
    return paired_wall_ms([call], repeats, labels=[label])[0]


def paired_wall_ms(
    calls: Sequence[Callable], repeats: int = 7, *, labels: Sequence[str] = ()
) -> list[float]:
    """Median wall time in ms of each call, timed in turn (A B A B ...) after 2 warm-ups each,
    so that a drift of the machine during the run falls on every call alike; under
    `profile_into`, then each labelled call traced as `median_wall_ms` does."""
    for call in calls:
        for _ in range(2):
            jax.block_until_ready(call())
    times = [[] for _ in calls]
    for _ in range(repeats):
        for call, timed in zip(calls, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(call())
            timed.append((time.perf_counter() - start) * 1e3)
    for call, label in zip(calls, labels, strict=False):
        if _PROFILE_DIR and label:
            _trace(call, label)
    return [statistics.median(timed) for timed in times]


def _trace(call: Callable, label: str) -> None:
    """Traces 3 calls into the profile directory and prints their kernel table."""
    trace_dir = _PROFILE_DIR[0] / label.replace(" ", "_").replace("@", "at")
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(3):
            jax.block_until_ready(call())
    for kind, table in kernel_table(trace_dir).items():
        print(f"\n### {label}: {kind}, per call")
        for kernel, ms, count in table:
            print(f"{ms / 3:9.3f} ms  x{count // 3:<5} {kernel}")


OUT_OF_MEMORY = "OOM"
"""What a table shows for a contender that could not run its case for lack of device memory."""


def or_out_of_memory[T](call: Callable[[], T]) -> T | str:
    """`call()`'s result (a time, a reference output), or `OUT_OF_MEMORY` when the device had
    too little memory for it (its buffers are dropped with the error, so the run goes on with
    the next contender)."""
    try:
        return call()
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        print(f"out of device memory: {str(error).splitlines()[0][:200]}", flush=True)
        return OUT_OF_MEMORY


def ratio(numerator: float | str, denominator: float | str) -> float | str:
    """numerator / denominator, or "-" where either could not be measured."""
    if isinstance(numerator, str) or isinstance(denominator, str):
        return "-"
    return numerator / denominator


def relative_error(got, want) -> float:
    """max |got - want| / max |want| over all leaves, in float64; inf if anything is non-finite."""
    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if not np.all(np.isfinite(g)):
            return float("inf")
        worst = max(worst, float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30)))
    return worst


def print_table(headers: Sequence[str], rows: Sequence[Sequence]) -> None:
    """Prints a Markdown table."""
    cells = [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(items):
        return "| " + " | ".join(s.rjust(w) for s, w in zip(items, widths, strict=True)) + " |"

    print(line(headers))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print(line(row))
