"""The OpenAI-compatible server on the tiny text checkpoint (tests/golden/text: a tokenizer, a
chat template, end-of-sequence ids): the openai client and raw HTTP, 32 concurrent requests
whose greedy answers equal `generate` of each prompt alone, prefix reuse seen in /metrics,
and the faults (bad requests, a disconnect, a full cache, a stop with requests running)."""

import asyncio
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

import boundary_jax as bj
from models.build import load_model
from models.serving import engine as engine_module
from models.serving import server as server_module
from models.serving.api import (
    ChoiceText,
)
from models.serving.engine import Engine
from models.serving.generation import generate_ids
from models.serving.paged import PagedRunner, SlotSampling
from models.serving.runtime import ShardedCausalLM
from models.serving.scheduler import Finish, Request
from models.serving.server import Server
from models.serving.text import eos_token_ids, text_codec
from tests.models.serving.http_harness import HTTP, Listening
from tests.models.serving.test_paged import NEW_TOKENS, penalized_choices

TEXT = pathlib.Path(__file__).parents[2] / "golden" / "text"
ROOT = pathlib.Path(__file__).parents[3]
MODEL = "tiny"
WORDS = [
    "the",
    "market",
    "opened",
    "and",
    "a",
    "quiet",
    "wind",
    "ran",
    "over",
    "the",
    "stitched",
    "roofs",
    "of",
    "the",
    "old",
    "town",
]


class Served(Listening):
    """The model, its codec and eos ids, and a server on a free port of this host."""

    def __init__(self):
        mesh = bj.make_mesh(bj.Topology())
        self.runner = ShardedCausalLM(load_model(TEXT, mesh), mesh)
        self.codec = text_codec(TEXT, self.runner.config.vocab_size)
        self.eos = eos_token_ids(TEXT)
        # 24 pages of 4 tokens: 96 tokens for 8 slots; the 32 requests may preempt one another.
        paged = PagedRunner(
            self.runner, page_size=4, pages_per_rank=24, slots_per_rank=8, max_rows=32
        )
        self.engine = Engine(paged)
        super().__init__(Server(self.engine, self.codec, model_name=MODEL, eos_ids=self.eos))

    def expected(self, ids: list[int], max_tokens: int) -> list[int]:
        """`generate` of this prompt alone, up to its first eos id."""
        return generate_ids(self.runner, [ids], max_tokens, eos_ids=self.eos)[0]

    def text(self, ids: list[int]) -> str:
        return self.codec.decode([t for t in ids if t not in self.eos])


@pytest.fixture(scope="module")
def served():
    served = Served()
    yield served
    served.close()


def _prompt(index: int) -> str:
    return " ".join(WORDS[index % 5 : index % 5 + 1 + index % 11])


def test_32_concurrent_requests_equal_generate_alone(served):
    """32 concurrent requests through the openai client, half streamed, of mixed prompt and
    output lengths: each greedy answer is `generate`'s for its prompt alone (to its eos)."""
    cases = [(_prompt(i % 8), 3 + (i * 7) % 20, i % 2 == 0) for i in range(32)]

    async def ask(client, prompt: str, max_tokens: int, stream: bool) -> tuple[str, str]:
        options = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        if not stream:
            answer = await client.completions.create(**options)
            return answer.choices[0].text, answer.choices[0].finish_reason
        text, finish = "", None
        async for chunk in await client.completions.create(**options, stream=True):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def ask_all():
        url = f"{served.url}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as client:
            return await asyncio.gather(*(ask(client, *case) for case in cases))

    answers = asyncio.run(ask_all())
    # Greedy tokens do not depend on how many follow: each prompt's longest run, cut.
    longest = {prompt: served.expected(served.codec.encode(prompt), 22) for prompt, *_ in cases}
    for (prompt, max_tokens, _), (text, finish) in zip(cases, answers, strict=True):
        want = longest[prompt][:max_tokens]
        assert text == served.text(want), prompt
        assert finish == ("stop" if want[-1] in served.eos else "length")
    assert served.metric("boundary_jax_kv_blocks_used") == 0


def test_raw_http_token_ids_logprobs_stream_and_chat(served):
    """Raw HTTP: a token-id prompt streamed as server-sent events, with top-5 logprobs whose
    first entry is the greedy token; a chat through the template equals `generate` of the
    rendered ids; /v1/models and /health answer."""
    ids = served.codec.encode("the old town")
    want = served.expected(ids, 6)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 5}
    body["stop"] = ["a stop string never met"]  # holds text back while the stream runs
    events = []
    with HTTP.stream("POST", f"{served.url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == served.text(want)
    tops = [
        top
        for c in chunks
        if c["choices"][0]["logprobs"]
        for top in c["choices"][0]["logprobs"]["top_logprobs"]
    ]
    assert len(tops) == len(want) and all(len(top) == 5 for top in tops)
    whole = HTTP.post(f"{served.url}/v1/completions", json=body).json()
    logprobs = whole["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"][0] == pytest.approx(max(logprobs["top_logprobs"][0].values()))
    streamed_offsets = [
        offset
        for c in chunks
        if c["choices"][0]["logprobs"]
        for offset in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert streamed_offsets == logprobs["text_offset"]
    assert logprobs["text_offset"][-1] == len("".join(logprobs["tokens"][:-1]))
    # As OpenAI's completions: the sampled token is among the top, logprobs 0 included.
    only = HTTP.post(f"{served.url}/v1/completions", json=body | {"logprobs": 0}).json()
    only = only["choices"][0]["logprobs"]
    assert only["tokens"] == logprobs["tokens"]
    for token, logprob, top in zip(
        only["tokens"], only["token_logprobs"], only["top_logprobs"], strict=True
    ):
        assert top == {token: logprob}
    messages = [{"role": "user", "content": "a quiet wind"}]
    chat = HTTP.post(
        f"{served.url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0},
    ).json()
    want = served.expected(served.codec.encode_messages(messages), 8)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": served.text(want)}
    assert chat["usage"]["completion_tokens"] == len(want)
    assert HTTP.get(f"{served.url}/v1/models").json()["data"][0]["id"] == MODEL
    assert HTTP.get(f"{served.url}/health").json() == {"status": "ok"}


def test_sampling_n_seed_and_stops(served):
    """n choices with a seed are reproducible and differ; a stop string cuts the text before
    it; a stop id ends the choice without its text; penalties, a logit bias, a response format
    and tools at their neutral values change nothing."""
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
    options = dict(model=MODEL, prompt="the market", max_tokens=10, temperature=1.0, top_p=0.9)
    first = client.completions.create(**options, n=3, seed=5, extra_body={"top_k": 50})
    again = client.completions.create(**options, n=3, seed=5, extra_body={"top_k": 50})
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices] and len(set(texts)) > 1
    greedy = client.completions.create(
        model=MODEL, prompt="the market", max_tokens=10, temperature=0
    )
    full = greedy.choices[0].text
    neutral = {
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1,
        "min_p": 0,
        "min_tokens": 0,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "none",
    }
    plain = client.completions.create(
        model=MODEL, prompt="the market", max_tokens=10, temperature=0, extra_body=neutral
    )
    assert plain.choices[0].text == full  # the refused fields' neutral values are served
    stop = full[3:5]
    cut = client.completions.create(
        model=MODEL, prompt="the market", max_tokens=10, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    ids = served.expected(served.codec.encode("the market"), 10)
    by_id = HTTP.post(
        f"{served.url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": "the market",
            "max_tokens": 10,
            "temperature": 0,
            "stop": [ids[2]],
        },
    ).json()["choices"][0]
    assert by_id["text"] == served.text(ids[:2]) and by_id["finish_reason"] == "stop"


def test_usage_counts_the_tokens_up_to_the_stop_string(served, monkeypatch):
    """completion_tokens counts the tokens up to the one completing a stop string, streamed or
    not, though the engine runs on until the abort reaches it (here the abort holds the
    response's thread while the engine runs)."""
    ids = served.codec.encode("the market")
    full = served.expected(ids, 12)
    stop = served.text(full[1:3])
    text, taken = ChoiceText(served.codec, [stop]), 0
    while not text.stopped:
        text.push([full[taken]])
        taken += 1
    abort = served.engine.abort

    def late_abort(request: Request) -> None:
        time.sleep(0.5)
        abort(request)

    monkeypatch.setattr(served.engine, "abort", late_abort)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0, "stop": [stop]}
    whole = HTTP.post(f"{served.url}/v1/completions", json=body).json()
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == taken
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with HTTP.stream("POST", f"{served.url}/v1/completions", json=stream) as r:
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == taken


@pytest.mark.slow
def test_sampling_options_are_served(served):
    """Presence, frequency and repetition penalties reach the draw: a greedy completion with
    them is the greedy penalized one (`test_paged.penalized_choices` step by step), not the plain
    greedy one; min_p 1 at temperature 1 is greedy, whatever the seed; min_tokens holds a stop
    id (the greedy first token) back for that many tokens; a logit bias of 100 on one token
    makes every token that one."""
    prompt = "the market opened the market opened the"
    ids = served.codec.encode(prompt)
    # Negative values reward repeats (this model's greedy answer repeats nothing).
    penalties = {"presence_penalty": -1.0, "frequency_penalty": -0.5, "repetition_penalty": 0.7}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "ignore_eos": True}
    answer = HTTP.post(
        f"{served.url}/v1/completions", json=body | penalties | {"temperature": 0}
    ).json()["choices"][0]["text"]
    want: list[int] = []
    for _ in range(NEW_TOKENS):  # each step's choice from the forward of the tokens so far
        (choices,) = penalized_choices(
            served.runner, [ids], [want + [0]], [SlotSampling(**penalties)]
        )
        want.append(choices[-1])
    assert answer == served.codec.decode(want)
    assert answer != served.codec.decode(generate_ids(served.runner, [ids], NEW_TOKENS)[0])
    greedy = HTTP.post(f"{served.url}/v1/completions", json=body | {"temperature": 0}).json()[
        "choices"
    ][0]["text"]
    for seed in (1, 2):
        narrow = body | {"temperature": 1.0, "min_p": 1.0, "seed": seed}
        text = HTTP.post(f"{served.url}/v1/completions", json=narrow).json()
        assert text["choices"][0]["text"] == greedy
    first = served.expected(ids, 1)[0]
    stopped = body | {"temperature": 0, "stop_token_ids": [first]}
    for min_tokens, at_least in ((0, 1), (3, 3)):
        answer = HTTP.post(
            f"{served.url}/v1/completions", json=stopped | {"min_tokens": min_tokens}
        )
        count = answer.json()["usage"]["completion_tokens"]
        assert count == 1 if min_tokens == 0 else count >= at_least
    forced = served.codec.encode(" town")[-1]
    biased = body | {"temperature": 0, "logit_bias": {str(forced): 100}}
    text = HTTP.post(f"{served.url}/v1/completions", json=biased).json()["choices"][0]["text"]
    assert text == served.codec.decode([forced] * NEW_TOKENS)


@pytest.mark.slow
def test_shared_prefix_reuses_pages_with_unchanged_outputs(served):
    """Requests after one with the same long prefix reuse its pages (counted in /metrics) and
    answer as `generate` alone does."""
    system = " ".join(WORDS * 2)
    before = served.metric("boundary_jax_prefix_reused_blocks_total")
    for tail in ("opened", "ran over", "roofs"):
        prompt = f"{system} {tail}"
        answer = HTTP.post(
            f"{served.url}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0},
        ).json()
        want = served.expected(served.codec.encode(prompt), 5)
        assert answer["choices"][0]["text"] == served.text(want)
    assert served.metric("boundary_jax_prefix_reused_blocks_total") - before >= 2 * 5


BAD = [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"prompt": "a"}, "model"),
    ({"model": "other", "prompt": "a"}, "model"),
    ({"model": MODEL, "prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 500}, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": "a", "temperature": 3}, "temperature"),
    ({"model": MODEL, "prompt": "a", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": 5}, "prompt"),
    ({"model": MODEL, "prompt": [[1, 999]]}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": "a", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "a", "stop": {"x": 1}}, "stop"),
    ({"model": MODEL, "prompt": "a", "logprobs": 9}, "logprobs"),
    ({"model": MODEL, "prompt": "a", "stream": "yes"}, "stream"),
    ({"model": MODEL, "prompt": "a", "seed": 1.5}, "seed"),
    ({"model": MODEL, "prompt": "a", "echo": True}, "echo"),
    ({"model": MODEL, "prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": MODEL, "prompt": "a", "frequency_penalty": "x"}, "frequency_penalty"),
    ({"model": MODEL, "prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": MODEL, "prompt": "a", "min_p": 1.5}, "min_p"),
    ({"model": MODEL, "prompt": "a", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"model": MODEL, "prompt": "a", "min_tokens": -1}, "min_tokens"),
    (
        {"model": MODEL, "prompt": "a", "min_tokens": 2, "stop_token_ids": list(range(70))},
        "min_tokens",
    ),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"five": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
    ({"model": MODEL, "prompt": "a", "temperature": 10**400}, "temperature"),
    (f'{{"model": "{MODEL}", "prompt": "a", "top_p": 1{"0" * 5000}}}'.encode(), None),
    ({"model": MODEL, "prompt": "a", "top_k": 2**31}, "top_k"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "min_tokens": 2**31},
        "min_tokens",
    ),
    (
        {"model": MODEL, "prompt": "a", "stream": True, "stream_options": {"include_usage": "no"}},
        "include_usage",
    ),
    ({"model": MODEL, "prompt": "a", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    (
        {"model": MODEL, "prompt": "a", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    ({"model": MODEL, "prompt": "a", "tools": [{"type": "function"}]}, "tools"),
    (
        {"model": MODEL, "prompt": "a", "include_stop_str_in_output": True},
        "include_stop_str_in_output",
    ),
    ({"model": MODEL, "prompt": "a", "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"model": MODEL, "messages": "hi"}, "messages"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
    ),
]


def test_malformed_requests_get_400_and_good_ones_answers(served):
    """42 bad requests interleaved with good ones, concurrently: every bad one is a 400 with an
    OpenAI error body naming the field; every good one is answered."""

    async def send(client: httpx.AsyncClient, index: int):
        if index % 2:
            body, _ = BAD[index // 2]
            path = "/v1/chat/completions" if "messages" in str(body) else "/v1/completions"
            if isinstance(body, bytes):
                return await client.post(path, content=body)
            return await client.post(path, json=body)
        good = {"model": MODEL, "prompt": _prompt(index), "max_tokens": 3, "temperature": 0}
        return await client.post("/v1/completions", json=good)

    async def send_all():
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            return await asyncio.gather(*(send(client, i) for i in range(2 * len(BAD))))

    answers = asyncio.run(send_all())
    for index, answer in enumerate(answers):
        if index % 2:
            _, param = BAD[index // 2]
            assert answer.status_code == 400, (BAD[index // 2], answer.text)
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"]
            assert error["param"] == param, (BAD[index // 2], error)
        else:
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] is not None
    missing = HTTP.post(f"{served.url}/v1/nothing", json={})
    assert missing.status_code == 404 and "error" in missing.json()


def test_request_that_cannot_fit_the_cache_is_refused(served):
    """Within the context but more pages than a rank holds: 400 at once, not a hung request."""
    answer = HTTP.post(
        f"{served.url}/v1/completions",
        json={"model": MODEL, "prompt": "a b", "max_tokens": 110, "temperature": 0},
    )
    assert answer.status_code == 400
    assert "cache pages" in answer.json()["error"]["message"]


def test_disconnect_mid_stream_frees_its_pages(served):
    """A client that leaves after the first chunk: its request is aborted and its pages return
    at the next step."""
    body = {"model": MODEL, "prompt": "the", "max_tokens": 90, "temperature": 0}
    body.update(stream=True, ignore_eos=True)
    generated = served.metric("boundary_jax_generated_tokens_total")
    with HTTP.stream("POST", f"{served.url}/v1/completions", json=body) as answer:
        next(answer.iter_lines())
    deadline = time.monotonic() + 30
    while not served.engine.scheduler.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.engine.scheduler.idle
    assert served.metric("boundary_jax_generated_tokens_total") - generated < 90
    assert served.metric("boundary_jax_kv_blocks_used") == 0
    assert served.metric("boundary_jax_requests_running") == 0


@pytest.fixture
def engine(served):
    """An engine of its own (no thread) on the served pools; the served engine forgets its
    cached pages afterwards, which this one may have overwritten."""
    yield Engine(served.engine.paged)
    served.engine.scheduler.forget_pages()


def test_stop_cancels_what_outlives_the_grace_period(engine):
    """An engine stopped with no grace aborts the requests it holds; their listeners hear it."""
    heard = []
    request = Request("long", [1, 2, 3], 50)
    engine.submit(request, heard.append)
    engine.run_once()
    engine.stop(0.0)
    assert request.finish is Finish.ABORT and heard[-1].finish is Finish.ABORT
    assert engine.scheduler.used_pages == 0


@pytest.mark.slow
def test_sigterm_finishes_running_requests_and_exits_0(tmp_path):
    """`boundary-jax serve`: SIGTERM while a request streams lets it finish (within the grace
    period) and the process exits 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "models.cli", "serve", "--checkpoint", str(TEXT)]
    command += ["--port", str(port), "--page-size", "4", "--kv-cache-gb", "0.01"]
    command += ["--max-running", "4", "--max-tokens-per-step", "32", "--served-model-name", MODEL]
    process = subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if HTTP.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"model": MODEL, "prompt": "the market", "max_tokens": 40, "temperature": 0}
        body.update(stream=True, ignore_eos=True)
        pieces = []
        with HTTP.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as answer:
            lines = answer.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:]))
                    break
            process.send_signal(signal.SIGTERM)
            for line in lines:
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:]))
        assert pieces[-1]["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(served, engine, monkeypatch):
    """A step that raises fails the running requests (their listeners get the error); the
    pools start afresh and the next request is answered as `generate` answers it."""
    heard = []
    broken = Request("broken", [5, 6, 7], 4)
    engine.submit(broken, heard.append)
    launch = served.engine.paged.launch

    def fail(*args):
        monkeypatch.setattr(served.engine.paged, "launch", launch)
        raise RuntimeError("device lost")

    monkeypatch.setattr(served.engine.paged, "launch", fail)
    engine.run_once()
    assert isinstance(heard[-1], RuntimeError) and broken.finish is Finish.ABORT
    assert engine.scheduler.used_pages == 0
    prompt = served.codec.encode("the old town")
    after = Request("after", prompt, 5, stop_ids=frozenset(served.eos))
    engine.submit(after, lambda token: None)
    while engine.run_once():
        pass
    assert after.output == served.expected(prompt, 5)


def test_a_step_the_followers_cannot_be_sent_fails_its_requests_only(engine, monkeypatch):
    """Process 0 of several: a step whose message to the other processes cannot be made fails
    the running requests before anything launches; the loop goes on, sending the next step."""
    sent = []

    class Channel:
        def send(self, kind, payload=None):
            sent.append(kind)

        def settle(self, launched):
            pass

    def unencodable(*args):
        monkeypatch.setattr(engine_module, "encode", encode)
        raise OverflowError("Python integer 2147483648 out of bounds for int32")

    encode = engine_module.encode
    monkeypatch.setattr(engine_module, "encode", unencodable)
    engine.channel = Channel()
    heard = []
    broken = Request("broken", [5, 6, 7], 4)
    engine.submit(broken, heard.append)
    engine.run_once()
    assert isinstance(heard[-1], OverflowError) and broken.finish is Finish.ABORT
    assert sent == [] and engine.scheduler.used_pages == 0
    after = Request("after", [5, 6, 7], 2)
    engine.submit(after, lambda token: None)
    while engine.run_once():
        pass
    assert len(after.output) == 2 and sent


def test_a_listener_that_raises_loses_its_request_only(engine):
    """A listener that raises (a caller whose event loop closed) ends its request; the others
    run on."""

    def gone(token):
        raise RuntimeError("Event loop is closed")

    lost, kept = Request("lost", [5, 6], 6), Request("kept", [7, 8], 3)
    engine.submit(lost, gone)
    engine.submit(kept, lambda token: None)
    while engine.run_once():
        pass
    assert lost.finish is Finish.ABORT and len(lost.output) == 1
    assert kept.finish is Finish.LENGTH and len(kept.output) == 3
    assert engine.scheduler.used_pages == 0


def test_a_handler_that_fails_answers_500_and_the_server_goes_on(served, monkeypatch):
    """An unexpected error while handling a request is a 500 with an OpenAI error body; the
    next request is answered."""

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer crashed")

    body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "temperature": 0}
    with monkeypatch.context() as patch:
        patch.setattr(server_module, "parse_request", broken)
        failed = HTTP.post(f"{served.url}/v1/completions", json=body)
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error"
    assert "tokenizer crashed" in failed.json()["error"]["message"]
    assert HTTP.post(f"{served.url}/v1/completions", json=body).status_code == 200
