"""Every parallel path of a stand-in decoder equals its single-device reference."""

import jax
import jax.numpy as jnp
import pytest

import boundary_jax as bj
from boundary_jax import ops

from .cases import SWEEP, compiled
from .standin import (
    HIDDEN,
    ROWS,
    Setup,
    StandInDecoder,
    count_patterns,
    make_batch,
    reference,
    sharded_forward,
)


def _relative_error(got, want):
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("dp,tp,layers,policy,scattered", SWEEP)
def test_stack_equals_single_device_reference(dp, tp, layers, policy, scattered):
    """Outputs equal the float64 single-device reference for even, ragged and idle DP ranks."""
    setup = Setup(dp=dp, tp=tp, layers=layers, policy=policy)
    case = compiled(setup, scattered)
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(7), (dp * ROWS, HIDDEN), jnp.float64)
        for name, counts in count_patterns(dp).items():
            got = case.run(x, counts)
            want = case.reference(x, counts=counts)
            assert _relative_error(got, want) < 1e-12, name


# TP alone by default; input-scattered DP x TP, DP 4 x TP 2 (ordinary rows, a repeat of the
# DP x TP sums) and DP alone under -m slow.
@pytest.mark.parametrize(
    "dp,tp,scattered",
    [
        (1, 8, False),
        pytest.param(2, 4, True, marks=pytest.mark.slow),
        pytest.param(4, 2, False, marks=pytest.mark.slow),
        pytest.param(8, 1, False, marks=pytest.mark.slow),
    ],
)
def test_float32_stack_within_1e6(dp, tp, scattered):
    """In float32 the parallel stack stays within 1e-6 (relative to the largest output)."""
    setup = Setup(dp=dp, tp=tp, layers=4, policy=bj.ReductionPolicy.RS_RSV)
    model = StandInDecoder(setup, jax.random.key(3), jnp.float32)
    counts = count_patterns(dp)["ragged"]
    batch = make_batch(setup, scattered, counts)
    fn, leaves, place = sharded_forward(model, setup, batch)
    x = jax.random.normal(jax.random.key(4), (dp * ROWS, HIDDEN), jnp.float32)
    got = fn(leaves, place(x), batch)
    assert _relative_error(got, reference(model, x, setup, counts)) < 1e-6


def _mutated(monkeypatch, step_class, mutate, at: int):
    """Patches call `at` (0-based) of `step_class` in the next trace with
    `mutate(original, step, x)`; returns the list the calls are recorded in."""
    original = step_class.__call__
    calls = []

    def patched(step, x):
        calls.append(step)
        return mutate(original, step, x) if len(calls) == at + 1 else original(step, x)

    monkeypatch.setattr(step_class, "__call__", patched)
    return calls


MUTANTS = {
    "skip an all-reduce": (ops.AllReduce, lambda original, step, x: x),
    "double an all-reduce": (ops.AllReduce, lambda original, step, x: 2 * original(step, x)),
    "skip a reduce-scatter's sum": (
        ops.ReduceScatter,
        lambda original, step, x: ops.TakeBlock(step.axes, step.topology)(x),
    ),
    "double a reduce-scatter": (ops.ReduceScatter, lambda original, step, x: 2 * original(step, x)),
}


MUTANT_CASES = [
    (mutant, config)
    for mutant, (step_class, _) in sorted(MUTANTS.items())
    for config in (
        [(1, 4, bj.ReductionPolicy.AR, False), (2, 2, bj.ReductionPolicy.RS_RSV, False)]
        if step_class is ops.AllReduce
        else [(2, 2, bj.ReductionPolicy.RS_RSV, False), (2, 2, bj.ReductionPolicy.RS, True)]
    )
]


@pytest.mark.parametrize(
    "mutant,config", MUTANT_CASES, ids=[f"{m}-{c[0]}x{c[1]}-{c[2].value}" for m, c in MUTANT_CASES]
)
def test_a_mutant_that_skips_or_doubles_one_sum_is_caught(monkeypatch, mutant, config):
    """Skipping or doubling any one sum, each of them in turn, makes the parity check fail.

    The mutants run with `check_vma=False`: with the check on, a skipped sum already fails to
    trace (the output is not replicated where `out_specs` says it is).
    """
    dp, tp, policy, scattered = config
    step_class, mutate = MUTANTS[mutant]
    setup = Setup(dp=dp, tp=tp, layers=2, policy=policy)
    with jax.enable_x64(True):
        model = StandInDecoder(setup, jax.random.key(5))
        counts = count_patterns(dp)["even"]
        batch = make_batch(setup, scattered, counts)
        x = jax.random.normal(jax.random.key(6), (dp * ROWS, HIDDEN), jnp.float64)
        want = reference(model, x, setup, counts)
        calls = _mutated(monkeypatch, step_class, lambda original, step, x: original(step, x), 0)
        fn, leaves, place = sharded_forward(model, setup, batch, check_vma=False)
        fn.lower(leaves, place(x), batch)
        runs = len(calls)
        assert runs, f"the configuration must run a {step_class.__name__}"
        for at in range(runs):
            monkeypatch.undo()
            calls = _mutated(monkeypatch, step_class, mutate, at)
            fn, leaves, place = sharded_forward(model, setup, batch, check_vma=False)
            error = _relative_error(fn(leaves, place(x), batch), want)
            assert len(calls) == runs
            assert error > 1e-3, f"mutating {step_class.__name__} call {at} of {runs} is not seen"


@pytest.mark.xdist_group("core-2x2")
def test_every_policy_is_exercised_by_distinct_programs():
    """The sweep's policies bind different paths where the topology lets them differ."""
    with jax.enable_x64(True):
        keys = {
            policy: compiled(Setup(dp=2, tp=2, layers=2, policy=policy), False).report.sequence()
            for policy in (bj.ReductionPolicy.AR, bj.ReductionPolicy.RS, bj.ReductionPolicy.RSV)
        }
    assert len(set(keys.values())) == 3, keys
