"""The read options: a read that needs every row of the attention's (`reads_after_attn_tp_gather`,
the guide's Qwen4-exp per-layer embedding read) and an update applied at its producer's exit
(`applied_at_exit`) equal their single-device references on every mesh of the stand-in matrix,
and the combinations that cannot be bound are refused."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import boundary_jax as bj
from boundary_jax.designs import PlainAdd

from .cases import SWEEP_MESHES
from .cases import compiled as standin_compiled
from .reads import ReadSetup, compiled
from .standin import HIDDEN, ROWS, Setup, TanhUpdate, count_patterns


def _relative_error(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _errors(case) -> dict[str, float]:
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(7), (case.setup.dp * ROWS, HIDDEN), jnp.float64)
        return {
            name: _relative_error(case.run(x, counts), case.reference(x, counts))
            for name, counts in count_patterns(case.setup.dp).items()
        }


MATRIX = [
    pytest.param(
        dp,
        tp,
        scattered,
        id=f"dp{dp}-tp{tp}-{'scattered' if scattered else 'ordinary'}",
        marks=[] if not scattered or (dp, tp) == (2, 2) else [pytest.mark.slow],
    )
    for dp, tp in SWEEP_MESHES
    for scattered in ((False, True) if tp > 1 else (False,))
]


@pytest.mark.parametrize("dp,tp,scattered", MATRIX)
def test_a_read_of_every_row_after_an_ffn_on_its_own_rows(dp, tp, scattered):
    """An attention whose read needs every row of the attention's, after an FFN on its own
    rows (which leaves its output on this rank's attention-TP slice) or in an input-scattered
    batch, equals the float64 single-device reference for even, ragged and idle DP ranks."""
    errors = _errors(compiled(ReadSetup(dp=dp, tp=tp), scattered))
    assert max(errors.values()) < 1e-12, errors


def test_the_read_on_the_slice_is_caught():
    """The mutant: the same read not declaring `reads_after_attn_tp_gather` runs on this rank's
    slice after the FFN on its own rows, and the output moves away from the reference."""
    setup = dataclasses.replace(ReadSetup(dp=2, tp=2), declared=False)
    assert max(_errors(compiled(setup, False)).values()) > 1e-3


def test_the_plan_returns_the_slice_to_the_attention_rows():
    """The attention after the FFN on its own rows keeps its residual on the attention's rows:
    its entry gathers the FFN's output and the residual from the slices (two all-gathers over
    attention TP), and its read runs on the attention's rows."""
    layer = compiled(ReadSetup(dp=1, tp=4), False).model.layers[1]
    path = layer.attn_boundary.plan.path(bj.BatchVariant.ORDINARY)
    assert path.residual_layout == bj.Topology(attn_tp=4).attention_rows()
    described = bj.report.describe_path(path, layer.attn_boundary.plan.topology)
    primary = next(entry for entry in described["entries"] if entry["primary"])
    assert primary["completes"] == "all-gather over attn_tp, all-gather over attn_tp"
    assert primary["moves_input"] == "nothing"


AT_EXIT = {
    "plain add": functools.partial(PlainAdd, applied_at_exit=True),
    "nonlinear": functools.partial(TanhUpdate, applied_at_exit=True),
}
EXIT_MATRIX = [
    pytest.param(
        dp,
        tp,
        scattered,
        update,
        id=f"dp{dp}-tp{tp}-{'scattered' if scattered else 'ordinary'}-{update}",
        marks=[] if (dp, tp) in ((1, 4), (2, 2)) else [pytest.mark.slow],
    )
    for dp, tp in SWEEP_MESHES
    for scattered in ((False, True) if tp > 1 else (False,))
    for update in AT_EXIT
]


@pytest.mark.parametrize("dp,tp,scattered,update", EXIT_MATRIX)
def test_an_update_applied_at_the_exit(dp, tp, scattered, update):
    """An FFN whose update is `applied_at_exit` (a plain add, or a nonlinear one) completes its
    sum and folds its output into the residual at its exit, so the next stage reads a written
    stream: equal to the float64 single-device reference for even, ragged and idle DP ranks."""
    setup = Setup(dp=dp, tp=tp, layers=3, update=AT_EXIT[update])
    case = standin_compiled(setup, scattered)
    for layer in case.model.layers:
        for path in layer.ffn_boundary.plan.paths:
            assert path.exits and all(option.fold_to is not None for option in path.exits)
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(7), (dp * ROWS, HIDDEN), jnp.float64)
        for name, counts in count_patterns(dp).items():
            got, want = case.run(x, counts), case.reference(x, counts=counts)
            assert _relative_error(got, want) < 1e-12, name


def test_an_update_applied_at_the_exit_moves_the_sum_into_the_exit():
    """On TP 4 each FFN's all-reduce runs at its own exit (the dense table's FFN exit runs
    none): every layer runs its attention's sum at the FFN input and the FFN's at its exit,
    and the next attention input completes nothing."""
    setup = Setup(dp=1, tp=4, layers=3, policy=bj.ReductionPolicy.AR, update=AT_EXIT["plain add"])
    report = standin_compiled(setup, False).report
    sums = ("all-reduce",) * 2
    assert [report.sequence(i) for i in range(3)] == [("all-reduce",) + sums, sums, sums]


def test_an_attention_cannot_apply_its_update_at_the_exit():
    """An ALWAYS_PARTIAL attention leaves its sum to the next input: an update applied at its
    exit is refused when declared, with the fix."""
    with pytest.raises(ValueError, match="declare the stage with declare_mixer"):
        bj.declare_attn(update=PlainAdd(applied_at_exit=True))
    bj.declare_mixer(update=PlainAdd(applied_at_exit=True))
