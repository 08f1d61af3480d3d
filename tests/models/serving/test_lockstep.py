"""Serving over several processes (`models.serving.lockstep`): a step's schedule survives its
encoding and JAX's broadcast, and a follower replaying what process 0's engine sent writes the
same cache pages and tables (so draws the same tokens) as process 0, simulated in one process."""

import pathlib

import jax
import numpy as np

import boundary_jax as bj
from models.build import load_model
from models.serving.engine import Engine
from models.serving.lockstep import Channel, Kind, decode, encode, follow
from models.serving.paged import Chunk, PagedRunner, SlotSampling
from models.serving.runtime import ShardedCausalLM
from models.serving.scheduler import Finish, Request

TEXT = pathlib.Path(__file__).parents[2] / "golden" / "text"


def test_schedule_round_trips_through_encoding_and_broadcast():
    """Chunks, their sampling (a seed above 2**31, a float temperature, greedy where absent)
    and page rows come back as sent, through `Channel`'s broadcast too."""
    chunks = [
        Chunk(0, 3, (5, 6, 7), 4, True, key=9, adapter=2),
        Chunk(1, 0, (8,), 11, True, previous=True),
        Chunk(1, 2, (1, 2), 0, False),
    ]
    sampling = {(0, 3): SlotSampling(0.7, 40, 0.9, 2**32 - 5)}
    pages = {(0, 3): [4, 1, 2], (1, 0): [7]}
    words = encode(chunks, sampling, pages)
    kind, words = Channel()._broadcast(Kind.STEP, words)
    got_chunks, got_sampling, got_pages = decode(words)
    assert kind is Kind.STEP
    assert got_chunks == [dataclass_without_key(c) for c in chunks]
    assert got_sampling[(0, 3)] == SlotSampling(np.float32(0.7), 40, np.float32(0.9), 2**32 - 5)
    assert got_sampling[(1, 0)] == SlotSampling() == got_sampling[(1, 2)]
    assert [list(got_pages[w]) for w in ((0, 3), (1, 0), (1, 2))] == [[4, 1, 2], [7], []]


def dataclass_without_key(chunk: Chunk) -> Chunk:
    return Chunk(
        chunk.rank,
        chunk.slot,
        chunk.tokens,
        chunk.start,
        chunk.sample,
        previous=chunk.previous,
        adapter=chunk.adapter,
    )


def pools(one: PagedRunner, other: PagedRunner) -> list[tuple[np.ndarray, np.ndarray]]:
    """The two runners' cache pools, pair by pair, on the host."""
    pairs = zip(jax.tree.leaves(one._pools), jax.tree.leaves(other._pools), strict=True)
    return [(np.asarray(a), np.asarray(b)) for a, b in pairs]


class Recorded(Channel):
    """Process 0's messages kept in order, then handed to a follower in this process."""

    def __init__(self):
        self.messages: list[tuple[Kind, np.ndarray]] = []

    def send(self, kind, payload=None):
        self.messages.append((kind, np.zeros(0, np.int32) if payload is None else payload))

    def receive(self):
        return self.messages.pop(0)


def test_a_follower_replaying_the_schedule_writes_process_0s_cache():
    """Process 0's engine runs sampled and greedy requests (overlapped steps reading draws on
    the device); a follower given its messages ends with the same pools and tables, and a
    follower missing one step does not."""
    mesh = bj.make_mesh(bj.Topology())
    runner = ShardedCausalLM(load_model(TEXT, mesh), mesh)

    def paged():
        return PagedRunner(runner, page_size=4, pages_per_rank=16, slots_per_rank=4, max_rows=16)

    channel = Recorded()
    leader = paged()
    engine = Engine(leader, channel=channel)
    requests = [
        Request("a", [3, 4, 5, 6, 7], 6, sampling=SlotSampling(temperature=0.9, seed=3)),
        Request("b", [9, 8], 5),
    ]
    for request in requests:
        engine.submit(request, lambda token: None)
    while engine.busy:
        engine.run_once()
    engine.stop(0.0)
    assert all(r.finish is Finish.LENGTH for r in requests)
    assert channel.messages[-1][0] is Kind.STOP
    messages = list(channel.messages)

    follower = paged()
    follow(follower, channel)
    np.testing.assert_array_equal(follower.tables, leader.tables)
    for ours, theirs in pools(follower, leader):
        np.testing.assert_array_equal(ours, theirs)

    steps = [i for i, (kind, _) in enumerate(messages) if kind is Kind.STEP]
    channel.messages = messages[: steps[-3]] + messages[steps[-3] + 1 :]
    stale = paged()
    follow(stale, channel)
    assert any(not np.array_equal(ours, theirs) for ours, theirs in pools(stale, leader))
