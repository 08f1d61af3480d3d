"""Choosing the next token from logits on the device: greedy, or temperature / top-k / top-p."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

import boundary_jax as bj

from ..decoder.model import CausalLM


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn; static (part of the compiled step).

    Attributes:
      temperature: 0 for greedy (argmax); else logits are divided by it before drawing.
      top_k: Draw among the k most likely tokens only (None: all).
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
        return self.temperature == 0


GREEDY = Sampling()


def sample_tokens(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """int32 [R] next tokens from [R, vocab] float logits; `key` is unused when greedy.

    Ties in greedy decoding go to the lowest token id (as `numpy.argmax`).
    """
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampling.temperature
    vocab = logits.shape[-1]
    if sampling.top_k is not None and sampling.top_k < vocab:
        values, ids = jax.lax.top_k(logits, sampling.top_k)  # sorted, largest first
    else:
        order = jnp.argsort(-logits, axis=-1)
        ids = order.astype(jnp.int32)
        values = jnp.take_along_axis(logits, order, axis=-1)
    if sampling.top_p is not None:
        probs = jax.nn.softmax(values, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ahead of each
        values = jnp.where(before < sampling.top_p, values, -jnp.inf)
    choice = jax.random.categorical(key, values, axis=-1)
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


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
