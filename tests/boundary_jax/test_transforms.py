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
# DP 2 x TP 2 rs+rsv and input-scattered TP 4 rs by default; DP 4 x TP 2 ar (the all-reduce
# path, whose gradients the residual designs' gradient tests also take) under -m slow.
GRAD_CASES = [
    (2, 2, P.RS_RSV, False),
    (1, 4, P.RS, True),
    pytest.param(4, 2, P.AR, False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dp,tp,policy,scattered", GRAD_CASES)
def test_gradient_through_three_layers_equals_single_device(dp, tp, policy, scattered):
    """jax.grad of a loss through a sharded 3-layer stack equals the single-device gradient."""
    setup = Setup(dp=dp, tp=tp, layers=3, policy=policy)
    with jax.enable_x64(True):
        model = StandInDecoder(setup, jax.random.key(11))
        counts = count_patterns(dp)["ragged"]
        batch = make_batch(setup, scattered, counts)
        fn, leaves, place = sharded_forward(model, setup, batch)
        x = jax.random.normal(jax.random.key(12), (dp * setup.rows, HIDDEN))
        weights = jax.random.normal(jax.random.key(13), (dp * setup.rows, HIDDEN))
        graphdef, plain_state = nnx.split(model)

        def sharded_loss(leaves, x):
            return jnp.sum(fn(leaves, x, batch) * weights)

        def reference_loss(state):
            return jnp.sum(reference(nnx.merge(graphdef, state), x, setup, counts) * weights)

        with jax.set_mesh(make_mesh(dp, tp)):
            got = jax.jit(jax.grad(sharded_loss))(leaves, place(x))
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
            fn, leaves, place = sharded_forward(model, setup, batch)
            outputs.append(fn(leaves, place(x), batch))
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


class _Scale(nnx.Module):
    def __init__(self, seed: int):
        self.weight = nnx.Param(jax.random.normal(jax.random.key(seed), (HIDDEN,)))


def _scale_layer(layer, x, cache):
    """A layer that reads its cache slot and writes it back updated (as a KV cache)."""
    x = x.astype(jnp.float32) * layer.weight[...] + jnp.sum(cache[:, :HIDDEN], axis=0)
    return x, cache.at[0, :HIDDEN].add(x)


@pytest.mark.parametrize("first_carry_dtype", [jnp.float32, jnp.float16])
def test_scan_in_place_updates_the_stacked_state_as_the_stacking_scan(first_carry_dtype):
    """`in_place` gives the stacking scan's carry and per-layer outputs (also when the first
    layer's carry type differs and it runs unscanned), and holds no second copy of the state."""
    run = bj.StackedLayers([_Scale(seed) for seed in range(8)], start=1)
    cache = jax.random.normal(jax.random.key(9), (8, 256, 1024))  # 1 MB a layer
    x = jax.random.normal(jax.random.key(8), (HIDDEN,)).astype(first_carry_dtype)

    def scanned(in_place):
        def steps(x, cache):  # as a decode loop: the state rides in the loop's carry
            x, cache = run.scan(_scale_layer, x, cache, in_place=in_place)
            step = lambda _, carry: run.scan(_scale_layer, *carry, in_place=in_place)  # noqa: E731
            return jax.lax.fori_loop(0, 2, step, (x, cache))

        return jax.jit(steps)

    want, got = scanned(False)(x, cache), scanned(True)(x, cache)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert float(jnp.max(jnp.abs(w - g))) == 0
    assert float(jnp.max(jnp.abs(got[1] - cache))) > 0.1

    def temp_bytes(in_place):
        compiled = scanned(in_place).lower(x, cache).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    # In place: about one layer's slice (the layer's own update of it); stacking: all of it.
    assert temp_bytes(True) < cache.nbytes / 4 < temp_bytes(False)
