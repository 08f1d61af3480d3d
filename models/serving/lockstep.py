"""A server over several processes: process 0 schedules and sends each step's schedule to the
others, which run the same step program on their devices in lockstep.

A step's schedule is what `PagedRunner.launch` reads from the host: its chunks, their sampling
parameters and the page-table rows the engine wrote for them. It travels as an int32 buffer
through `multihost_utils.broadcast_one_to_all` (JAX's own collectives): first a fixed header
(what kind of message, the payload's length), then the payload padded to a power of two, so
every process compiles the same few broadcast shapes. The draws come from the device program
(`Launched.fetch` gathers them on every process), so no process samples on its host.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from .buckets import bucket
from .paged import Chunk, Launched, PagedRunner, SlotSampling

MIN_PAYLOAD = 64
"""The smallest payload sent (int32 words)."""
CHUNK_WORDS = 21
"""Words of one chunk's fixed fields in the payload."""


class Kind(enum.IntEnum):
    """What a message asks of the followers."""

    IDLE = 0
    """Nothing to run (the leader keeps the collectives alive while idle)."""
    STEP = 1
    """Launch the step (if it has chunks), then wait for the one launched before it."""
    STOP = 2
    """The server stopped: the followers return."""


def _bits(value: float) -> int:
    return int(np.asarray(value, np.float32).view(np.int32))


def _float(bits: int) -> float:
    return float(np.asarray(bits, np.int32).view(np.float32))


def encode(
    chunks: Sequence[Chunk],
    sampling: dict[tuple[int, int], SlotSampling],
    pages: dict[tuple[int, int], Sequence[int]],
) -> np.ndarray:
    """A step's schedule as int32 words: per chunk its fields, its sampling parameters (those
    `launch` reads, greedy where absent) and its tokens, then the page-table row prefix written
    for its slot (`pages[rank, slot]`, empty where absent), then its sampling's logit bias (ids
    and values) and its held stop ids (a first chunk's)."""
    words: list[int] = [len(chunks)]
    for chunk in chunks:
        where = (chunk.rank, chunk.slot)
        draw = sampling.get(where, SlotSampling())
        row = pages.get(where, ())
        words += [
            chunk.rank,
            chunk.slot,
            chunk.start,
            int(chunk.sample),
            int(chunk.previous),
            chunk.adapter,
            chunk.prompt_length,
            int(chunk.first),
            len(draw.logit_bias),
            len(chunk.held_stops),
            len(chunk.tokens),
            len(row),
            _bits(draw.temperature),
            int(draw.top_k),
            _bits(draw.top_p),
            int(np.asarray(draw.seed % (1 << 32), np.uint32).view(np.int32)),
            _bits(draw.min_p),
            _bits(draw.presence_penalty),
            _bits(draw.frequency_penalty),
            _bits(draw.repetition_penalty),
            draw.min_tokens,
        ]
        words += [int(token) for token in chunk.tokens]
        words += [int(page) for page in row]
        words += [int(token) for token, _ in draw.logit_bias]
        words += [_bits(value) for _, value in draw.logit_bias]
        words += list(chunk.held_stops)
    return np.asarray(words, np.int32)


def decode(
    words: np.ndarray,
) -> tuple[list[Chunk], dict[tuple[int, int], SlotSampling], dict[tuple[int, int], np.ndarray]]:
    """The inverse of `encode` (chunks carry no key: only the leader reads keys)."""
    words = np.asarray(words, np.int32)
    chunks, sampling, pages = [], {}, {}
    at = 1
    for _ in range(int(words[0])):
        fields = [int(w) for w in words[at : at + CHUNK_WORDS]]
        rank, slot, start, sample, previous, adapter, prompt_length, first = fields[:8]
        biased, held, count, width = fields[8:12]
        temperature, top_k, top_p, seed, min_p, presence, frequency, repetition = fields[12:20]
        min_tokens = fields[20]
        at += CHUNK_WORDS
        tokens = tuple(int(t) for t in words[at : at + count])
        at += count
        pages[(rank, slot)] = words[at : at + width].copy()
        at += width
        bias_ids = [int(t) for t in words[at : at + biased]]
        bias_values = [_float(int(b)) for b in words[at + biased : at + 2 * biased]]
        at += 2 * biased
        held_stops = tuple(int(t) for t in words[at : at + held])
        at += held
        chunks.append(
            Chunk(
                rank,
                slot,
                tokens,
                start,
                bool(sample),
                previous=bool(previous),
                adapter=adapter,
                prompt_length=prompt_length,
                first=bool(first),
                held_stops=held_stops,
            )
        )
        sampling[(rank, slot)] = SlotSampling(
            _float(temperature),
            top_k,
            _float(top_p),
            int(np.int32(seed).view(np.uint32)),
            *(_float(bits) for bits in (min_p, presence, frequency, repetition)),
            logit_bias=tuple(zip(bias_ids, bias_values, strict=True)),
            min_tokens=min_tokens,
        )
    return chunks, sampling, pages


class Channel:
    """Process 0's end and the followers' end of the schedule broadcast (every process of the
    group calls `send` or `receive` the same number of times, in the same order)."""

    def send(self, kind: Kind, payload: np.ndarray | None = None) -> None:
        """Process 0: sends a message to every other process."""
        payload = np.zeros(0, np.int32) if payload is None else payload
        self._broadcast(kind, payload)

    def receive(self) -> tuple[Kind, np.ndarray]:
        """The other processes: the next message process 0 sent."""
        return self._broadcast(Kind.IDLE, np.zeros(0, np.int32))

    @staticmethod
    def settle(launched: Launched) -> None:
        """Waits for a launched step where the mesh's collectives run on gloo (CPU devices over
        several processes; `models.pipeline.transport.over_gloo` says why): the CPU client would
        start the next program (a broadcast, a gather of draws) beside it, and gloo mixes their
        messages. On GPUs the steps stay overlapped."""
        platform = next(iter(launched.tokens.devices())).platform
        if jax.process_count() > 1 and platform == "cpu":
            jax.block_until_ready(launched.outputs)  # one program: its pools are done too

    def _broadcast(self, kind: Kind, payload: np.ndarray) -> tuple[Kind, np.ndarray]:
        source = jax.process_index() == 0
        header = np.asarray([int(kind), len(payload)], np.int32)
        header = np.asarray(multihost_utils.broadcast_one_to_all(header, is_source=source))
        size = bucket(max(int(header[1]), MIN_PAYLOAD))
        padded = np.zeros(size, np.int32)
        padded[: len(payload)] = payload
        padded = np.asarray(multihost_utils.broadcast_one_to_all(padded, is_source=source))
        return Kind(int(header[0])), padded[: int(header[1])]


def follow(paged: PagedRunner, channel: Channel) -> None:
    """A follower's loop: runs each step process 0 sends on this process's devices, as the
    engine's `run_once` does (launch the step, then wait for the one before), until STOP. A step
    that raises resets the pools, as the engine does."""
    pending: Launched | None = None
    while True:
        kind, payload = channel.receive()
        if kind is Kind.STOP:
            return
        if kind is Kind.IDLE:
            continue
        chunks, sampling, pages = decode(payload)
        for (rank, slot), row in pages.items():
            paged.tables[rank, slot, : len(row)] = row
        previous, pending = pending, None
        try:
            if chunks:
                pending = paged.launch(chunks, sampling, previous)
                channel.settle(pending)
            if previous is not None:
                previous.fetch()
        except Exception:  # noqa: BLE001 - process 0 meets the same error and resets too
            pending = None
            paged.reset()
