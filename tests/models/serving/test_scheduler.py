"""The host side of continuous batching, without a model: page pools and the scheduler."""

import numpy as np
import pytest

from models.serving.blocks import PagePool, page_hashes
from models.serving.paged import SlotSampling, StepOutput
from models.serving.scheduler import Finish, Request, RequestRefused, Scheduler


def _scheduler(**overrides) -> Scheduler:
    options = dict(
        attn_dp=1, slots_per_rank=4, pages_per_rank=16, page_size=4, max_rows=8, max_context=64
    )
    return Scheduler(**{**options, **overrides})


def _output(scheduler: Scheduler, token: int = 1) -> StepOutput:
    shape = (scheduler.attn_dp, scheduler.slots_per_rank)
    return StepOutput(
        np.full(shape, token), np.zeros(shape), np.zeros((*shape, 5)), np.zeros((*shape, 5))
    )


def test_page_pool_counts_references_and_keeps_named_pages():
    """Held pages are not handed out; a released named page stays reusable until a fresh page
    is needed, then the oldest idle one goes."""
    pool = PagePool(3)
    first = pool.allocate(2)
    assert first == [0, 1] and pool.available == 1 and pool.allocate(2) is None
    names = page_hashes(list(range(8)), 4, 2)
    pool.name(first[0], names[0])
    pool.name(first[1], names[1])
    pool.release(first)
    assert pool.available == 3 and pool.cached == 2
    assert pool.lookup(names) == 2
    assert pool.match(names[:1]) == [0] and pool.refs(0) == 1 and pool.reused == 1
    assert pool.allocate(2) == [2, 1]  # the free page, then the idle named one (evicted)
    assert pool.lookup(names) == 1 and pool.cached == 1
    with pytest.raises(ValueError, match="not held"):
        pool.release([0, 0])


def test_page_names_chain_over_the_prefix_and_adapter():
    """A page's name depends on every token before it and on the adapter."""
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    b = page_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert a[0] != b[0] and a[1] != b[1]
    assert page_hashes([1, 2, 3, 4, 5], 4, 2) == a[:1]
    assert page_hashes([1, 2, 3, 4], 4, 1, root="adapter") != a[:1]


def test_chunked_prefill_under_the_token_budget_then_decode():
    """A 13-token prompt runs in chunks of 8 and 5 rows, the last sampling; a decode token each
    step after; the request retires at max_tokens with its pages returned."""
    scheduler = _scheduler()
    request = Request("a", list(range(13)), 3)
    scheduler.add(request)
    sizes = []
    while not scheduler.idle:
        chunks = scheduler.schedule()
        sizes.append([(len(c.tokens), c.start, c.sample) for c in chunks])
        scheduler.update(chunks, _output(scheduler))
    assert sizes == [[(8, 0, False)], [(5, 8, True)], [(1, 13, True)], [(1, 14, True)]]
    assert request.output == [1, 1, 1] and request.finish is Finish.LENGTH
    assert scheduler.used_pages == 0


def test_max_running_bounds_admission_over_all_ranks():
    """Five running at most over two ranks of three slots each: the sixth waits, and takes
    the slot a finished request frees."""
    scheduler = _scheduler(attn_dp=2, slots_per_rank=3, max_running=5)
    for name in "abcdefg":
        scheduler.add(Request(name, [1, 2], 1))
    chunks = scheduler.schedule()
    assert len(chunks) == 5 and len(scheduler.running) == 5
    assert sorted(c.rank for c in chunks) == [0, 0, 0, 1, 1]
    scheduler.update(chunks, _output(scheduler))
    assert len(scheduler.schedule()) == 2 and len(scheduler.running) == 2


def test_budget_is_shared_and_slots_bound_admission():
    """Decode tokens of running requests come first; prompts fill what the budget leaves; no more
    requests run than slots."""
    scheduler = _scheduler(slots_per_rank=2)
    for name in "abc":
        scheduler.add(Request(name, [1, 2, 3], 4))
    chunks = scheduler.schedule()
    assert [len(c.tokens) for c in chunks] == [3, 3]
    assert [r.id for r in scheduler.running] == ["a", "b"] and len(scheduler.waiting) == 1
    scheduler.update(chunks, _output(scheduler))
    assert [len(c.tokens) for c in scheduler.schedule()] == [1, 1]


def test_stop_id_retires_at_once_and_frees_the_slot():
    """A stop id ends the request in the step that drew it; the next waiting one is admitted."""
    scheduler = _scheduler(slots_per_rank=1)
    first, second = Request("a", [1, 2], 5, stop_ids=frozenset({7})), Request("b", [3], 2)
    scheduler.add(first)
    scheduler.add(second)
    drawn = scheduler.update(scheduler.schedule(), _output(scheduler, 7))
    assert drawn[0].finish is Finish.STOP and first.finish is Finish.STOP
    assert [c.tokens for c in scheduler.schedule()] == [(3,)]


def test_refuses_what_cannot_fit_even_alone():
    """Past the context, or more pages than a rank holds: refused at once, not queued."""
    scheduler = _scheduler(pages_per_rank=4)
    with pytest.raises(RequestRefused, match="context"):
        scheduler.add(Request("a", [1] * 60, 10))
    with pytest.raises(RequestRefused, match="cache pages"):
        scheduler.add(Request("b", [1] * 10, 10))
    with pytest.raises(RequestRefused, match="non-empty"):
        scheduler.add(Request("c", [], 1))
    assert scheduler.idle


def test_a_request_whose_run_positions_fill_the_pool_runs_alone():
    """The last token drawn is never run, so prompt + max_tokens - 1 positions are cached: 13
    + 4 tokens in 4 pages of 4 run to the end without preemption; one token more is refused."""
    scheduler = _scheduler(pages_per_rank=4, max_rows=16)
    request = Request("a", list(range(13)), 4)
    scheduler.add(request)
    while not scheduler.idle:
        scheduler.update(scheduler.schedule(), _output(scheduler))
    assert request.finish is Finish.LENGTH and len(request.output) == 4
    assert scheduler.preemptions == 0 and scheduler.used_pages == 0
    with pytest.raises(RequestRefused, match="need 5 cache pages"):
        scheduler.add(Request("b", list(range(13)), 5))


def test_full_cache_preempts_the_newest_which_recomputes():
    """Two requests that outgrow the pool: the newer one is preempted (its pages returned) and
    readmitted later to recompute its prompt and tokens; both finish."""
    scheduler = _scheduler(pages_per_rank=5, max_rows=16)
    old, new = Request("old", [1] * 7, 8), Request("new", [2] * 7, 8)
    scheduler.add(old)
    scheduler.add(new)
    recomputed, first_preempted = [], None
    while not scheduler.idle:
        chunks = scheduler.schedule()
        if scheduler.preemptions and first_preempted is None:
            first_preempted = [r.id for r in scheduler.waiting]
            assert old.pages and not new.pages and new.computed == 0
        recomputed += [c for c in chunks if c.start == 0 and scheduler.preemptions]
        scheduler.update(chunks, _output(scheduler))
    assert first_preempted == ["new"]
    assert any(len(c.tokens) > 7 for c in recomputed)  # prompt + tokens drawn before
    assert old.output == [1] * 8 and new.output == [1] * 8
    assert scheduler.used_pages == 0


def test_shared_prefix_pages_are_reused_not_recomputed():
    """A second request with the first's 9-token prefix reuses its two full pages (8 tokens);
    the page holding the last prompt token is always computed."""
    scheduler = _scheduler()
    first = Request("a", list(range(9)) + [50], 2)
    scheduler.add(first)
    scheduler.update(scheduler.schedule(), _output(scheduler))
    second = Request("b", list(range(9)) + [60, 61], 2)
    scheduler.add(second)
    chunks = scheduler.schedule()
    extend = next(c for c in chunks if c.slot == second.slot)
    assert extend.start == 8 and extend.tokens == (8, 60, 61)
    assert second.pages[:2] == first.pages[:2] and scheduler.reused_pages == 2
    assert scheduler.pools[0].refs(first.pages[0]) == 2


def test_a_penalized_request_reuses_no_prefix_and_carries_its_prompt_length():
    """A request with a penalty computes its whole prompt from position 0 though its prefix is
    cached (its token history counts every row); its pages are still named for others. Every
    chunk carries its request's prompt length."""
    scheduler = _scheduler()
    first = Request("a", list(range(9)) + [50], 2)
    scheduler.add(first)
    scheduler.update(scheduler.schedule(), _output(scheduler))
    assert not SlotSampling(min_p=0.1).penalized  # min-p reads no history
    penalized = Request(
        "b", list(range(9)) + [60, 61], 2, sampling=SlotSampling(frequency_penalty=1)
    )
    scheduler.add(penalized)
    chunks = scheduler.schedule()
    extend = next(c for c in chunks if c.slot == penalized.slot)
    assert extend.start == 0 and extend.tokens == tuple(range(len(extend.tokens)))
    assert scheduler.reused_pages == 0
    assert {(c.slot, c.prompt_length) for c in chunks} == {(first.slot, 10), (extend.slot, 11)}


def test_abort_returns_pages():
    """An aborted request leaves the running set and its pages return."""
    scheduler = _scheduler()
    request = Request("a", [1] * 6, 4)
    scheduler.add(request)
    scheduler.update(scheduler.schedule(), _output(scheduler))
    assert scheduler.used_pages == 2
    assert scheduler.abort(request) and request.finish is Finish.ABORT
    assert scheduler.used_pages == 0 and scheduler.idle and not scheduler.abort(request)


def test_dp_ranks_balance_admission():
    """Requests spread over DP ranks by pages available."""
    scheduler = _scheduler(attn_dp=2)
    for name in "ab":
        scheduler.add(Request(name, [1, 2, 3, 4, 5], 2))
    scheduler.schedule()
    assert sorted(r.rank for r in scheduler.running) == [0, 1]


def test_random_loads_keep_every_step_consistent():
    """Random prompts arriving over time on two ranks with small pools (preemptions, requests
    readmitted behind newer ones, prefix reuse), 10 loads: each step's chunks belong to running
    requests whose pages hold them, every page's references are the requests holding it, and
    every request ends with max_tokens tokens."""
    preemptions = sum(_random_load(seed, overlap) for seed in range(10) for overlap in (0, 1))
    assert preemptions > 0


def _random_load(seed: int, overlap: bool) -> int:
    """One load; with `overlap` each step is scheduled before the previous one's draws are
    recorded (as the engine runs)."""
    rng = np.random.default_rng(seed)
    scheduler = _scheduler(attn_dp=2, slots_per_rank=3, pages_per_rank=10, max_rows=12)
    shared = rng.integers(0, 50, 4).tolist()
    requests = []
    for index in range(20):
        prompt = rng.integers(0, 50, int(rng.integers(1, 10))).tolist()
        if index % 3 == 0:
            prompt = shared + prompt[:4]
        requests.append(Request(str(index), prompt, int(rng.integers(1, 28))))
    pending, in_flight = list(requests), []
    for _ in range(3000):
        if pending and rng.random() < 0.3:
            scheduler.add(pending.pop(0))
        chunks = scheduler.schedule()
        by_slot = {(r.rank, r.slot): r for r in scheduler.running}
        assert len(by_slot) == len(scheduler.running)
        for chunk in chunks:
            request = by_slot[(chunk.rank, chunk.slot)]
            assert chunk.start + len(chunk.tokens) == request.computed
            assert len(request.pages) * 4 >= chunk.start + len(chunk.tokens)
        for rank, pool in enumerate(scheduler.pools):
            held = [p for r in scheduler.running if r.rank == rank for p in r.pages]
            for page in set(held):
                assert pool.refs(page) == held.count(page)
        if overlap:
            chunks, in_flight = in_flight, chunks
        scheduler.update(chunks, _output(scheduler))
        if not pending and scheduler.idle and not in_flight:
            break
    assert scheduler.idle and not pending
    assert all(len(r.output) == r.max_tokens and r.finish is Finish.LENGTH for r in requests)
    assert scheduler.used_pages == 0
    return scheduler.preemptions


def test_overlapped_steps_run_the_token_in_flight_next():
    """Scheduling step N + 1 before step N's draw is recorded: the request runs that token
    (read on the device, `previous`), unless it is its last by max_tokens; a stop id recorded
    late retires it, and the step already launched for it is ignored."""
    scheduler = _scheduler()
    request = Request("a", [1, 2, 3], 4, stop_ids=frozenset({7}))
    scheduler.add(request)
    first = scheduler.schedule()
    second = scheduler.schedule()  # step 1 still running
    assert [(c.start, c.previous, c.sample) for c in second] == [(3, True, True)]
    scheduler.update(first, _output(scheduler, 5))
    third = scheduler.schedule()
    assert [(c.start, c.previous) for c in third] == [(4, True)]
    scheduler.update(second, _output(scheduler, 7))  # the stop id
    assert request.finish is Finish.STOP and scheduler.used_pages == 0 and scheduler.idle
    assert scheduler.update(third, _output(scheduler, 9)) == []
    assert request.output == [5, 7]
    last = Request("b", [1], 2)
    scheduler.add(last)
    scheduler.schedule()
    assert [c.start for c in scheduler.schedule()] == [1]
    assert scheduler.schedule() == []  # its token in flight is its last
