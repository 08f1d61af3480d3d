"""Residual helpers and declaration options move and sum the right values under shard_map."""

import jax
import jax.numpy as jnp
import pytest

import boundary_jax as bj
from boundary_jax import residual_stream
from boundary_jax.report import parse_hlo
from boundary_jax.rows import stage_rows

from .standin import (
    HIDDEN,
    Setup,
    StandInDecoder,
    TanhUpdate,
    count_patterns,
    make_batch,
    reference,
    sharded_forward,
)

P = bj.ReductionPolicy
# (dp, tp, policy, input-scattered): a deferred all-reduce, a deferred rsv remainder, scattered.
CONFIGS = [(1, 2, P.AR, False), (2, 2, P.RSV, False), (2, 2, P.RS, True)]
IDS = ["tp2-ar", "dp2tp2-rsv", "dp2tp2-rs-scattered"]


def _run(setup, scattered, body=None, out_layout=None, counts_name="ragged", key=0):
    """Runs `body` sharded, returns (output, model, x, counts) in float64."""
    with jax.enable_x64(True):
        model = StandInDecoder(setup, jax.random.key(key))
        counts = count_patterns(setup.dp, setup.rows)[counts_name]
        batch = make_batch(setup, scattered, counts)
        fn, leaves, place = sharded_forward(model, setup, batch, body=body, out_layout=out_layout)
        x = jax.random.normal(jax.random.key(key + 1), (setup.dp * setup.rows, HIDDEN))
        return fn(leaves, place(x), batch), model, x, counts


def _blocks(model, x, setup, counts, layers):
    """Reference residual rows of each DP block after `layers` layers."""
    blocks = x.reshape(setup.dp, setup.rows, HIDDEN)
    valid = jnp.arange(setup.rows)[None, :] < jnp.asarray(counts)[:, None]
    rows = jnp.where(valid[..., None], blocks, 0)
    for layer in list(model.layers)[:layers]:
        rows = jax.vmap(lambda r, layer=layer: layer.reference(r, None))(rows)
    return rows, valid


def _close(got, want, valid=None):
    if valid is not None:
        got = jnp.where(valid.reshape(-1)[:, None], got, 0)
        want = jnp.where(valid.reshape(-1)[:, None], want, 0)
    assert float(jnp.max(jnp.abs(got - want))) < 1e-12 * float(jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("dp,tp,policy,scattered", CONFIGS, ids=IDS)
def test_snapshot_and_fold_give_the_updated_residual(dp, tp, policy, scattered):
    """snapshot() and fold()+take_output() both equal the residual after layer 0."""
    setup = Setup(dp=dp, tp=tp, layers=2, policy=policy)
    rows = stage_rows(
        (bj.declare_attn(), bj.declare_ffn()),
        make_batch(setup, scattered, None).variant,
        setup.topology,
    )[1].residual

    def snap(model, x, batch):
        out, stream = model.layers[0](x, residual_stream.start(batch))
        return residual_stream.snapshot(out, stream)

    def fold(model, x, batch):
        out, stream = model.layers[0](x, residual_stream.start(batch))
        out, stream = residual_stream.complete_output(out, stream)
        return residual_stream.take_output(*residual_stream.fold(out, stream))

    with jax.enable_x64(True):
        got, model, x, counts = _run(setup, scattered, snap, out_layout=rows)
        want, valid = _blocks(model, x, setup, counts, 1)
        _close(got, want.reshape(-1, HIDDEN), valid)
        got, *_ = _run(setup, scattered, fold)
        _close(got, want.reshape(-1, HIDDEN), valid)


@pytest.mark.parametrize("dp,tp,policy,scattered", CONFIGS, ids=IDS)
def test_add_to_output_and_set_written_change_what_the_next_layer_reads(dp, tp, policy, scattered):
    """An extra contribution is added once; a set_written residual replaces the stream's."""
    setup = Setup(dp=dp, tp=tp, layers=3, policy=policy)

    def body(model, x, batch):
        out, stream = model.layers[0](x, residual_stream.start(batch))
        extra = residual_stream.snapshot(out, stream) * 0.5
        out, stream = residual_stream.add_to_output(out, stream, extra)
        out, stream = model.layers[1](out, stream)
        out, stream = residual_stream.fold(out, stream)
        out, stream = residual_stream.set_written(-residual_stream.snapshot(out, stream), stream)
        out, stream = model.layers[2](out, stream)
        return residual_stream.final_norm(out, stream, model.final_norm)

    with jax.enable_x64(True):
        got, model, x, counts = _run(setup, scattered, body)
        rows, valid = _blocks(model, x, setup, counts, 1)
        rows = rows * 1.5
        rows = -jax.vmap(lambda r: model.layers[1].reference(r, None))(rows)
        rows = jax.vmap(lambda r: model.layers[2].reference(r, None))(rows)
        want = jax.vmap(model.final_norm)(rows)
        _close(got, want.reshape(-1, HIDDEN), valid)


OPTIONS = {
    "tanh transform": dict(transform="tanh"),
    "module transform": dict(transform="module"),
    "nonlinear update": dict(update=TanhUpdate),
    "read after the DP gather": dict(reads_before_dp_gather=False),
}


# Every option on every configuration by default except three repeats, under -m slow: reading
# after the DP gather and the nonlinear update under TP 2 alone (no DP gather to read after, and
# the update binds as under DP 2 x TP 2), and the module transform on scattered rows (the tanh
# function runs a transform there; the module runs on the other two configurations).
OPTION_SLOW = {
    ("tp2-ar", "read after the DP gather"),
    ("tp2-ar", "nonlinear update"),
    ("dp2tp2-rs-scattered", "module transform"),
}
OPTION_CASES = [
    pytest.param(
        option,
        *config,
        id=f"{name}-{option}",
        marks=[pytest.mark.slow] if (name, option) in OPTION_SLOW else [],
    )
    for config, name in zip(CONFIGS, IDS, strict=True)
    for option in sorted(OPTIONS)
]


@pytest.mark.parametrize("option,dp,tp,policy,scattered", OPTION_CASES)
def test_declaration_options_keep_parity(option, dp, tp, policy, scattered):
    """Output transforms (also carried to the next input), updates and read orders match."""
    setup = Setup(dp=dp, tp=tp, layers=3, policy=policy, **OPTIONS[option])
    with jax.enable_x64(True):
        got, model, x, counts = _run(setup, scattered)
        _close(got, reference(model, x, setup, counts))


@pytest.mark.parametrize("scattered", [False, True])
def test_a_linear_transform_may_run_before_the_reduce_scatter(scattered):
    """A transform declared to commute with the sum runs before the exit's reduce-scatter."""
    setup = Setup(
        dp=2, tp=2, layers=2, policy=P.RS, transform="halve", transform_before_reduce_scatter=True
    )
    with jax.enable_x64(True):
        got, model, x, counts = _run(setup, scattered)
        _close(got, reference(model, x, setup, counts))


def test_rs_falls_back_to_all_reduce_when_rows_do_not_divide():
    """With each DP rank's rows not divisible by attention TP, rs is ineligible for the batch."""
    setup = Setup(dp=2, tp=2, layers=2, policy=P.RS, rows=3)
    with jax.enable_x64(True):
        model = StandInDecoder(setup, jax.random.key(0))
        counts = count_patterns(2, 3)["ragged"]
        batch = make_batch(setup, False, counts)
        fn, leaves, place = sharded_forward(model, setup, batch)
        x = jax.random.normal(jax.random.key(1), (6, HIDDEN))
        exits = model.layers[0].ffn_boundary.plan.path(batch.variant).exits
        assert [o.kind.name for o in exits] == ["REDUCE_SCATTER", "ALL_REDUCE"]
        _close(fn(leaves, place(x), batch), reference(model, x, setup, counts))
        report = parse_hlo(fn.lower(leaves, place(x), batch).compile().as_text())
        assert "reduce-scatter" not in report.sequence()


def test_final_norm_with_skip_empty_leaves_idle_ranks_zero():
    """With skip_empty an idle DP rank's rows stay zero; the busy ranks' rows are exact."""
    setup = Setup(dp=2, tp=2, layers=2, policy=P.RSV)
    with jax.enable_x64(True):
        got, model, x, counts = _run(setup, False, counts_name="idle")
        assert counts[1] == 0
        assert float(jnp.max(jnp.abs(jax.device_get(got)[setup.rows :]))) == 0.0
        _close(got, reference(model, x, setup, counts))


def test_add_and_norm_accumulate_in_float32_for_a_bf16_stream():
    """The boundary's add + RMSNorm of a bf16 stream normalizes the float32 sum: its output
    equals the float32 reference rounded once, which rounding the sum to bf16 first misses in
    a quarter of the elements."""
    hidden = 256
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    stored = (30 * jax.random.normal(k1, (64, hidden))).astype(jnp.bfloat16)
    value = jax.random.normal(k2, (64, hidden)).astype(jnp.bfloat16)
    norm = bj.RMSNorm(hidden)
    norm.weight[...] = 1 + 0.1 * jax.random.normal(k3, (hidden,))
    topology = bj.Topology()
    with bj.layer_stack(topology):
        (boundary,) = bj.append_stages((bj.declare_attn(), None))
    _, stream = boundary.prepare(stored, residual_stream.start(bj.BatchFacts.ordinary(topology)))
    out, stream = boundary.finish(value, stream)
    got = residual_stream.final_norm(out, stream, norm)

    def normalized(summed):
        summed = summed.astype(jnp.float32)
        inverse = jax.lax.rsqrt(jnp.mean(summed * summed, -1, keepdims=True) + norm.eps)
        return (summed * inverse * norm.weight[...][None, :]).astype(jnp.bfloat16)

    want = normalized(value.astype(jnp.float32) + stored.astype(jnp.float32))
    rounded_first = normalized(value + stored)
    assert float(jnp.mean(got != want)) < 0.01
    assert float(jnp.mean(rounded_first != want)) > 0.1, "the inputs must tell the two apart"
