"""The read options: a read that needs every row of the attention's (`reads_after_attn_tp_gather`,
the guide's Qwen4-exp per-layer embedding read) equals its single-device reference on every mesh
of the stand-in matrix."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import boundary_jax as bj

from .cases import SWEEP_MESHES
from .reads import ReadSetup, compiled
from .standin import HIDDEN, ROWS, count_patterns


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
