"""A server's counters, gauges and latency histograms, written as Prometheus text."""

from __future__ import annotations

import bisect
import collections
import threading
import time

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Upper bounds (seconds) of the time-to-first-token and inter-token-latency histograms."""
RATE_WINDOW = 10.0
"""Seconds over which `tokens_per_second` averages."""
PREFIX = "boundary_jax"


class Histogram:
    """Counts of observations under each of `bounds` (cumulative, as Prometheus writes them),
    their sum and count."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            edge = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{edge}"}} {running}')
        out.append(f"{name}_sum {self.total}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    """What the device loop records (`Engine`), read by `/metrics` from another thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.used_pages = 0
        self.reused_pages = 0
        self.preemptions = 0
        self.computed_tokens = 0
        self.generated_tokens = 0
        self.steps = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def queue(self, running: int, waiting: int, used_pages: int) -> None:
        """The requests running and waiting, and the pages they hold, between steps."""
        with self._lock:
            self.running, self.waiting, self.used_pages = running, waiting, used_pages

    def step(self, *, computed: int, generated: int, reused_pages: int, preemptions: int) -> None:
        """A step's work: tokens computed and generated, and the running totals of pages reused
        and requests preempted."""
        now = time.monotonic()
        with self._lock:
            self.steps += 1
            self.computed_tokens += computed
            self.generated_tokens += generated
            self.reused_pages = reused_pages
            self.preemptions = preemptions
            self._recent.append((now, generated))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW:
                self._recent.popleft()

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last `RATE_WINDOW` seconds."""
        now = time.monotonic()
        with self._lock:
            recent = [count for when, count in self._recent if when >= now - RATE_WINDOW]
        return sum(recent) / RATE_WINDOW

    def text(self, *, total_pages: int) -> str:
        """The Prometheus text exposition of every metric."""
        rate = self.tokens_per_second()
        with self._lock:
            rows = [
                ("gauge", "requests_running", "Requests holding a cache slot.", self.running),
                ("gauge", "requests_waiting", "Requests waiting for a slot.", self.waiting),
                ("gauge", "kv_blocks_used", "KV cache pages held by requests.", self.used_pages),
                ("gauge", "kv_blocks_total", "KV cache pages over all DP ranks.", total_pages),
                (
                    "counter",
                    "prefix_reused_blocks_total",
                    "KV cache pages reused from the prefix cache.",
                    self.reused_pages,
                ),
                ("counter", "preemptions_total", "Requests preempted.", self.preemptions),
                (
                    "counter",
                    "computed_tokens_total",
                    "Tokens run through the model.",
                    self.computed_tokens,
                ),
                (
                    "counter",
                    "generated_tokens_total",
                    "Tokens generated.",
                    self.generated_tokens,
                ),
                ("counter", "steps_total", "Device steps run.", self.steps),
                ("gauge", "generated_tokens_per_second", "Over the last 10 s.", rate),
            ]
            lines = []
            for kind, name, doc, value in rows:
                full = f"{PREFIX}_{name}"
                lines += [f"# HELP {full} {doc}", f"# TYPE {full} {kind}", f"{full} {value}"]
            for name, doc, histogram in (
                ("time_to_first_token_seconds", "Time to first token.", self.ttft),
                ("inter_token_latency_seconds", "Time between tokens.", self.itl),
            ):
                full = f"{PREFIX}_{name}"
                lines += [f"# HELP {full} {doc}", f"# TYPE {full} histogram"]
                lines += histogram.lines(full)
        return "\n".join(lines) + "\n"
