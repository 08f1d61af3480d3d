"""Serving over several processes (`models.serving.lockstep`): a step's schedule survives its
encoding and JAX's broadcast, and a follower replaying what process 0's engine sent writes the
same cache pages and tables (so draws the same tokens) as process 0, simulated in one process."""

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest

import boundary_jax as bj
from models.build import load_model
from models.serving.engine import Engine
from models.serving.generation import generate_ids
from models.serving.lockstep import Channel, Kind, decode, encode, follow
from models.serving.paged import Chunk, PagedRunner, SlotSampling
from models.serving.runtime import ShardedCausalLM
from models.serving.scheduler import Finish, Request
from models.serving.text import eos_token_ids, text_codec

TEXT = pathlib.Path(__file__).parents[2] / "golden" / "text"
ROOT = pathlib.Path(__file__).parents[3]
PROMPTS = ["the market opened", "a quiet wind ran over", "the old town", "stitched roofs of"]


def test_schedule_round_trips_through_encoding_and_broadcast():
    """Chunks (their prompt lengths, first flags, logit biases and held stops too), their
    sampling (a seed above 2**31, float temperature, min-p, penalties and min_tokens, greedy
    where absent) and page rows come back as sent, through `Channel`'s broadcast too."""
    chunks = [
        Chunk(0, 3, (5, 6, 7), 4, True, key=9, adapter=2, prompt_length=6, first=True),
        Chunk(0, 1, (4,), 0, False, first=True, held_stops=(2, 7)),
        Chunk(1, 0, (8,), 11, True, previous=True, prompt_length=3),
        Chunk(1, 2, (1, 2), 0, False),
    ]
    sampling = {
        (0, 3): SlotSampling(0.7, 40, 0.9, 2**32 - 5, 0.05, 0.5, -0.25, 1.2, min_tokens=3),
        (0, 1): SlotSampling(logit_bias=((3, 0.5), (9, -100.0))),
    }
    pages = {(0, 3): [4, 1, 2], (1, 0): [7]}
    words = encode(chunks, sampling, pages)
    kind, words = Channel()._broadcast(Kind.STEP, words)
    got_chunks, got_sampling, got_pages = decode(words)
    assert kind is Kind.STEP
    assert got_chunks == [dataclass_without_key(c) for c in chunks]
    floats = (np.float32(x) for x in (0.05, 0.5, -0.25, 1.2))
    want = SlotSampling(np.float32(0.7), 40, np.float32(0.9), 2**32 - 5, *floats, min_tokens=3)
    assert got_sampling[(0, 3)] == want
    assert got_sampling[(0, 1)] == sampling[(0, 1)]
    assert got_sampling[(1, 0)] == SlotSampling() == got_sampling[(1, 2)]
    assert [list(got_pages[w]) for w in ((0, 3), (1, 0), (1, 2), (0, 1))] == [
        [4, 1, 2],
        [7],
        [],
        [],
    ]


def dataclass_without_key(chunk: Chunk) -> Chunk:
    return dataclasses.replace(chunk, key=-1)


def snapshot(paged: PagedRunner) -> list[np.ndarray]:
    """The runner's tables, cache pools and token histories on the host."""
    state = jax.tree.leaves((paged._pools, paged._history))
    return [paged.tables.copy(), *(np.asarray(array) for array in state)]


def replay(paged: PagedRunner, channel: Channel) -> list[np.ndarray]:
    """What a follower starting afresh on `paged` (its compiled programs kept) ends with."""
    paged.reset()
    paged.tables[:] = 0
    follow(paged, channel)
    return snapshot(paged)


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

    paged = PagedRunner(runner, page_size=4, pages_per_rank=16, slots_per_rank=4, max_rows=16)
    channel = Recorded()
    engine = Engine(paged, channel=channel)
    requests = [
        Request("a", [3, 4, 5, 6, 7], 6, sampling=SlotSampling(temperature=0.9, seed=3)),
        Request(
            "b", [9, 8], 5, sampling=SlotSampling(repetition_penalty=1.3, presence_penalty=0.2)
        ),
    ]
    for request in requests:
        engine.submit(request, lambda token: None)
    while engine.busy:
        engine.run_once()
    engine.stop(0.0)
    assert all(r.finish is Finish.LENGTH for r in requests)
    assert channel.messages[-1][0] is Kind.STOP
    messages = list(channel.messages)

    leader = snapshot(paged)
    for ours, theirs in zip(replay(paged, channel), leader, strict=True):
        np.testing.assert_array_equal(ours, theirs)

    steps = [i for i, (kind, _) in enumerate(messages) if kind is Kind.STEP]
    channel.messages = messages[: steps[-3]] + messages[steps[-3] + 1 :]
    stale = replay(paged, channel)
    assert any(not np.array_equal(a, b) for a, b in zip(stale, leader, strict=True))


def _ask(url: str, prompt: str, stream: bool) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    if not stream:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0][
            "text"
        ]
    text = ""
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess")
def test_serve_under_launch_equals_generate_and_stops_every_process_cleanly():
    """`launch --processes 2 -- serve` on a DP 2 x TP 2 mesh across both processes: concurrent
    greedy completions (streamed and not) equal `generate` of each prompt alone in one
    process, after every process compiled the step programs in lockstep (`--warm-up`);
    SIGTERM to the launcher stops every process with exit code 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "models.cli", "launch", "--processes", "2", "--", "serve"]
    command += ["--checkpoint", str(TEXT), "--mesh", "attn_tp=2,attn_dp=2", "--port", str(port)]
    command += ["--page-size", "4", "--kv-cache-gb", "0.01", "--max-running", "4"]
    command += ["--max-tokens-per-step", "32", "--served-model-name", "tiny", "--warm-up"]
    launcher = subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(
                pool.map(_ask, [url] * len(PROMPTS), PROMPTS, [i % 2 == 0 for i in range(4)])
            )
        launcher.send_signal(signal.SIGTERM)
        _, errors = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    mesh = bj.make_mesh(bj.Topology())
    runner = ShardedCausalLM(load_model(TEXT, mesh), mesh)
    codec, eos = text_codec(TEXT, runner.config.vocab_size), eos_token_ids(TEXT)
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        ids = generate_ids(runner, [codec.encode(prompt)], 8, eos_ids=eos)[0]
        assert answer == codec.decode([t for t in ids if t not in eos]), prompt
    assert "exited with code" not in errors, errors
    assert "warm-up:" in errors and "step programs compiled" in errors, errors
