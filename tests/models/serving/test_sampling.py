"""Sampling on the device: greedy, temperature, top-k and top-p, reproducible by seed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.serving.sampling import GREEDY, Sampling, sample_tokens

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
