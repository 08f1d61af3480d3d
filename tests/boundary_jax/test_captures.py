"""Auxiliary captures (the residual a layer's attention reads and the one the final norm reads,
returned functionally under jit and lax.scan, without changing the output or the sums) and
looped stacks (several passes over the same layers)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

import boundary_jax as bj
from boundary_jax import residual_stream
from boundary_jax.report import parse_hlo

from .standin import (
    HIDDEN,
    Setup,
    StandInDecoder,
    count_patterns,
    make_batch,
    make_mesh,
    sharded_forward,
)
from .test_residual import _blocks

P = bj.ReductionPolicy
# (dp, tp, policy, input-scattered)
CONFIGS = [(1, 4, P.AR, False), (2, 2, P.RSV, False), (2, 2, P.RS, True)]
LAYERS = 4


def _captured(model, x, batch, scan: bool):
    """Every layer's attention-input residual and the final norm's, gathered to the attention's
    rows, stacked: [LAYERS + 1, rows, HIDDEN]; with `scan`, the middle layers run under scan."""

    def capture_layer(layer, carry):
        out, stream = carry
        h, stream, hidden = layer.attn_boundary.prepare_captured(out, stream, gathered=True)
        out, stream = layer.attn_boundary.finish(layer.attn(h), stream)
        h, stream = layer.ffn_boundary.prepare(out, stream)
        return layer.ffn_boundary.finish(layer.ffn(h), stream), hidden

    carry = (x, residual_stream.start(batch))
    layers = list(model.layers)
    if scan:
        carry, first = capture_layer(layers[0], carry)
        run = bj.StackedLayers(layers[1:-1], start=1)
        carry, middle = run.scan(lambda layer, carry, _: capture_layer(layer, carry), carry)
        carry, last = capture_layer(layers[-1], carry)
        hidden = [first, *middle, last]
    else:
        hidden = []
        for index, layer in enumerate(layers):
            with jax.named_scope(f"layer_{index}"):
                carry, value = capture_layer(layer, carry)
            hidden.append(value)
    normed, final = residual_stream.final_norm_captured(*carry, model.final_norm)
    return normed, jnp.stack([*hidden, final])


def _programs(setup, scattered, scan):
    """(plain forward, capturing forward, leaves, place, batch, model) in float64."""
    topology = setup.topology
    rows = topology.row_spec(topology.attention_rows(), None)
    model = StandInDecoder(setup, jax.random.key(3))
    counts = count_patterns(setup.dp)["even"]
    batch = make_batch(setup, scattered, counts)
    plain, leaves, place = sharded_forward(model, setup, batch)
    in_rows = PartitionSpec(
        topology.spec_entry((bj.TokenAxis.ATTN_DP,)), topology.spec_entry((bj.TokenAxis.ATTN_TP,))
    )
    capturing = bj.ShardedModule(model, make_mesh(setup.dp, setup.tp)).program(
        lambda model, x, batch: _captured(model, x, batch, scan),
        in_specs=(in_rows, batch.spec()),
        out_specs=(rows, PartitionSpec(None, *rows)),
    )
    return plain, capturing, leaves, place, batch, model, counts


# Each configuration and each way of running the middle layers by default: TP 4 unrolled,
# DP 2 x TP 2 rsv under scan, and the input-scattered residual (a gather per capture) both ways;
# TP 4 under scan and DP 2 x TP 2 rsv unrolled run under -m slow.
CAPTURE_SLOW = {(CONFIGS[0], True), (CONFIGS[1], False)}
CAPTURE_CASES = [
    pytest.param(
        *config,
        scan,
        id=f"{config[0]}-{config[1]}-{config[2]}-{config[3]}-{'scan' if scan else 'unrolled'}",
        marks=[pytest.mark.slow] if (config, scan) in CAPTURE_SLOW else [],
    )
    for config in CONFIGS
    for scan in (False, True)
]


@pytest.mark.parametrize("dp,tp,policy,scattered,scan", CAPTURE_CASES)
def test_captured_hidden_states_equal_the_reference_residuals(dp, tp, policy, scattered, scan):
    """Layer i's capture is the residual after i layers (the stack input for layer 0), the final
    capture the residual the final norm reads; the main output is unchanged."""
    setup = Setup(dp=dp, tp=tp, layers=LAYERS, policy=policy)
    with jax.enable_x64(True):
        plain, capturing, leaves, place, batch, model, counts = _programs(setup, scattered, scan)
        x = jax.random.normal(jax.random.key(4), (dp * setup.rows, HIDDEN))
        normed, hidden = capturing(leaves, place(x), batch)
        assert float(jnp.max(jnp.abs(normed - plain(leaves, place(x), batch)))) < 1e-12
        for layers in range(LAYERS + 1):
            want = _blocks(model, x, setup, counts, layers)[0].reshape(-1, HIDDEN)
            error = float(jnp.max(jnp.abs(hidden[layers] - want)) / jnp.max(jnp.abs(want)))
            assert error < 1e-12, f"after {layers} layers"


@pytest.mark.parametrize("dp,tp,policy,scattered", CONFIGS)
def test_a_capture_adds_only_the_gather_of_a_scattered_residual(dp, tp, policy, scattered):
    """Capturing unfuses the sum but runs the same sums; only a residual on attention-TP
    slices needs one all-gather per layer's capture to reach the attention's rows."""
    setup = Setup(dp=dp, tp=tp, layers=LAYERS, policy=policy)
    with jax.enable_x64(True):
        plain, capturing, leaves, place, batch, _, _ = _programs(setup, scattered, False)
        x = place(jnp.zeros((dp * setup.rows, HIDDEN)))
        before = parse_hlo(plain.lower(leaves, x, batch).compile().as_text())
        after = parse_hlo(capturing.lower(leaves, x, batch).compile().as_text())
    gathers = 1 if scattered else 0
    for layer in range(LAYERS):
        want = dict(before.counts(layer))
        want["all-gather"] += gathers
        assert after.counts(layer) == want, f"layer {layer}"
    # The terminal FFN already returns the residual to the attention's rows for the final read.
    assert after.counts(None) == before.counts(None)


@pytest.mark.parametrize("dp,tp,policy,scattered", CONFIGS)
def test_a_looped_stack_equals_its_layers_applied_per_pass(dp, tp, policy, scattered):
    """Three passes over the same layers, folding and applying a loop norm between passes,
    equal the single-device layers applied three times."""
    setup = Setup(dp=dp, tp=tp, layers=2, policy=policy)
    passes = 3

    def looped(model, x, batch):
        out, stream = x, residual_stream.start(batch)
        for index in range(passes):
            for layer in model.layers:
                out, stream = layer(out, stream)
            if index + 1 < passes:
                out, stream = residual_stream.next_pass(out, stream, model.final_norm)
        return residual_stream.final_norm(out, stream, model.final_norm)

    with jax.enable_x64(True):
        model = StandInDecoder(setup, jax.random.key(5))
        counts = count_patterns(dp)["even"]
        batch = make_batch(setup, scattered, counts)
        fn, leaves, place = sharded_forward(model, setup, batch, body=looped)
        x = jax.random.normal(jax.random.key(6), (dp * setup.rows, HIDDEN))
        got = fn(leaves, place(x), batch)
        blocks = x.reshape(dp, setup.rows, HIDDEN)
        for _ in range(passes):
            for layer in model.layers:
                blocks = jax.vmap(lambda rows, layer=layer: layer.reference(rows, None))(blocks)
            blocks = jax.vmap(model.final_norm)(blocks)
        want = blocks.reshape(-1, HIDDEN)
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 1e-12
