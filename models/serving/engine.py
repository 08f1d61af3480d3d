"""The device loop of a server: a thread that schedules, runs a paged step and hands each drawn
token to its request's listener, while callers on other threads submit and abort requests.

Callers never wait for the device: `submit` and `abort` queue their work and return; the loop
takes it up between steps. A listener is called on the loop's thread (a server hands the token
on to its event loop). A step that raises fails the running requests, not the loop (the pools
and the prefix cache start afresh: the step may have consumed the donated pools); a listener
that raises loses its own request only.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from .lockstep import Channel, Kind, encode
from .metrics import Metrics
from .paged import Chunk, Launched, PagedRunner, SlotSampling, StepOutput
from .scheduler import Finish, Request, RequestRefused, Scheduler, Token

Listener = Callable[[Token | BaseException], None]
"""Called with each token drawn for a request (the last one carries its finish), or with the
exception that ended it."""


@dataclasses.dataclass
class _Entry:
    request: Request
    listener: Listener
    arrived: float
    last: float | None = None


class Engine:
    """A `PagedRunner` and a `Scheduler` stepped by one thread.

    Attributes:
      paged: The device side.
      scheduler: The host side.
      metrics: What `/metrics` reports.
      channel: Where process 0 of several sends each step's schedule to the others
        (`lockstep.follow`); None in one process.
    """

    IDLE_BEAT = 1.0
    """Seconds between the idle messages process 0 sends its followers."""

    def __init__(
        self,
        paged: PagedRunner,
        *,
        prefix_caching: bool = True,
        channel: Channel | None = None,
        max_running: int | None = None,
    ):
        self.paged = paged
        self.channel = channel
        self.scheduler = Scheduler(
            attn_dp=paged.attn_dp,
            slots_per_rank=paged.slots_per_rank,
            pages_per_rank=paged.pages_per_rank,
            page_size=paged.page_size,
            max_rows=paged.max_rows,
            max_context=paged.runner.config.max_position_embeddings,
            prefix_caching=prefix_caching and paged.reuses_prefixes,
            max_running=max_running,
        )
        self.metrics = Metrics()
        self._entries: dict[int, _Entry] = {}
        self._inbox: list[tuple[str, Request, Listener | None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._running = True
        self._pending: Launched | None = None
        self._thread: threading.Thread | None = None

    # -- any thread -------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raises `RequestRefused` for a request that could never run (`Scheduler.check`)."""
        self.scheduler.check(request)

    def submit(self, request: Request, listener: Listener) -> None:
        """Queues `request`; `listener` gets its tokens on the loop's thread.

        Raises:
          RequestRefused: As `check`, or the engine is stopping.
        """
        self.check(request)
        with self._lock:
            if self._stopping:
                raise RequestRefused("the server is shutting down")
            self._inbox.append(("add", request, listener))
        self._wake.set()

    def abort(self, request: Request) -> None:
        """Stops `request` at the next step (its pages return then); no-op once finished."""
        with self._lock:
            self._inbox.append(("abort", request, None))
        self._wake.set()

    @property
    def busy(self) -> bool:
        """Requests queued, waiting or running, or a step in flight."""
        with self._lock:
            return bool(self._inbox) or not self.scheduler.idle or self._pending is not None

    def start(self) -> None:
        """Runs the loop on its own (daemon) thread."""
        self._thread = threading.Thread(target=self._loop, name="device-loop", daemon=True)
        self._thread.start()

    def stop(self, grace: float) -> None:
        """Stops admitting; lets running and waiting requests finish for up to `grace`
        seconds, aborts the rest, and ends the loop."""
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + grace
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            pending = [entry.request for entry in self._entries.values()]
            pending += [request for kind, request, _ in self._inbox if kind == "add"]
        for request in pending:
            self.abort(request)
        self._running = False
        self._wake.set()
        if self._thread is None:
            self._take_inbox()  # no loop: the aborts take effect here
            self._release_followers()
        else:
            self._thread.join(timeout=max(grace, 1.0) + 5.0)

    # -- the loop's thread ----------------------------------------------------------------

    def _loop(self) -> None:
        beat = time.monotonic()
        while self._running:
            if self.run_once():
                beat = time.monotonic()
                continue
            self._wake.wait(0.05)
            self._wake.clear()
            if self.channel is not None and time.monotonic() - beat > self.IDLE_BEAT:
                self.channel.send(Kind.IDLE)
                beat = time.monotonic()
        self._take_inbox()
        self._release_followers()

    def _release_followers(self) -> None:
        """Process 0 of several: tells the followers the server stopped."""
        if self.channel is not None:
            self.channel.send(Kind.STOP)
            self.channel = None

    def run_once(self) -> bool:
        """One turn of the loop: takes queued work, launches the next step, then waits for the
        step launched before it and records its draws, so the host schedules step N + 1 while
        the device runs step N (a request whose token step N draws runs that token in step
        N + 1, read on the device). False when nothing ran. (The loop calls it; a test may call
        it directly instead of `start`.)"""
        self._take_inbox()
        scheduler = self.scheduler
        chunks = scheduler.schedule()
        self.metrics.queue(len(scheduler.running), len(scheduler.waiting), scheduler.used_pages)
        pending, self._pending = self._pending, None
        if not chunks and pending is None:
            return False
        sampling = self._sampling(chunks)
        try:
            if self.channel is not None:
                self.channel.send(Kind.STEP, encode(chunks, sampling, self._rows(chunks)))
            if chunks:
                self._pending = self.paged.launch(chunks, sampling, pending)
                if self.channel is not None:
                    self.channel.settle(self._pending)
            output = None if pending is None else pending.fetch()
        except Exception as error:  # noqa: BLE001 - the running requests fail, the loop lives
            self._fail_running(error)
            return True
        if pending is not None:
            self._record(pending.chunks, output)
        return True

    def _sampling(self, chunks: list[Chunk]) -> dict[tuple[int, int], SlotSampling]:
        """Each chunk's sampling parameters, its request's pages written into the tables."""
        tables = self.paged.tables
        by_slot = {(r.rank, r.slot): r for r in self.scheduler.running}
        sampling = {}
        for chunk in chunks:
            request = by_slot[(chunk.rank, chunk.slot)]
            tables[chunk.rank, chunk.slot, : len(request.pages)] = request.pages
            sampling[(chunk.rank, chunk.slot)] = request.sampling
        return sampling

    def _rows(self, chunks: list[Chunk]) -> dict[tuple[int, int], list[int]]:
        """The page-table row prefix `_sampling` wrote for each chunk's slot."""
        by_slot = {(r.rank, r.slot): r for r in self.scheduler.running}
        return {(c.rank, c.slot): list(by_slot[(c.rank, c.slot)].pages) for c in chunks}

    def _fail_running(self, error: Exception) -> None:
        """A step raised, and may have consumed the donated pools: every running request's
        cache is gone. They fail; draws in flight are dropped (a waiting request recomputes
        its own); the pools and the prefix cache start afresh."""
        scheduler = self.scheduler
        self._pending = None
        for request in list(scheduler.running):
            scheduler.abort(request)
            self._finish(request, error)
        for request in scheduler.waiting:
            request.drawing = 0
        scheduler.forget_pages()
        self.paged.reset()

    def _record(self, chunks: tuple[Chunk, ...], output: StepOutput) -> None:
        """A finished step's draws: into the scheduler, the metrics and the listeners."""
        scheduler = self.scheduler
        drawn = scheduler.update(chunks, output)
        now = time.monotonic()
        self.metrics.step(
            computed=sum(len(c.tokens) for c in chunks),
            generated=len(drawn),
            reused_pages=scheduler.reused_pages,
            preemptions=scheduler.preemptions,
        )
        for token in drawn:
            entry = self._entries.get(id(token.request))
            if entry is None:
                continue
            if entry.last is None:
                self.metrics.first_token(now - entry.arrived)
            else:
                self.metrics.inter_token(now - entry.last)
            entry.last = now
            if token.finish is not None:
                del self._entries[id(token.request)]
            self._tell(entry, token)

    def _tell(self, entry: _Entry, item: Token | BaseException) -> None:
        """Hands `item` to the request's listener; a listener that raises (its caller gone,
        its event loop closed) loses its request, never the loop."""
        try:
            entry.listener(item)
        except Exception:  # noqa: BLE001 - any listener failure ends that request only
            self._entries.pop(id(entry.request), None)
            self.scheduler.abort(entry.request)

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, request, listener in inbox:
            if kind == "add":
                self._entries[id(request)] = _Entry(request, listener, time.monotonic())
                self.scheduler.add(request)
            elif self.scheduler.abort(request):
                self._finish(request, None)

    def _finish(self, request: Request, error: BaseException | None) -> None:
        entry = self._entries.pop(id(request), None)
        if entry is None:
            return
        self._tell(entry, error or Token(request, -1, 0.0, (), (), Finish.ABORT))
