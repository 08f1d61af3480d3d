"""Choosing the next token from logits on the device: greedy, or temperature / min-p / top-k /
top-p; a server's presence, frequency and repetition penalties over each sequence's token
history."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import boundary_jax as bj

from ..decoder.model import CausalLM

GREEDY_BELOW = 1e-5
"""Temperatures under this draw greedily, as vLLM's do: dividing logits by them overflows
float32, and several overflowed logits would tie."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn; static (part of the compiled step).

    Attributes:
      temperature: 0 (or under `GREEDY_BELOW`) for greedy (argmax); else logits are divided by
        it before drawing.
      top_k: Draw among the k most likely tokens only, and those tied with the k-th (as
        transformers and vLLM; None: all).
      top_p: Draw among the smallest set of most likely tokens whose probability reaches p
        (nucleus sampling; None: all).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy); got {self.temperature=}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be None or >= 1; got {self.top_k=}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be None or in (0, 1]; got {self.top_p=}")
        if self.temperature == 0 and (self.top_k is not None or self.top_p is not None):
            raise ValueError(
                "top_k / top_p need a temperature > 0 (temperature 0 is greedy); got "
                f"{self.temperature=}, {self.top_k=}, {self.top_p=}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


GREEDY = Sampling()


def sample_tokens(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """int32 [R] next tokens from [R, vocab] float logits; `key` is unused when greedy.

    Ties in greedy decoding go to the lowest token id (as `numpy.argmax`).
    """
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if sampling.top_p is None or sampling.top_p >= 1:
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
    order = jnp.argsort(-logits, axis=-1)
    values = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(values, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ahead of each
    values = jnp.where(before < sampling.top_p, values, -jnp.inf)
    choice = jax.random.categorical(key, values, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def head_tokens(
    model: CausalLM, hidden: jax.Array, key: jax.Array, sampling: Sampling
) -> jax.Array:
    """The token each row of final-norm output `hidden` samples through the LM head.

    Greedy decoding takes the argmax of each rank's vocab shard, so full logits never cross
    attention TP; sampling gathers the logits of the rows given only.
    """
    if sampling.greedy:
        return model.lm_head.greedy(hidden)
    logits = model.lm_head(hidden).astype(jnp.float32)
    return sample_tokens(logits, key, sampling)


def rank_key(key: jax.Array, topology: bj.Topology) -> jax.Array:
    """`key` folded with the attention-DP rank (inside `shard_map`), so that ranks draw
    independently."""
    entry = topology.spec_entry((bj.TokenAxis.ATTN_DP,))
    return key if entry is None else jax.random.fold_in(key, lax.axis_index(entry))


MAX_LOGIT_BIAS = 300
"""The most tokens one sequence's logit bias names (OpenAI's bound)."""


MAX_HELD_STOPS = 64
"""The most stop ids one sequence holds back until its `min_tokens` (eos ids included)."""


def slot_entries(
    logit_bias: tuple[tuple[int, float], ...], held: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sequence's logit bias as `MAX_LOGIT_BIAS` token ids (-1 past its entries) and float32
    biases, and the ids it holds back until its `min_tokens` as `MAX_HELD_STOPS` ids (-1 past
    them): what `write_slot` takes."""
    ids = np.full(MAX_LOGIT_BIAS, -1, np.int32)
    values = np.zeros(MAX_LOGIT_BIAS, np.float32)
    for index, (token, value) in enumerate(logit_bias):
        ids[index], values[index] = token, value
    stops = np.full(MAX_HELD_STOPS, -1, np.int32)
    stops[: len(held)] = held
    return ids, values, stops


def write_slot(
    bias: jax.Array,
    held: jax.Array,
    row: jax.Array,
    ids: jax.Array,
    values: jax.Array,
    stops: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """`bias` float32 and `held` bool, [slots, vocab], with row `row` written for a sequence
    whose first chunk runs in the slot: its logit bias (`values` at `ids`, 0 elsewhere) and the
    stop ids it holds back until its `min_tokens` (`stops`); -1 entries write nothing."""
    vocab = bias.shape[-1]
    written = (
        jnp.zeros(vocab, bias.dtype).at[jnp.where(ids >= 0, ids, vocab)].set(values, mode="drop")
    )
    marked = jnp.zeros(vocab, bool).at[jnp.where(stops >= 0, stops, vocab)].set(True, mode="drop")
    # A select, not a scatter into the slots' rows: they are split over attention DP.
    target = (jnp.arange(bias.shape[0]) == row)[:, None]
    return jnp.where(target, written[None], bias), jnp.where(target, marked[None], held)


def hold_stops(
    logits: jax.Array,
    held: jax.Array,
    counters: jax.Array,
    prompt_lengths: jax.Array,
    min_tokens: jax.Array,
) -> jax.Array:
    """[R, vocab] logits with each row's held stop ids (`held` [R, vocab]) at -inf while it has
    generated fewer than `min_tokens` [R] tokens: `counters - prompt_lengths`, the position it
    draws less its prompt."""
    early = (counters - prompt_lengths < min_tokens)[:, None]
    return jnp.where(early & held, -jnp.inf, logits)


TOP_LOGPROBS = 5
"""How many most likely tokens (and their log-probabilities) a per-row draw reports."""


def record_rows(
    counts: jax.Array,
    prompted: jax.Array,
    ids: jax.Array,
    positions: jax.Array,
    slots: jax.Array,
    prompt_lengths: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Each sequence slot's token history after a step's rows, for the penalties
    (`penalize`): `counts` int32 [S, vocab] the occurrences of each generated token, `prompted`
    bool [S, vocab] the prompt's tokens, of a rank's S slots.

    A slot whose rows start at position 0 starts afresh (a new sequence, or one recomputed
    after preemption); then row r, token `ids[r]` at position `positions[r]` of slot
    `slots[r]` (-1: a padding row), is a generated token where its position reaches its slot's
    prompt length (`prompt_lengths` [S]), a prompt token otherwise. A sequence whose every
    token runs as a row once, from position 0, is counted exactly (the scheduler reuses no
    cached prefix for a penalized request).
    """
    size = counts.shape[0]

    def only(where: jax.Array) -> jax.Array:
        # The rows' slots where `where` holds; elsewhere, and on padding rows, out of bounds
        # (a scatter drops them).
        return jnp.where(where & (slots >= 0), slots, size)

    fresh = jnp.zeros(size, bool).at[only(positions == 0)].set(True, mode="drop")
    counts = jnp.where(fresh[:, None], 0, counts)
    prompted = prompted & ~fresh[:, None]
    generated = positions >= prompt_lengths[jnp.clip(slots, 0, size - 1)]
    counts = counts.at[only(generated), ids].add(1, mode="drop")
    prompted = prompted.at[only(~generated), ids].set(True, mode="drop")
    return counts, prompted


def penalize(
    logits: jax.Array,
    counts: jax.Array,
    prompted: jax.Array,
    presence: jax.Array,
    frequency: jax.Array,
    repetition: jax.Array,
) -> jax.Array:
    """float32 [R, vocab] logits with each row's penalties, as vLLM applies OpenAI's and
    transformers' (`record_rows` gives `counts` and `prompted`): a token of the prompt or
    generated so far has its logit divided by `repetition` [R] where positive and multiplied
    where not; then each generated token's logit drops by `frequency` [R] per occurrence and by
    `presence` [R] once. Neutral values (0, 0, 1) leave the logits as they are."""
    seen = prompted | (counts > 0)
    scale = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / scale, logits * scale), logits)
    occurrences = counts.astype(logits.dtype)
    return logits - frequency[:, None] * occurrences - presence[:, None] * (counts > 0)


def sample_rows(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,
    min_p: jax.Array | None = None,
) -> jax.Array:
    """int32 [R] next tokens from float32 [R, vocab] logits, each row drawn as its own
    parameters say (a server's batch mixes requests): greedy (argmax, ties to the lowest id)
    where `temperature` is under `GREEDY_BELOW`, else temperature / min-p (0: all) / top-k (0:
    all; ties with the k-th kept) / top-p (1: all; over the tokens min-p and top-k keep, as
    vLLM) sampling with the key `fold_in(key(seeds[r]), counters[r])`, so a request's draws
    depend on its seed and its token index only, never on the batch it shares. Min-p keeps the
    tokens whose probability (after the temperature) is at least `min_p` times the largest.
    Logits a penalty made infinite count as float32's largest (the most likely tokens)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    sampled_rows = temperature >= GREEDY_BELOW
    scaled = logits / jnp.where(sampled_rows, temperature, 1.0)[:, None]
    scaled = jnp.minimum(scaled, jnp.finfo(scaled.dtype).max)
    order = jnp.argsort(-scaled, axis=-1)
    values = jnp.take_along_axis(scaled, order, axis=-1)
    kth = jnp.take_along_axis(values, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
    keep = (top_k[:, None] <= 0) | (values >= kth)  # the k-th's ties too
    if min_p is not None:
        # Probability ratios to the largest (sorted first): exp(v - v_max).
        keep &= jnp.exp(values - values[:, :1]) >= min_p[:, None]
    probs = jax.nn.softmax(jnp.where(keep, values, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1)
    values = jnp.where(keep, values, -jnp.inf)
    keys = jax.vmap(lambda seed, count: jax.random.fold_in(jax.random.key(seed), count))(
        seeds, counters
    )
    choice = jax.vmap(jax.random.categorical)(keys, values)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(sampled_rows, sampled, greedy)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The model's log-probabilities (of the unscaled logits) of `tokens` [R], and the
    `TOP_LOGPROBS` most likely ids and their log-probabilities, [R, TOP_LOGPROBS] each."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top, ids = lax.top_k(logprobs, min(TOP_LOGPROBS, logits.shape[-1]))
    return chosen, ids.astype(jnp.int32), top
