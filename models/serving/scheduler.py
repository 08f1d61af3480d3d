"""Continuous batching on the host: which tokens of which requests the next step runs.

Between steps the scheduler admits waiting requests, gives every running one its next chunk
under a token budget per attention-DP rank (a decode token, or as much of the prompt as the
budget leaves: chunked prefill), and retires finished ones at once, returning their pages. When
a rank's pool runs out, the newest request on it is preempted: its pages go back and it waits
again, to recompute what it had (prompt and tokens so far) when readmitted. A request whose
prompt plus `max_tokens` could not fit a rank's pool even alone is refused when it arrives.
Prompt prefixes already in a rank's cache are reused, not recomputed (`PagePool`).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Sequence

from .blocks import PagePool, page_hashes
from .paged import Chunk, SlotSampling, StepOutput
from .sampling import MAX_HELD_STOPS


class RequestRefused(ValueError):
    """A request that can never run: its prompt and output exceed the context or the cache, or
    it holds back more stop ids than a slot can.

    Attributes:
      param: The request field at fault ("max_tokens" for the context or the cache).
    """

    def __init__(self, message: str, param: str = "max_tokens"):
        super().__init__(message)
        self.param = param


class Finish(enum.Enum):
    """Why a request stopped: an end-of-sequence or stop id, `max_tokens`, or an abort (a
    client gone, a stop string met, the server stopping)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence to continue, and how far it is.

    Attributes:
      id: The caller's name for it.
      prompt: Token ids.
      max_tokens: The most new tokens.
      stop_ids: Ids that end it (kept as its last token).
      sampling: How its tokens are drawn.
      adapter: The index of the LoRA adapter it runs through (`LoraSpec.index`; 0: the base
        model); part of its pages' names, and of every row it runs.
      output: New tokens so far.
      computed: Leading tokens (prompt + output) whose keys and values are in the cache.
      pages: Its pages on its rank, in position order.
      named: Leading tokens whose full pages are named in the prefix cache.
      rank, slot: Where it runs; None while waiting.
      finish: Why it stopped; None while it runs or waits.
      order: Its arrival order (the scheduler's): the oldest runs first, the newest is
        preempted first.
      drawing: Draws launched for it and not recorded yet (`update` records them): the next
        step may already run the token in flight (`Chunk.previous`), read on the device.
    """

    id: str
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    sampling: SlotSampling = SlotSampling()
    adapter: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    named: int = 0
    rank: int | None = None
    slot: int | None = None
    finish: Finish | None = None
    order: int = 0
    drawing: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclasses.dataclass(frozen=True)
class Token:
    """A token a step drew for a request, and whether the request ended with it."""

    request: Request
    token: int
    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]
    finish: Finish | None


class Scheduler:
    """Admission, chunking, retirement and preemption over the DP ranks' page pools.

    Attributes:
      pools: Each DP rank's `PagePool`.
      running: Requests holding a slot, oldest first.
      waiting: Requests waiting for a slot, oldest first.
      preemptions: Requests preempted so far.
      max_running: Requests holding a slot at once over all ranks (None: every slot).
    """

    def __init__(
        self,
        *,
        attn_dp: int,
        slots_per_rank: int,
        pages_per_rank: int,
        page_size: int,
        max_rows: int,
        max_context: int,
        prefix_caching: bool = True,
        max_running: int | None = None,
    ):
        self.attn_dp = attn_dp
        self.max_running = max_running
        self.slots_per_rank = slots_per_rank
        self.page_size = page_size
        self.max_rows = max_rows
        self.max_context = max_context
        self.pools = [PagePool(pages_per_rank, caching=prefix_caching) for _ in range(attn_dp)]
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.preemptions = 0
        self._reused_before = 0
        self._order = itertools.count()
        self._free_slots = [list(range(slots_per_rank - 1, -1, -1)) for _ in range(attn_dp)]
        self._by_order: dict[int, Request] = {}

    @property
    def reused_pages(self) -> int:
        """Pages reused from the prefix cache so far, over all ranks."""
        return self._reused_before + sum(pool.reused for pool in self.pools)

    def forget_pages(self) -> None:
        """Starts every rank's pool afresh (nothing held, nothing cached): after the device
        lost the pages' contents. No request may be running.

        Raises:
          ValueError: A request is running.
        """
        if self.running:
            raise ValueError("forget_pages needs no running request; abort them first")
        self._reused_before = self.reused_pages
        self.pools = [PagePool(pool.pages, caching=pool.caching) for pool in self.pools]

    @property
    def used_pages(self) -> int:
        """Pages held by running requests, over all ranks."""
        return sum(pool.used for pool in self.pools)

    def check(self, request: Request) -> None:
        """Refuses a request that could never run.

        Raises:
          RequestRefused: No prompt or `max_tokens` < 1, prompt + max_tokens past the context,
            more pages than a rank's pool holds, or `min_tokens` with more stop ids than a slot
            holds back.
        """
        total = len(request.prompt) + request.max_tokens
        if not request.prompt or request.max_tokens < 1:
            raise RequestRefused("a request needs a non-empty prompt and max_tokens >= 1")
        if request.sampling.min_tokens and len(request.stop_ids) > MAX_HELD_STOPS:
            raise RequestRefused(
                f"'min_tokens' holds back at most {MAX_HELD_STOPS} stop ids (eos ids included); "
                f"the request has {len(request.stop_ids)}",
                param="min_tokens",
            )
        if total > self.max_context:
            raise RequestRefused(
                f"the prompt has {len(request.prompt)} tokens and max_tokens is "
                f"{request.max_tokens}: {total} positions, past the model's context of "
                f"{self.max_context}"
            )
        pages = -(-(total - 1) // self.page_size)  # the last token drawn is never run
        if pages > self.pools[0].pages:
            raise RequestRefused(
                f"the prompt and max_tokens need {pages} cache pages of {self.page_size} "
                f"tokens; the cache holds {self.pools[0].pages} per rank. Lower max_tokens or "
                "the prompt, or give the server a larger --kv-cache-gb"
            )

    def add(self, request: Request) -> None:
        """Queues a request (`check` first).

        Raises:
          RequestRefused: As `check`.
        """
        self.check(request)
        request.order = next(self._order)
        self._by_order[request.order] = request
        self.waiting.append(request)

    def abort(self, request: Request) -> bool:
        """Stops a request now (its pages return); False if it had finished already."""
        if request.finish is not None:
            return False
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self._retire(request)
        request.finish = Finish.ABORT
        self._by_order.pop(request.order, None)
        return True

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def schedule(self) -> list[Chunk]:
        """The next step's chunks: every running request's next tokens while each rank's budget
        lasts (oldest first, preempting the newest on a rank whose pool is out of pages), then
        waiting requests admitted while slots, pages and budget last."""
        budget = [self.max_rows] * self.attn_dp
        chunks: list[Chunk] = []
        # Oldest first (a readmitted request is older than some that ran on while it
        # waited): a rank short of pages preempts its newest, never one scheduled already.
        for request in sorted(self.running, key=lambda r: r.order):
            if request not in self.running:
                continue  # preempted for an older one
            chunk = self._next_chunk(request, budget)
            if chunk is not None:
                chunks.append(chunk)
        while self.waiting and not self.waiting[0].drawing:  # a draw in flight: recorded first
            request = self.waiting[0]
            rank = self._admission_rank(request, budget)
            if rank is None:
                break
            self.waiting.pop(0)
            self._admit(request, rank)
            chunk = self._next_chunk(request, budget, admitting=True)
            if chunk is None:  # no pages after all: back to the head of the queue
                self._preempt(request, counted=False)
                break
            chunks.append(chunk)
        return chunks

    def _next_chunk(
        self, request: Request, budget: list[int], *, admitting: bool = False
    ) -> Chunk | None:
        """The request's next chunk (its pages allocated, its `computed` advanced, `drawing`
        set where it samples), or None. A request whose token is being drawn runs that token
        next (`Chunk.previous`), unless that token is its last by `max_tokens`."""
        rank = request.rank
        tokens = request.tokens
        if request.drawing and len(request.output) + request.drawing >= request.max_tokens:
            return None
        known = len(tokens) + request.drawing
        count = min(known - request.computed, budget[rank])
        if count < 1:
            return None
        pool = self.pools[rank]
        needed = -(-(request.computed + count) // self.page_size) - len(request.pages)
        while needed > pool.available:
            if admitting:
                return None
            victim = max((r for r in self.running if r.rank == rank), key=lambda r: r.order)
            self._preempt(victim)
            if victim is request:
                return None
        request.pages.extend(pool.allocate(max(needed, 0)))
        budget[rank] -= count
        start = request.computed
        previous = start + count > len(tokens)  # its last token is in flight
        ids = tokens[start : start + count] + [0] * previous  # 0: the previous step's draw
        request.computed += count
        sample = start + count == known
        request.drawing += sample
        return Chunk(
            rank,
            request.slot,
            tuple(ids),
            start,
            sample,
            key=request.order,
            previous=previous,
            adapter=request.adapter,
            prompt_length=len(request.prompt),
            first=admitting,
            held_stops=tuple(sorted(request.stop_ids))
            if admitting and request.sampling.min_tokens
            else (),
        )

    def _admission_rank(self, request: Request, budget: list[int]) -> int | None:
        """The rank a waiting request goes to: one with a free slot and budget, the most of its
        prefix cached, then the most pages available; None if no rank takes it now."""
        if self.max_running is not None and len(self.running) >= self.max_running:
            return None
        tokens = request.tokens
        hashes = self._reusable(request)
        best, best_key = None, None
        for rank, pool in enumerate(self.pools):
            if not self._free_slots[rank] or budget[rank] < 1:
                continue
            cached = pool.lookup(hashes)
            first = min(len(tokens) - cached * self.page_size, budget[rank])
            if -(-first // self.page_size) > pool.available:
                continue
            key = (cached, pool.available, -rank)
            if best_key is None or key > best_key:
                best, best_key = rank, key
        return best

    def _admit(self, request: Request, rank: int) -> None:
        hashes = self._reusable(request)
        request.rank, request.slot = rank, self._free_slots[rank].pop()
        request.pages = self.pools[rank].match(hashes)
        request.computed = request.named = len(request.pages) * self.page_size
        self.running.append(request)

    def _hashes(self, request: Request, pages: int) -> list[int]:
        return page_hashes(request.tokens, self.page_size, pages, request.adapter)

    def _reusable(self, request: Request) -> list[int]:
        """The names of the request's full pages it may take from the prefix cache (all but
        its last token's); none for a penalized request, whose every token must run as a row
        to be counted (`sampling.record_rows`)."""
        if request.sampling.penalized:
            return []
        return self._hashes(request, (len(request.tokens) - 1) // self.page_size)

    def _preempt(self, request: Request, *, counted: bool = True) -> None:
        """Returns a running request's pages and slot; it waits again (in arrival order) to
        recompute what it had (`counted`: a preemption, not an admission undone)."""
        self._retire(request)
        self.preemptions += counted
        request.computed = request.named = 0
        position = next(
            (i for i, r in enumerate(self.waiting) if r.order > request.order), len(self.waiting)
        )
        self.waiting.insert(position, request)

    def _retire(self, request: Request) -> None:
        self.running.remove(request)
        self.pools[request.rank].release(request.pages)
        self._free_slots[request.rank].append(request.slot)
        request.pages, request.rank, request.slot = [], None, None

    def update(self, chunks: Sequence[Chunk], output: StepOutput) -> list[Token]:
        """Records a step's draws (its chunks were counted as computed when scheduled): each
        sampling chunk's token joins its request (a preempted one's too: it was computed
        before), which retires at once if the token ends it; full pages of known tokens are
        named for reuse. Chunks of requests aborted or finished since are skipped (a request
        that met a stop id may have run one token more, never read)."""
        drawn = []
        for chunk in chunks:
            request = self._by_order.get(chunk.key)
            if request is None or not chunk.sample:
                continue
            where = (chunk.rank, chunk.slot)
            token = int(output.tokens[where])
            request.drawing -= 1
            request.output.append(token)
            finish = None
            if token in request.stop_ids:
                finish = Finish.STOP
            elif len(request.output) >= request.max_tokens:
                finish = Finish.LENGTH
            if finish is not None:
                request.finish = finish
                del self._by_order[request.order]
                if request in self.running:
                    self._retire(request)
                else:
                    self.waiting.remove(request)
            elif request in self.running:
                self._name_pages(request)
            drawn.append(
                Token(
                    request,
                    token,
                    float(output.logprobs[where]),
                    tuple(int(i) for i in output.top_ids[where]),
                    tuple(float(p) for p in output.top_logprobs[where]),
                    finish,
                )
            )
        for request in {self._by_order.get(c.key) for c in chunks if not c.sample} - {None}:
            if request in self.running:
                self._name_pages(request)
        return drawn

    def _name_pages(self, request: Request) -> None:
        full = min(request.computed, len(request.tokens)) // self.page_size
        first = request.named // self.page_size
        if full <= first:
            return
        hashes = self._hashes(request, full)
        pool = self.pools[request.rank]
        for index in range(first, full):
            pool.name(request.pages[index], hashes[index])
        request.named = full * self.page_size
