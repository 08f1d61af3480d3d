"""Generation from prompts on either runner (`ShardedCausalLM`, `models.pipeline.
PipelineCausalLM`): the checks every caller gets (token ids, not text, inside the vocabulary and
the context), decoding in chunks that stops once every sequence has met an end-of-sequence id,
and text in, text out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from ..config import DecoderConfig
from ..inputs.rows import PackedBatch, RowsPhase, TokenRows, decode_rows
from .buckets import MIN_STEPS, bucket, cache_length
from .sampling import GREEDY, Sampling
from .text import TextCodec

DECODE_CHUNK = 16
"""Decode steps per device program while generation may stop at an end-of-sequence id."""


class Runner(Protocol):
    """What generation needs of a runner."""

    config: DecoderConfig

    def generate_stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        chunk: int,
        sampling: Sampling = GREEDY,
        seed: int = 0,
        adapters: Sequence[str | int | None] | None = None,
    ) -> Iterator[np.ndarray]: ...


class PlacedRunner(Protocol):
    """The placed-input API `token_chunks` runs a request through (`ShardedCausalLM`'s)."""

    config: DecoderConfig

    def pack(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        bucketed: bool = False,
        adapters: Sequence[str | int | None] | None = None,
    ) -> PackedBatch: ...

    def place(self, packed: PackedBatch) -> tuple[TokenRows, Any]: ...

    def place_array(self, values: np.ndarray | jax.Array, *, rows: bool = True) -> jax.Array: ...

    def new_caches(self, slots_per_rank: int, max_len: int) -> Any: ...

    def prefill(self, rows, batch, caches, last_rows, key, *, sampling: Sampling) -> tuple: ...

    def decode(
        self, rows, batch, caches, key, steps, *, capacity, sampling, first_step
    ) -> tuple: ...


def check_prompts(
    prompts: Sequence[Sequence[int]], vocab_size: int, *, source: str = "the prompts"
) -> list[list[int]]:
    """`prompts` as lists of token ids, each id in the vocabulary (`source` names them in a
    message).

    Raises:
      TypeError: A prompt is text, or not a sequence of ints (the message names the fix: encode
        text with the model's `TextCodec`).
      ValueError: No prompt, an empty prompt, or an id outside [0, vocab_size).
    """
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence | np.ndarray):
        raise TypeError(
            "prompts are a list of token-id lists; got "
            f"{type(prompts).__name__}. Encode text first: "
            "models.text_codec(checkpoint, vocab_size).encode(text), or call "
            "models.generate_text"
        )
    checked = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str | bytes):
            raise TypeError(
                f"prompt {index} is text ({prompt[:40]!r}); a prompt here is a list of token ids. "
                "Encode it first: models.text_codec(checkpoint, vocab_size).encode(text), or "
                "call models.generate_text"
            )
        ids = [int(token) for token in prompt if _is_id(token)]
        if len(ids) != len(prompt):
            raise TypeError(f"prompt {index} must be a list of ints; got {list(prompt)[:8]!r}")
        if not ids:
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
        checked.append(ids)
    if not checked:
        raise ValueError("no prompt given; pass at least one list of token ids")
    bad = sorted({t for ids in checked for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(
            f"{source} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )
    return checked


def _is_id(token) -> bool:
    return isinstance(token, int | np.integer) and not isinstance(token, bool)


def check_context(prompts: Sequence[Sequence[int]], new_tokens: int, limit: int) -> None:
    """The longest prompt plus `new_tokens` fits a context of `limit` positions.

    Raises:
      ValueError: It does not.
    """
    longest = max(len(prompt) for prompt in prompts)
    if longest + new_tokens > limit:
        more = f" + {new_tokens} new tokens" if new_tokens else ""
        raise ValueError(
            f"the longest input has {longest} tokens{more}; the model's context is {limit}: "
            "they exceed max_position_embeddings"
        )


def generate_ids(
    runner: Runner,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_ids: Sequence[int] = (),
    sampling: Sampling = GREEDY,
    seed: int = 0,
    chunk: int | None = None,
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    adapters: Sequence[str | int | None] | None = None,
) -> list[list[int]]:
    """Each prompt's new ids, up to and including its first end-of-sequence id, at most
    `max_new_tokens`: decoding runs `chunk` steps per device program (`DECODE_CHUNK` while an
    `eos_ids` may end it, else all at once) and stops once every sequence has ended.

    Args:
      runner: A `ShardedCausalLM` or `PipelineCausalLM`.
      prompts: Token-id lists (`check_prompts`).
      max_new_tokens: The most ids a sequence gets.
      eos_ids: The ids that end a sequence (`models.eos_token_ids(checkpoint)`); () for none.
      sampling: How each token is drawn.
      seed: The sampling seed.
      chunk: Decode steps per device program; None as above.
      on_tokens: Called after each chunk with every sequence's ids so far (to stream them).
      adapters: Each prompt's LoRA adapter (a loaded adapter's name or index; None for none),
        or None for no adapters.

    Raises:
      TypeError, ValueError: The prompts fail `check_prompts` or `check_context`, or
        `max_new_tokens` is below 1.
    """
    config = runner.config
    prompts = check_prompts(prompts, config.vocab_size)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
    check_context(prompts, max_new_tokens, config.max_position_embeddings)
    eos = frozenset(eos_ids)
    if chunk is None:
        chunk = DECODE_CHUNK if eos else max_new_tokens
    tokens: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    chunks = runner.generate_stream(
        prompts, max_new_tokens, chunk=chunk, sampling=sampling, seed=seed, adapters=adapters
    )
    for new in chunks:
        for index, row in enumerate(new.tolist()):
            for token in row:
                if done[index]:
                    break
                tokens[index].append(token)
                done[index] = token in eos
        if on_tokens is not None:
            on_tokens(tokens)
        if all(done):
            break
    return tokens


def generate_text(
    runner: Runner,
    codec: TextCodec,
    prompts: Sequence[str],
    max_new_tokens: int,
    *,
    eos_ids: Sequence[int] = (),
    chat: bool = False,
    sampling: Sampling = GREEDY,
    seed: int = 0,
    adapters: Sequence[str | int | None] | None = None,
) -> list[str]:
    """Each prompt's continuation as text: the prompts encoded with `codec` (through its chat
    template with `chat`), `generate_ids` (each prompt through its LoRA adapter, given
    `adapters`), the new ids decoded (an end-of-sequence token dropped, as the codec drops
    special tokens).

    Raises:
      TypeError: `prompts` is one string, or holds something other than strings.
      ValueError: A prompt encodes to no ids, or the ids fail `generate_ids`' checks.
    """
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(
            f"prompts are a list of strings; got {prompts!r:.60}. Pass [text] for one prompt"
        )
    encode = codec.encode_chat if chat else codec.encode
    sequences = [encode(prompt) for prompt in prompts]
    empty = [prompt for prompt, ids in zip(prompts, sequences, strict=True) if not ids]
    if empty:
        raise ValueError(f"the prompt {empty[0]!r} encodes to no token ids")
    new = generate_ids(
        runner,
        sequences,
        max_new_tokens,
        eos_ids=eos_ids,
        sampling=sampling,
        seed=seed,
        adapters=adapters,
    )
    return [codec.decode(ids) for ids in new]


def token_chunks(
    runner: PlacedRunner,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling,
    seed: int,
    chunk: int,
    adapters: Sequence[str | int | None] | None = None,
) -> tuple[PackedBatch, Iterator[jax.Array]]:
    """The packed prompts, and the device arrays [n, slots] of new tokens in slot order: the
    prefill's (n = 1), then at most `chunk` decode steps per array, run through the runner's
    placed-input API (`prefill`, `decode`). Checks the request before anything runs.

    Raises:
      TypeError, ValueError: `check_prompts` or `check_context` refuses the prompts, or
        `max_new_tokens` is below 1.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
    prompts = check_prompts(prompts, runner.config.vocab_size)
    check_context(prompts, max_new_tokens, runner.config.max_position_embeddings)
    packed = runner.pack(prompts, bucketed=True, adapters=adapters)
    longest = max(packed.lengths) + max_new_tokens
    return packed, _run_chunks(runner, packed, longest, max_new_tokens, sampling, seed, chunk)


def _run_chunks(
    runner: PlacedRunner,
    packed: PackedBatch,
    longest: int,
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    chunk: int,
) -> Iterator[jax.Array]:
    limit = runner.config.max_position_embeddings
    caches = runner.new_caches(packed.decode_rows_per_rank, cache_length(longest, limit))
    prefill_key, decode_key = jax.random.split(jax.random.key(seed))
    last_rows = runner.place_array(packed.last_row_index())
    tokens, caches = runner.prefill(
        *runner.place(packed), caches, last_rows, prefill_key, sampling=sampling
    )
    yield tokens[None]
    steps = max_new_tokens - 1
    if not steps:
        return
    lengths = np.asarray(packed.lengths, np.int32)
    rows, batch = runner.place(decode_rows(packed, np.zeros_like(lengths), lengths))
    capacity = bucket(max(min(chunk, steps), MIN_STEPS))
    for done in range(0, steps, chunk):
        count = min(chunk, steps - done)
        current = dataclasses.replace(
            rows, ids=tokens, positions=rows.positions + done, phase=RowsPhase.DECODE
        )
        out, caches = runner.decode(
            current,
            batch,
            caches,
            decode_key,
            count,
            capacity=capacity,
            sampling=sampling,
            first_step=done,
        )
        tokens = out[count - 1]
        yield out[:count]
