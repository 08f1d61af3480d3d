"""Sampling on the device: greedy, temperature, top-k and top-p, reproducible by seed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.serving.sampling import (
    GREEDY,
    Sampling,
    hold_stops,
    penalize,
    record_rows,
    sample_rows,
    sample_tokens,
)

LOGITS = jax.random.normal(jax.random.key(0), (6, 50), jnp.float32) * 3


def test_greedy_is_argmax():
    """Temperature 0 takes the argmax of every row."""
    got = sample_tokens(LOGITS, jax.random.key(1), GREEDY)
    np.testing.assert_array_equal(got, np.argmax(LOGITS, axis=-1))


@pytest.mark.parametrize("sampling", [Sampling(1.0, top_k=1), Sampling(1.0, top_p=1e-6)])
def test_top_one_is_greedy(sampling):
    """top_k=1, or top_p below the largest probability, leaves only the argmax to draw."""
    got = sample_tokens(LOGITS, jax.random.key(2), sampling)
    np.testing.assert_array_equal(got, np.argmax(LOGITS, axis=-1))


def test_top_k_draws_only_among_the_k_largest():
    """Every draw with top_k=3 is one of the row's 3 largest logits; a seed repeats draws."""
    sampling = Sampling(2.0, top_k=3)
    draws = jax.vmap(lambda key: sample_tokens(LOGITS, key, sampling))(
        jax.random.split(jax.random.key(3), 200)
    )
    top3 = np.argsort(-np.asarray(LOGITS), axis=-1)[:, :3]
    for row in range(LOGITS.shape[0]):
        assert set(np.asarray(draws[:, row]).tolist()) <= set(top3[row].tolist())
    again = sample_tokens(LOGITS, jax.random.key(3), sampling)
    np.testing.assert_array_equal(again, sample_tokens(LOGITS, jax.random.key(3), sampling))


def test_top_k_keeps_the_ties_of_the_kth_logit():
    """As transformers and vLLM: top_k=1 over logits (1, 1, 1, 0) draws each of the three tied
    tokens, never the fourth, in `generate`'s sampler (with and without top_p) and the
    server's (top_k 1, and top_k 2 with min_p 0)."""
    logits = jnp.asarray([[1.0, 1.0, 1.0, 0.0]])
    keys = jax.random.split(jax.random.key(5), 300)
    for sampling in (Sampling(1.0, top_k=1), Sampling(1.0, top_k=1, top_p=0.99)):
        draws = jax.vmap(lambda key, s=sampling: sample_tokens(logits, key, s))(keys)
        assert set(np.asarray(draws).ravel().tolist()) == {0, 1, 2}
    rows = 300
    ones = jnp.ones(rows)
    for top_k in (1, 2):
        draws = jax.jit(sample_rows)(
            jnp.tile(logits, (rows, 1)),
            ones,
            jnp.full(rows, top_k, jnp.int32),
            ones,
            jnp.arange(rows, dtype=jnp.uint32),
            jnp.zeros(rows, jnp.int32),
            jnp.zeros(rows),
        )
        assert set(np.asarray(draws).tolist()) == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    """With probabilities (0.5, 0.3, 0.2) and top_p=0.7, only the first two are ever drawn."""
    logits = jnp.log(jnp.array([[0.2, 0.5, 0.3]], jnp.float32))
    draws = jax.vmap(lambda key: sample_tokens(logits, key, Sampling(1.0, top_p=0.7)))(
        jax.random.split(jax.random.key(4), 400)
    )
    seen = set(np.asarray(draws).ravel().tolist())
    assert seen == {1, 2}


def test_invalid_settings_fail_at_construction():
    """Negative temperature, top_k < 1, top_p outside (0, 1] and top-k/p without a
    temperature are rejected when the Sampling is built."""
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        Sampling(-1.0)
    with pytest.raises(ValueError, match="top_k must be"):
        Sampling(1.0, top_k=0)
    with pytest.raises(ValueError, match="top_p must be"):
        Sampling(1.0, top_p=1.5)
    with pytest.raises(ValueError, match="need a temperature"):
        Sampling(top_k=5)


def reference_history(slots, rows, prompt_lengths, vocab):
    """The counts and prompt marks of `record_rows`, one row at a time."""
    counts = np.zeros((slots, vocab), np.int32)
    prompted = np.zeros((slots, vocab), bool)
    for token, position, slot in rows:
        if slot < 0:
            continue
        if position >= prompt_lengths[slot]:
            counts[slot, token] += 1
        else:
            prompted[slot, token] = True
    return counts, prompted


def test_record_rows_counts_generated_tokens_and_marks_prompts():
    """Rows of three slots and padding: a slot whose rows start at position 0 starts afresh;
    rows past their slot's prompt length count as generated (twice where a token repeats),
    the others mark the prompt; padding rows (slot -1) change nothing."""
    vocab, prompt_lengths = 7, np.asarray([2, 3, 1], np.int32)
    counts = np.zeros((3, vocab), np.int32)
    counts[1, 4] = counts[2, 6] = 5  # slot 1 restarts; slot 2 continues
    prompted = np.zeros((3, vocab), bool)
    prompted[1, 0] = prompted[2, 5] = True
    rows = [(3, 0, 1), (3, 1, 1), (2, 2, 1), (2, 3, 1), (1, 4, 2), (6, 5, 2), (0, 0, -1)]
    ids, positions, slots = (np.asarray(column, np.int32) for column in zip(*rows, strict=True))
    got = record_rows(
        jnp.asarray(counts), jnp.asarray(prompted), ids, positions, slots, prompt_lengths
    )
    want_counts, want_prompted = reference_history(3, rows, prompt_lengths, vocab)
    want_counts[2, 6] += 5
    want_prompted[2, 5] = True
    np.testing.assert_array_equal(got[0], want_counts)
    np.testing.assert_array_equal(got[1], want_prompted)


def test_penalize_is_vllms_order_of_penalties():
    """Repetition divides positive and multiplies negative logits of every token seen
    (prompt or generated); frequency and presence then lower generated tokens by count and
    once; neutral values change nothing."""
    logits = np.asarray([[2.0, -1.0, 0.5, 3.0], [1.0, -2.0, 4.0, 0.0]], np.float32)
    counts = np.asarray([[0, 2, 0, 1], [0, 0, 0, 0]], np.int32)
    prompted = np.asarray([[True, False, False, False], [False, True, False, False]])
    got = penalize(
        jnp.asarray(logits),
        jnp.asarray(counts),
        jnp.asarray(prompted),
        jnp.asarray([0.5, 0.0]),
        jnp.asarray([0.25, 0.0]),
        jnp.asarray([2.0, 1.0]),
    )
    want = np.asarray([[1.0, -2.0 - 0.5 - 0.5, 0.5, 1.5 - 0.25 - 0.5], logits[1]], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_min_p_keeps_tokens_near_the_most_likely():
    """min_p 1 leaves only the argmax; min_p 0.3 draws only tokens at least 0.3 times as
    likely as the most likely one (after the temperature)."""
    rows = LOGITS.shape[0]
    draw = jax.jit(sample_rows)
    ones, zeros = jnp.ones(rows), jnp.zeros(rows, jnp.int32)
    seeds = jnp.arange(rows, dtype=jnp.uint32)
    got = draw(LOGITS, ones, zeros, ones, seeds, zeros, jnp.ones(rows))
    np.testing.assert_array_equal(got, np.argmax(LOGITS, axis=-1))
    scaled = np.asarray(LOGITS) / 2.0
    ratio = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    for counter in range(50):
        counters = jnp.full(rows, counter, jnp.int32)
        got = draw(LOGITS, 2 * ones, zeros, ones, seeds, counters, jnp.full(rows, 0.3))
        assert np.all(ratio[np.arange(rows), np.asarray(got)] >= 0.3 - 1e-6)


def test_hold_stops_masks_held_ids_until_min_tokens():
    """A row's held ids are -inf while it has generated fewer than min_tokens tokens (its
    position drawn less its prompt length), as they are afterwards."""
    logits = jnp.zeros((3, 4))
    held = jnp.asarray([[True, False, True, False]] * 3)
    got = hold_stops(
        logits, held, jnp.asarray([5, 7, 9]), jnp.asarray([5, 5, 5]), jnp.asarray([3, 3, 3])
    )
    assert np.isneginf(got[0, 0]) and np.isneginf(got[1, 2]) and not np.isinf(got[0, 1])
    np.testing.assert_array_equal(got[2], np.zeros(4))


def test_overflowing_logits_draw_the_most_likely_token():
    """A temperature under `GREEDY_BELOW` (dividing by it overflows float32, and the two largest
    logits tie at inf) draws greedily, as vLLM; a repetition penalty that made a logit infinite
    draws that token, in both samplers."""
    logits = jnp.asarray([[49.0, 50.0, 1.0, 0.5]] * 64)
    rows = logits.shape[0]
    ones, zeros = jnp.ones(rows), jnp.zeros(rows, jnp.int32)
    seeds = jnp.arange(rows, dtype=jnp.uint32)
    no_min_p = jnp.zeros(rows)
    draw = jax.jit(sample_rows)
    got = draw(logits, jnp.full(rows, 1e-37), zeros, ones, seeds, zeros, no_min_p)
    assert set(np.asarray(got).tolist()) == {1}
    got = sample_tokens(logits, jax.random.key(0), Sampling(1e-37))
    assert set(np.asarray(got).tolist()) == {1}
    got = draw(logits.at[:, 1].set(jnp.inf), ones, zeros, ones, seeds, zeros, no_min_p)
    assert set(np.asarray(got).tolist()) == {1}


def test_top_p_one_keeps_every_token(monkeypatch):
    """top_p 1 keeps the tail whose probability float32's cumulative sum rounds away (a token
    is kept while the mass before it is under p, and that mass reaches 1.0 early): the draw is
    replaced by the least likely token still drawable."""

    def least_likely_kept(key, logits, axis=-1):
        positions = jnp.arange(logits.shape[-1])
        return jnp.max(jnp.where(jnp.isfinite(logits), positions, -1), axis=axis)

    monkeypatch.setattr(jax.random, "categorical", least_likely_kept)
    logits = jnp.asarray([[30.0] + [0.0] * 9, [0.0] * 10])
    rows = logits.shape[0]
    ones, zeros = jnp.ones(rows), jnp.zeros(rows, jnp.int32)
    seeds = jnp.arange(rows, dtype=jnp.uint32)
    got = sample_rows(logits, ones, zeros, ones, seeds, zeros, jnp.zeros(rows))
    np.testing.assert_array_equal(got, [9, 9])
    got = sample_tokens(logits[:1], jax.random.key(0), Sampling(1.0, top_p=1.0))
    np.testing.assert_array_equal(got, [9])
