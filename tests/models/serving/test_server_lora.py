"""LoRA adapters per request on the OpenAI-compatible server (the tiny Qwen3 checkpoint and its
two golden PEFT adapters): a concurrent batch mixing a1, a2 and the base model answers as
`generate` of each prompt alone through its adapter, prefix pages are never shared between
adapters, and an unknown adapter is a 400."""

import asyncio
import pathlib

import httpx
import pytest

import boundary_jax as bj
from models.build import load_model
from models.options import BuildOptions
from models.serving.engine import Engine
from models.serving.generation import generate_ids
from models.serving.paged import PagedRunner
from models.serving.runtime import ShardedCausalLM
from models.serving.server import Server
from models.serving.text import eos_token_ids
from tests.models.serving.http_harness import HTTP, Listening

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
CHECKPOINT = GOLDEN / "qwen3"
ADAPTERS = {name: GOLDEN / "lora" / "qwen3" / name for name in ("a1", "a2")}
MODEL = "tiny-qwen3"


class IdCodec:
    """Each id as one character (the checkpoint has no tokenizer and fewer than 256 ids), so
    an answer's text names its ids exactly."""

    description = "one character per id"
    byte_ids = frozenset()

    def encode(self, text: str) -> list[int]:
        return [ord(char) - 0x4E00 for char in text]

    def encode_chat(self, text: str) -> list[int]:
        raise ValueError("no chat template")

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


class Served(Listening):
    """The checkpoint with both adapters behind a server on a free port of this host."""

    def __init__(self):
        mesh = bj.make_mesh(bj.Topology())
        model = load_model(CHECKPOINT, mesh, BuildOptions(), adapters=ADAPTERS)
        self.runner = ShardedCausalLM(model, mesh)
        self.codec = IdCodec()
        self.eos = eos_token_ids(CHECKPOINT)
        paged = PagedRunner(
            self.runner, page_size=4, pages_per_rank=48, slots_per_rank=6, max_rows=32
        )
        self.engine = Engine(paged)
        lora = self.runner.options.lora
        adapters = {name: lora.index(name) for name in lora.names}
        super().__init__(
            Server(self.engine, self.codec, model_name=MODEL, eos_ids=self.eos, adapters=adapters)
        )

    def expected(self, ids: list[int], max_tokens: int, adapter: str | None) -> str:
        """`generate` of this prompt alone through `adapter`, as the server's text."""
        out = generate_ids(self.runner, [ids], max_tokens, eos_ids=self.eos, adapters=[adapter])
        return self.codec.decode([t for t in out[0] if t not in self.eos])

    def ask(self, ids: list[int], max_tokens: int, adapter: str | None) -> httpx.Response:
        body = {"model": adapter or MODEL, "prompt": ids, "max_tokens": max_tokens}
        return HTTP.post(f"{self.url}/v1/completions", json={**body, "temperature": 0})


@pytest.fixture(scope="module")
def served():
    served = Served()
    yield served
    served.close()


def test_a_concurrent_batch_of_adapters_equals_generate_alone(served):
    """a1, a2 and the base model over the same prompts in one batch: each answer is that
    adapter's `generate` alone (prefill chunks and decode rows through the request's adapter)."""
    prompts = [[208, 69, 209, 135, 76, 8, 40], [160, 183, 69, 46, 134, 176, 223, 194, 157, 4]]
    cases = [(ids, adapter) for ids in prompts for adapter in ("a1", "a2", None)]
    models = HTTP.get(f"{served.url}/v1/models").json()["data"]
    assert [entry["id"] for entry in models] == [MODEL, "a1", "a2"]

    async def ask_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as client:

            async def ask(ids: list[int], adapter: str | None) -> dict:
                body = {"model": adapter or MODEL, "prompt": ids, "max_tokens": 6}
                response = await client.post(
                    f"{served.url}/v1/completions", json={**body, "temperature": 0}
                )
                return response.json()

            return await asyncio.gather(*(ask(ids, adapter) for ids, adapter in cases))

    answers = [answer["choices"][0]["text"] for answer in asyncio.run(ask_all())]
    wants = [served.expected(ids, 6, adapter) for ids, adapter in cases]
    assert answers == wants
    assert len({answers[0], answers[1], answers[2]}) > 1  # the adapters change the answer


@pytest.mark.slow
def test_a_shared_prefix_is_not_reused_across_adapters(served):
    """The same long prompt under a1 then a2 reuses no page (their keys and values differ);
    under a1 again it reuses a1's; every answer equals its adapter's `generate`."""
    ids = [(7 * i + 3) % 200 + 20 for i in range(17)]
    reused = "boundary_jax_prefix_reused_blocks_total"
    for adapter, reuses in (("a1", False), ("a2", False), (None, False), ("a1", True)):
        before = served.metric(reused)
        answer = served.ask(ids, 4, adapter).json()
        assert answer["choices"][0]["text"] == served.expected(ids, 4, adapter)
        assert (served.metric(reused) > before) == reuses


def test_an_unknown_adapter_is_a_400(served):
    response = served.ask([5, 6, 7], 2, "a3")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"
