"""Branches: stages prepared from a source's input and merged back into its output, on simulated
meshes against a float64 single-device reference."""

import jax
import jax.numpy as jnp
import pytest

from .branching import Branched, Layer, built, reference
from .hetero import Kind as K
from .standin import HIDDEN, ROWS, count_patterns

LONGCAT = (Layer(K.ATTN), Layer(K.MOE, (K.FFN, K.ATTN, K.FFN)), Layer(K.ATTN), Layer(K.FFN))


def _error(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 2)])
def test_a_longcat_layer_equals_the_reference(dp, tp):
    """A MoE with a dense FFN, attention and FFN branched from its prepared input, merged at the
    layer's end, equals one device."""
    model = Branched(LONGCAT, dp, tp)
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(5), (dp * ROWS, HIDDEN), jnp.float64)
        counts = count_patterns(dp)["even"]
        run = built(model)
        assert _error(run.run(x, counts), reference(run.stacks, x, dp)) < 1e-12
