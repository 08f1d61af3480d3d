"""Generation from prompts on either runner (`ShardedCausalLM`, `models.pipeline.
PipelineCausalLM`): the checks every caller gets (token ids, not text, inside the vocabulary and
the context), decoding in chunks that stops once every sequence has met an end-of-sequence id,
and text in, text out."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np

from ..config import DecoderConfig
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
    ) -> Iterator[np.ndarray]: ...


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """`prompts` as lists of token ids, each id in the vocabulary.

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
            f"the prompts have token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
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
            f"the longest input has {longest} tokens{more}; the model's context is {limit} "
            "(max_position_embeddings)"
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
        prompts, max_new_tokens, chunk=chunk, sampling=sampling, seed=seed
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
) -> list[str]:
    """Each prompt's continuation as text: the prompts encoded with `codec` (through its chat
    template with `chat`), `generate_ids`, the new ids decoded (an end-of-sequence token
    dropped, as the codec drops special tokens).

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
        runner, sequences, max_new_tokens, eos_ids=eos_ids, sampling=sampling, seed=seed
    )
    return [codec.decode(ids) for ids in new]
