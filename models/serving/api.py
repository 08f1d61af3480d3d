"""The OpenAI request bodies a server takes, checked into what the scheduler runs, and the text
of each choice as its tokens come (stop strings included).

Every check raises `ApiError`, which the server answers as HTTP 400 with OpenAI's error body
(`{"error": {"message", "type", "param", "code"}}`); nothing a client sends gets further.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .paged import SlotSampling
from .sampling import MAX_LOGIT_BIAS, TOP_LOGPROBS
from .text import TextCodec, TextStream, TokenizerCodec

MAX_CHOICES = 16
"""The most choices (`n`) one request may ask for."""
MAX_STOPS = 8
"""The most stop strings one request may give."""
DEFAULT_COMPLETION_TOKENS = 16
"""`max_tokens` of a completion that names none (OpenAI's default)."""
MAX_INTEGER = 2**31 - 1
"""The largest integer field a request may send: the device holds them as int32."""
TOKEN_ID = re.compile(r"[0-9]+")
"""A `logit_bias` key: a token id in ASCII digits (`int` also reads other scripts' digits)."""


class ApiError(Exception):
    """A request the server refuses: its OpenAI error body and HTTP status."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message,
            param,
            code,
            status,
            kind,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclasses.dataclass(frozen=True)
class GenerationSpec:
    """A checked request: its prompts (token ids) and how each choice is drawn.

    Attributes:
      endpoint: Completions or chat.
      model: The `model` named (the served model or an adapter).
      adapter: The adapter it names, None for the base model.
      prompts: Token ids of each prompt (a chat has one).
      max_tokens: The most new tokens per choice (None: up to the context).
      n: Choices per prompt.
      sampling: Temperature, top-k, top-p and the seed of the first choice (choice i draws
        with seed + i).
      stop_strings: Text that ends a choice (left out of its text).
      stop_ids: Ids that end a choice, besides the model's end-of-sequence ids.
      ignore_eos: Run past end-of-sequence ids.
      logprobs: How many most likely tokens to report per token (None: no log-probabilities).
      stream: Answer as server-sent events.
      include_usage: Streaming: end with a chunk of token counts.
    """

    endpoint: Endpoint
    model: str
    adapter: str | None
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int | None
    n: int
    sampling: SlotSampling
    stop_strings: tuple[str, ...]
    stop_ids: frozenset[int]
    ignore_eos: bool
    logprobs: int | None
    stream: bool
    include_usage: bool


def _field(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        value = object()  # JSON true/false is not a number here
    if not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(f"'{name}' must be {names}; got {body[name]!r:.60}", param=name)
    return value


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = _field(body, name, (int, float), default)
    if isinstance(value, int) and not low <= value <= high:
        value = math.inf  # an integer past float's range has no float value
    value = float(value)
    if not low <= value <= high:
        raise ApiError(f"'{name}' must be in [{low}, {high}]; got {body[name]!r:.30}", param=name)
    return value


def _integer(body: Mapping[str, Any], name: str, default: int | None, low: int) -> int | None:
    """An integer field in [low, `MAX_INTEGER`] (the device holds them as int32)."""
    value = _field(body, name, (int,), default)
    if value is not None and not low <= value <= MAX_INTEGER:
        raise ApiError(f"'{name}' must be in [{low}, {MAX_INTEGER}]; got {value}", param=name)
    return value


def _ids(value: Any, vocab_size: int, param: str) -> tuple[int, ...]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(f"'{param}' token ids must be integers", param=param)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(
            f"'{param}' has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
            param=param,
        )
    return tuple(value)


def _prompts(body: Mapping[str, Any], codec: TextCodec, vocab_size: int) -> list[tuple]:
    """A completion's `prompt`: text, token ids, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise ApiError("'prompt' must be text, token ids, or a non-empty list of them", "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = tuple(codec.encode(item))
        elif isinstance(item, list):
            ids = _ids(item, vocab_size, "prompt")
        else:
            raise ApiError("'prompt' must be text, token ids, or a list of them", param="prompt")
        if not ids:
            raise ApiError("a prompt encodes to no tokens", param="prompt")
        prompts.append(ids)
    return prompts


def _chat_prompt(body: Mapping[str, Any], codec: TextCodec) -> tuple[int, ...]:
    """A chat's `messages` through the checkpoint's chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    checked = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError("each message needs a 'role' and 'content'", param="messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ApiError("only text content parts are served", param="messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise ApiError("a message's 'content' must be text", param="messages")
        checked.append({"role": message["role"], "content": content})
    if not isinstance(codec, TokenizerCodec) or codec.chat_template is None:
        raise ApiError("this model has no chat template; use /v1/completions", param="messages")
    try:
        ids = tuple(codec.encode_messages(checked))
    except ValueError as error:
        raise ApiError(str(error), param="messages") from None
    if not ids:
        raise ApiError("the conversation encodes to no tokens", param="messages")
    return ids


def _logit_bias(body: Mapping[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs: an object of token ids (as strings, OpenAI's
    form) to biases in [-100, 100], at most `MAX_LOGIT_BIAS` of them."""
    bias = _field(body, "logit_bias", (dict,), {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(
            f"'logit_bias' names at most {MAX_LOGIT_BIAS} tokens; got {len(bias)}", "logit_bias"
        )
    pairs: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and TOKEN_ID.fullmatch(key) else None
        if token is None or not 0 <= token < vocab_size:
            raise ApiError(
                f"'logit_bias' keys are token ids in [0, {vocab_size}); got {key!r:.20}",
                "logit_bias",
            )
        if token in pairs:
            raise ApiError(f"'logit_bias' names token {token} twice", "logit_bias")
        pairs[token] = _number({"logit_bias": value}, "logit_bias", 0.0, -100.0, 100.0)
    return tuple(sorted(pairs.items()))


def _stops(body: Mapping[str, Any], vocab_size: int) -> tuple[tuple[str, ...], frozenset[int]]:
    stop = body.get("stop")
    items = [] if stop is None else [stop] if isinstance(stop, str | int) else stop
    if not isinstance(items, list) or len(items) > MAX_STOPS:
        raise ApiError(f"'stop' must be text or a list of at most {MAX_STOPS}", param="stop")
    strings = tuple(s for s in items if isinstance(s, str) and s)
    numbers = [s for s in items if not isinstance(s, str)]
    ids = _field(body, "stop_token_ids", (list,), [])
    return strings, frozenset(_ids(numbers + ids, vocab_size, "stop"))


UNSERVED_DEFAULTS = {
    "functions": ([],),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "logits_processors": ([],),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "prompt_logprobs": (),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "typical_p": (1.0,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
}
"""Request fields that change the prompt, what is sampled or what is answered, which this
server does not compute (OpenAI's and the vLLM / SGLang extensions): each is refused unless
absent, null or one of its neutral values (the defaults, under which the answer is this
server's)."""
MAX_REPETITION_PENALTY = 10.0
"""The largest `repetition_penalty` taken (1: none; transformers' and vLLM's extension)."""


def _refuse_unserved(body: Mapping[str, Any]) -> None:
    """Refuses a field that would change the sampled tokens but is not computed here (a
    structured output, tool calls), rather than ignore it."""
    for name, neutral in UNSERVED_DEFAULTS.items():
        value = body.get(name)
        if value is not None and value not in neutral:
            raise ApiError(f"'{name}' is not served (got {value!r:.60})", param=name)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise ApiError(
            "'response_format' other than {'type': 'text'} is not served (no structured output)",
            param="response_format",
        )
    if body.get("tools") and body.get("tool_choice", "auto") != "none":
        raise ApiError(
            "tool calls are not served (no tool-call parser); send no 'tools', or "
            "'tool_choice': 'none'",
            param="tools",
        )


MODEL_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
"""The sampling fields a checkpoint's `generation_config.json` may default (as SGLang's
`--sampling-defaults model` and vLLM's `--generation-config auto` read them)."""


def _model_sampling(body: Mapping[str, Any]) -> dict[str, float]:
    """`MODEL_SAMPLING_FIELDS` of `body`, checked, as `SlotSampling` takes them."""
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise ApiError("'top_p' must be in (0, 1]; got 0", param="top_p")
    repetition = _number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY)
    if repetition == 0:
        raise ApiError("'repetition_penalty' must be > 0 (1: none); got 0", "repetition_penalty")
    return {
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_k": max(_integer(body, "top_k", 0, -1), 0),
        "top_p": top_p,
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
        "repetition_penalty": repetition,
    }


def sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The `MODEL_SAMPLING_FIELDS` a checkpoint's `generation_config.json` (as a dict) sets:
    what a request that leaves them out samples with.

    Raises:
      ValueError: A value that a request could not send either.
    """
    defaults = {k: generation_config[k] for k in MODEL_SAMPLING_FIELDS if k in generation_config}
    defaults = {k: v for k, v in defaults.items() if v is not None}
    try:
        _model_sampling(defaults)
    except ApiError as error:
        raise ValueError(f"generation_config.json's sampling defaults: {error}") from None
    return defaults


def parse_request(
    body: Any,
    endpoint: Endpoint,
    *,
    codec: TextCodec,
    vocab_size: int,
    model_name: str,
    adapters: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
) -> GenerationSpec:
    """Checks an OpenAI request body into a `GenerationSpec`; a sampling field the body leaves
    out takes its value in `defaults` (`sampling_defaults`), else OpenAI's.

    Raises:
      ApiError: A field of the wrong type or out of range, an unknown model, an unsupported
        option (`echo`, `best_of`, `suffix`, `UNSERVED_DEFAULTS`' fields away from their
        neutral values, a structured `response_format`, `tools`), a prompt that encodes to
        nothing.
    """
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = _field(body, "model", (str,), None)
    if model is None:
        raise ApiError("'model' is required", param="model")
    if model != model_name and model not in adapters:
        served = [model_name, *adapters]
        raise ApiError(
            f"the model '{model}' does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )
    for name in ("echo", "suffix"):
        if body.get(name):
            raise ApiError(f"'{name}' is not served", param=name)
    _refuse_unserved(body)
    if _integer(body, "best_of", 1, 1) != 1:
        raise ApiError("'best_of' other than 1 is not served", param="best_of")
    if endpoint is Endpoint.CHAT:
        prompts = [_chat_prompt(body, codec)]
        wants_logprobs = _field(body, "logprobs", (bool,), False)
        top = _integer(body, "top_logprobs", 0, 0)
        if top and not wants_logprobs:
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = top if wants_logprobs else None
        # OpenAI's max_completion_tokens replaces max_tokens, and wins where both are sent.
        max_tokens = _integer(body, "max_tokens", None, 1)
        max_tokens = _integer(body, "max_completion_tokens", max_tokens, 1)
    else:
        prompts = _prompts(body, codec, vocab_size)
        logprobs = _integer(body, "logprobs", None, 0)
        max_tokens = _integer(body, "max_tokens", DEFAULT_COMPLETION_TOKENS, 1)
    if logprobs is not None and logprobs > TOP_LOGPROBS:
        raise ApiError(f"at most {TOP_LOGPROBS} top log-probabilities are served", "logprobs")
    n = _integer(body, "n", 1, 1)
    if n > MAX_CHOICES:
        raise ApiError(f"'n' must be at most {MAX_CHOICES}; got {n}", param="n")
    seed = _field(body, "seed", (int,), None)
    sampling = SlotSampling(
        **_model_sampling({**(defaults or {}), **{k: v for k, v in body.items() if v is not None}}),
        seed=random.getrandbits(31) if seed is None else seed % 2**32,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body, vocab_size),
        min_tokens=_integer(body, "min_tokens", 0, 0),
    )
    if max_tokens is not None and sampling.min_tokens > max_tokens:
        raise ApiError(
            f"'min_tokens' ({sampling.min_tokens}) is more than max_tokens ({max_tokens})",
            param="min_tokens",
        )
    stream_options = _field(body, "stream_options", (dict,), {})
    strings, ids = _stops(body, vocab_size)
    return GenerationSpec(
        endpoint=endpoint,
        model=model,
        adapter=None if model == model_name else model,
        prompts=tuple(prompts),
        max_tokens=max_tokens,
        n=n,
        sampling=sampling,
        stop_strings=strings,
        stop_ids=ids,
        ignore_eos=_field(body, "ignore_eos", (bool,), False),
        logprobs=logprobs,
        stream=_field(body, "stream", (bool,), False),
        include_usage=_field(stream_options, "include_usage", (bool,), False),
    )


class ChoiceText:
    """The text of one choice as its tokens come: final text only (`TextStream`), held back
    while it may still become a stop string, and cut where a stop string begins."""

    def __init__(self, codec: TextCodec, stop_strings: Sequence[str], min_tokens: int = 0):
        self._stream = TextStream(codec)
        self._stops = tuple(stop_strings)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._min_tokens = min_tokens
        self._tokens = 0
        # Where each stop string may begin: None until `min_tokens` tokens came.
        self._floors = (0,) * len(self._stops) if min_tokens == 0 else None
        self.text = ""
        self._sent = 0
        self.stopped = False

    def push(self, ids: Sequence[int]) -> str:
        """Adds tokens; returns the text to send now ('' once a stop string was met). Until it
        holds `min_tokens` tokens no stop string ends it, and from then on one must end past the
        text before the token that reached them (as vLLM checks only new text)."""
        if self.stopped:
            return ""
        before = len(self.text)
        self.text += self._stream.push(ids)
        self._tokens += len(ids)
        if self._floors is None and self._tokens >= self._min_tokens:
            self._floors = tuple(max(before - len(s) + 1, 0) for s in self._stops)
        return self._take(final=False)

    def finish(self) -> str:
        """The rest of the text when the choice ends."""
        if not self.stopped:
            self.text += self._stream.finish()
        return self._take(final=True)

    def _take(self, *, final: bool) -> str:
        if not self.stopped and self._stops and self._floors is not None:
            low = self._sent - self._hold
            found = [
                i
                for stop, floor in zip(self._stops, self._floors, strict=True)
                if (i := self.text.find(stop, max(floor, low))) >= 0
            ]
            if found:
                self.text, self.stopped = self.text[: min(found)], True
        end = len(self.text) if final or self.stopped else len(self.text) - self._hold
        end = max(end, self._sent)
        new, self._sent = self.text[self._sent : end], end
        return new


TOKEN_CONTEXT = 4
"""Ids before a token that `token_text` decodes it after."""


def token_text(codec: TextCodec, before: Sequence[int], token: int) -> str:
    """The text `token` adds after the ids `before` it (the last `TOKEN_CONTEXT` of a choice's
    ids): a log-probability entry's token. Decoded alone, a token loses its leading space under
    a Metaspace decoder."""
    shown = codec.decode(before)
    text = codec.decode([*before, token])
    return text[len(shown) :] if text.startswith(shown) else codec.decode([token])
