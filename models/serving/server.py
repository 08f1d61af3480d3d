"""An OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI + uvicorn).

`/v1/completions` and `/v1/chat/completions` (whole answers, or server-sent events as OpenAI's
clients read them), `/v1/models`, `/health` and `/metrics` (Prometheus text). The device loop
runs on its own thread (`Engine`); a handler only queues requests and awaits their tokens,
which the loop hands over through the event loop, so the HTTP side never waits on the device.

A bad request is answered 400 with OpenAI's error body and touches nothing else. A client that
leaves mid-stream aborts its requests: their pages return at the next step. On SIGTERM (or
SIGINT) the server stops admitting (503), lets what runs finish within the grace period,
aborts the rest, and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .api import (
    TOKEN_CONTEXT,
    ApiError,
    ChoiceText,
    Endpoint,
    GenerationSpec,
    parse_request,
    token_text,
)
from .engine import Engine
from .scheduler import Finish, Request, RequestRefused, Token
from .text import TextCodec

FINISH_REASONS = {Finish.STOP: "stop", Finish.LENGTH: "length", Finish.ABORT: "abort"}


@dataclasses.dataclass
class _Choice:
    """One choice of a response as it runs."""

    index: int
    request: Request
    text: ChoiceText
    finish: str | None = None
    logprobs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # The ids taken before it finished: the engine may run on until its abort lands.
    ids: list[int] = dataclasses.field(default_factory=list)


class Server:
    """The HTTP side: parses requests, feeds the engine, shapes OpenAI responses.

    Attributes:
      engine: The device loop.
      codec: The model's text.
      model_name: The name clients put in `model`.
      eos_ids: Ids that end a choice unless `ignore_eos`.
      adapters: Served LoRA adapters: name -> index (`LoraSpec.index`); `model` may name one.
      sampling_defaults: What a request leaving out a sampling field takes
        (`api.sampling_defaults` of the checkpoint's generation_config.json; {}: OpenAI's).
      stopping: Set once a shutdown began: new requests get 503.
    """

    def __init__(
        self,
        engine: Engine,
        codec: TextCodec,
        *,
        model_name: str,
        eos_ids: Sequence[int] = (),
        adapters: Mapping[str, int] | None = None,
        sampling_defaults: Mapping[str, Any] | None = None,
    ):
        self.engine = engine
        self.sampling_defaults = dict(sampling_defaults or {})
        self.codec = codec
        self.model_name = model_name
        self.eos_ids = frozenset(eos_ids)
        self.adapters = dict(adapters or {})
        self.stopping = threading.Event()
        self.context = engine.paged.runner.config.max_position_embeddings
        self.vocab_size = engine.paged.runner.config.vocab_size
        self.app = self._app()

    def drain(self, grace: float) -> None:
        """Stops admitting, lets running requests finish for up to `grace` seconds, aborts
        the rest and ends the device loop."""
        self.stopping.set()
        self.engine.stop(grace)

    # -- the app ------------------------------------------------------------------------------

    def _app(self) -> FastAPI:
        app = FastAPI(title="boundary-jax", docs_url=None, redoc_url=None)

        @app.exception_handler(ApiError)
        async def api_error(request: HttpRequest, error: ApiError) -> JSONResponse:
            return JSONResponse(error.body(), status_code=error.status)

        @app.exception_handler(HTTPException)
        async def http_error(request: HttpRequest, error: HTTPException) -> JSONResponse:
            refused = ApiError(str(error.detail), status=error.status_code, code="not_found")
            return JSONResponse(refused.body(), status_code=error.status_code)

        @app.exception_handler(Exception)
        async def server_error(request: HttpRequest, error: Exception) -> JSONResponse:
            failed = ApiError(
                f"the server failed on this request: {type(error).__name__}: {error}",
                status=500,
                kind="server_error",
            )
            return JSONResponse(failed.body(), status_code=500)

        @app.post("/v1/completions")
        async def completions(request: HttpRequest) -> Response:
            return await self._generate(request, Endpoint.COMPLETIONS)

        @app.post("/v1/chat/completions")
        async def chat(request: HttpRequest) -> Response:
            return await self._generate(request, Endpoint.CHAT)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            names = [self.model_name, *self.adapters]
            return {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "boundary-jax"}
                    for name in names
                ],
            }

        @app.get("/health")
        async def health() -> JSONResponse:
            if self.stopping.is_set():
                return JSONResponse({"status": "stopping"}, status_code=503)
            return JSONResponse({"status": "ok"})

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            paged = self.engine.paged
            text = self.engine.metrics.text(total_pages=paged.pages_per_rank * paged.attn_dp)
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

        return app

    async def _generate(self, http: HttpRequest, endpoint: Endpoint) -> Response:
        if self.stopping.is_set():
            raise ApiError("the server is shutting down", status=503, kind="server_error")
        try:
            body = json.loads(await http.body())
        except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an integer too long
            raise ApiError(f"the body is not valid JSON: {error}") from None
        spec = parse_request(
            body,
            endpoint,
            codec=self.codec,
            vocab_size=self.vocab_size,
            model_name=self.model_name,
            adapters=self.adapters,
            defaults=self.sampling_defaults,
        )
        queue: asyncio.Queue = asyncio.Queue()
        choices = self._submit(spec, queue, asyncio.get_running_loop())
        name = "chatcmpl" if endpoint is Endpoint.CHAT else "cmpl"
        response_id = f"{name}-{uuid.uuid4().hex}"
        if spec.stream:
            return StreamingResponse(
                self._stream(spec, choices, queue, response_id), media_type="text/event-stream"
            )
        try:
            while any(choice.finish is None for choice in choices):
                self._take(spec, choices, *await queue.get())
        finally:
            self._abort_unfinished(choices)
        return JSONResponse(self._whole(spec, choices, response_id))

    def _submit(
        self, spec: GenerationSpec, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop
    ) -> list[_Choice]:
        """Every choice's request, all checked before any is queued."""
        stop_ids = spec.stop_ids | (frozenset() if spec.ignore_eos else self.eos_ids)
        choices = []
        for prompt in spec.prompts:
            for offset in range(spec.n):
                sampling = dataclasses.replace(
                    spec.sampling, seed=(spec.sampling.seed + offset) % 2**32
                )
                max_tokens = spec.max_tokens
                if max_tokens is None:
                    max_tokens = max(self.context - len(prompt), 1)
                request = Request(
                    f"{len(choices)}",
                    list(prompt),
                    max_tokens,
                    stop_ids=stop_ids,
                    sampling=sampling,
                    adapter=0 if spec.adapter is None else self.adapters[spec.adapter],
                )
                try:
                    self.engine.check(request)
                except RequestRefused as error:
                    context = error.param == "max_tokens"
                    code = "context_length_exceeded" if context else None
                    raise ApiError(str(error), param=error.param, code=code) from None
                text = ChoiceText(self.codec, spec.stop_strings, spec.sampling.min_tokens)
                choices.append(_Choice(len(choices), request, text))
        for choice in choices:

            def listener(item: Token | BaseException, index: int = choice.index) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, (index, item))

            try:
                self.engine.submit(choice.request, listener)
            except RequestRefused as error:
                self._abort_unfinished(choices)
                raise ApiError(str(error), status=503, kind="server_error") from None
        return choices

    def _take(
        self, spec: GenerationSpec, choices: list[_Choice], index: int, item: Any
    ) -> tuple[_Choice, str, list[dict[str, Any]]]:
        """Records a token (or an error) of choice `index`: returns it, the text to send, and
        the log-probability entries of the token."""
        choice = choices[index]
        if choice.finish is not None:
            return choice, "", []
        if isinstance(item, BaseException):
            choice.finish = "error"
            return choice, "", []
        entries = []
        delta = ""
        if item.token >= 0:
            before = choice.ids[-TOKEN_CONTEXT:]
            choice.ids.append(item.token)
            ended_by_id = item.finish is Finish.STOP and item.token in choice.request.stop_ids
            if not ended_by_id:
                delta = choice.text.push([item.token])
            if spec.logprobs is not None:
                entries.append(self._logprob_entry(spec, item, before))
                choice.logprobs.extend(entries)
        if item.finish is not None:
            delta += choice.text.finish()
            choice.finish = "stop" if choice.text.stopped else FINISH_REASONS[item.finish]
        elif choice.text.stopped:
            choice.finish = "stop"
            self.engine.abort(choice.request)
        return choice, delta, entries

    def _logprob_entry(
        self, spec: GenerationSpec, token: Token, before: list[int]
    ) -> dict[str, Any]:
        def word(token_id: int) -> str:
            return token_text(self.codec, before, token_id)

        top = list(zip(token.top_ids, token.top_logprobs, strict=True))[: spec.logprobs]
        return {
            "token": word(token.token),
            "logprob": token.logprob,
            "top": [(word(i), p) for i, p in top],
        }

    def _abort_unfinished(self, choices: list[_Choice]) -> None:
        for choice in choices:
            if choice.finish is None:
                choice.finish = "abort"
                self.engine.abort(choice.request)

    # -- response shapes ------------------------------------------------------------------

    def _logprobs(self, spec: GenerationSpec, entries: list[dict], offset: int) -> Any:
        if spec.logprobs is None:
            return None
        if spec.endpoint is Endpoint.CHAT:
            return {
                "content": [
                    {
                        "token": e["token"],
                        "logprob": e["logprob"],
                        "bytes": list(e["token"].encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": p, "bytes": list(t.encode())}
                            for t, p in e["top"]
                        ],
                    }
                    for e in entries
                ]
            }
        offsets, position = [], offset
        for e in entries:
            offsets.append(position)
            position += len(e["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            # OpenAI's completions add the sampled token to the top (up to logprobs + 1).
            "top_logprobs": [{**dict(e["top"]), e["token"]: e["logprob"]} for e in entries],
            "text_offset": offsets,
        }

    def _usage(self, spec: GenerationSpec, choices: list[_Choice]) -> dict[str, int]:
        prompt = sum(len(p) for p in spec.prompts)
        completion = sum(len(c.ids) for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _whole(self, spec: GenerationSpec, choices: list[_Choice], response_id: str) -> dict:
        chat = spec.endpoint is Endpoint.CHAT
        shaped = []
        for choice in choices:
            logprobs = self._logprobs(spec, choice.logprobs, 0)
            if chat:
                message = {"role": "assistant", "content": choice.text.text}
                shaped.append(
                    {
                        "index": choice.index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish,
                    }
                )
            else:
                shaped.append(
                    {
                        "index": choice.index,
                        "text": choice.text.text,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish,
                    }
                )
        return {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": spec.model,
            "choices": shaped,
            "usage": self._usage(spec, choices),
        }

    async def _stream(
        self,
        spec: GenerationSpec,
        choices: list[_Choice],
        queue: asyncio.Queue,
        response_id: str,
    ) -> AsyncIterator[str]:
        chat = spec.endpoint is Endpoint.CHAT
        created = int(time.time())
        offsets = [0] * len(choices)  # characters of each choice's tokens so far

        def event(shaped: list[dict], usage: dict | None = None) -> str:
            chunk = {
                "id": response_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": spec.model,
                "choices": shaped,
            }
            if usage is not None:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

        try:
            if chat:
                for choice in choices:
                    delta = {"role": "assistant", "content": ""}
                    shaped = {"index": choice.index, "delta": delta, "logprobs": None}
                    yield event([{**shaped, "finish_reason": None}])
            while any(choice.finish is None for choice in choices):
                choice, text, entries = self._take(spec, choices, *await queue.get())
                if not text and not entries and choice.finish is None:
                    continue
                logprobs = self._logprobs(spec, entries, offsets[choice.index])
                offsets[choice.index] += sum(len(e["token"]) for e in entries)
                shaped = {"index": choice.index, "logprobs": logprobs}
                if chat:
                    shaped["delta"] = {"content": text} if text else {}
                else:
                    shaped["text"] = text
                yield event([{**shaped, "finish_reason": choice.finish}])
            if spec.include_usage:
                yield event([], self._usage(spec, choices))
            yield "data: [DONE]\n\n"
        finally:
            self._abort_unfinished(choices)


class _Uvicorn(uvicorn.Server):
    """uvicorn, whose SIGTERM / SIGINT drain the engine first (`Server.drain`) and then stop
    the HTTP side, which lets open responses end; a second signal exits at once."""

    def __init__(self, config: uvicorn.Config, server: Server, grace: float):
        super().__init__(config)
        self.server = server
        self.grace = grace

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.server.stopping.is_set():
            self.force_exit = True
            return

        def drain() -> None:
            self.server.drain(self.grace)
            self.should_exit = True

        threading.Thread(target=drain, name="drain", daemon=True).start()


def run_server(server: Server, *, host: str, port: int, grace: float) -> None:
    """Serves `server` until SIGTERM or SIGINT (then drains within `grace` seconds); returns
    once everything stopped. Starts the engine's loop."""
    server.engine.start()
    config = uvicorn.Config(
        server.app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=max(int(grace), 1),
    )
    http = _Uvicorn(config, server, grace)
    with contextlib.suppress(KeyboardInterrupt):
        http.run()
    if not server.stopping.is_set():  # uvicorn ended for another reason
        server.drain(0.0)
