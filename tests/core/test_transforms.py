"""The stack under jax.grad and under lax.scan over stacked layer parameters."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import boundary_jax as bj

from .standin import (
    HIDDEN,
    Setup,
    StandInDecoder,
    count_patterns,
    make_batch,
    make_mesh,
    reference,
    sharded_forward,
)

P = bj.ReductionPolicy
GRAD_CASES = [(2, 2, P.RS_RSV, False), (1, 4, P.RS, True), (4, 2, P.AR, False)]


@pytest.mark.parametrize("dp,tp,policy,scattered", GRAD_CASES)
def test_gradient_through_three_layers_equals_single_device(dp, tp, policy, scattered):
    """jax.grad of a loss through a sharded 3-layer stack equals the single-device gradient."""
    setup = Setup(dp=dp, tp=tp, layers=3, policy=policy)
    with jax.enable_x64(True):
        model = StandInDecoder(setup, jax.random.key(11))
        counts = count_patterns(dp)["ragged"]
        batch = make_batch(setup, scattered, counts)
        fn, state, place = sharded_forward(model, setup, batch)
        x = jax.random.normal(jax.random.key(12), (dp * setup.rows, HIDDEN))
        weights = jax.random.normal(jax.random.key(13), (dp * setup.rows, HIDDEN))
        graphdef, plain_state = nnx.split(model)

        def sharded_loss(state, x):
            return jnp.sum(fn(state, x, batch) * weights)

        def reference_loss(state):
            return jnp.sum(reference(nnx.merge(graphdef, state), x, setup, counts) * weights)

        with jax.set_mesh(make_mesh(dp, tp)):
            got = jax.jit(jax.grad(sharded_loss))(state, place(x))
        want = jax.grad(reference_loss)(plain_state)
        got_leaves = [jax.device_get(leaf) for leaf in jax.tree.leaves(got)]
        want_leaves = jax.tree.leaves(want)
        assert len(got_leaves) == len(want_leaves) > 10
        for g, w in zip(got_leaves, want_leaves, strict=True):
            assert float(jnp.max(jnp.abs(g - w))) <= 1e-11 * (1 + float(jnp.max(jnp.abs(w))))


@pytest.mark.parametrize("dp,tp,policy,scattered", [(2, 2, P.RSV, False), (1, 4, P.RS, True)])
def test_scan_over_middle_layers_equals_the_unrolled_stack(dp, tp, policy, scattered):
    """Layers between the stack entry and the terminal layer scan with the unrolled result."""
    setup = Setup(dp=dp, tp=tp, layers=5, policy=policy)
    outputs = []
    with jax.enable_x64(True):
        counts = count_patterns(dp)["ragged"]
        batch = make_batch(setup, scattered, counts)
        x = jax.random.normal(jax.random.key(3), (dp * setup.rows, HIDDEN))
        for scan in (False, True):
            model = StandInDecoder(setup, jax.random.key(2))
            model.scan_middle = scan
            fn, state, place = sharded_forward(model, setup, batch)
            outputs.append(fn(state, place(x), batch))
        want = reference(model, x, setup, counts)
        unrolled, scanned = (jax.device_get(out) for out in outputs)
        assert float(jnp.max(jnp.abs(unrolled - scanned))) < 1e-13
        assert float(jnp.max(jnp.abs(scanned - want))) < 1e-12 * float(jnp.max(jnp.abs(want)))


def test_scan_rejects_layers_bound_differently():
    """The stack-entry layer binds other paths than a middle layer, so it cannot scan with it."""
    setup = Setup(dp=1, tp=1, layers=3)
    model = StandInDecoder(setup, jax.random.key(0), jnp.float32)
    with pytest.raises(ValueError, match="layer 1 differs from layer 0"):
        bj.StackedLayers(list(model.layers)[:2], start=0)
