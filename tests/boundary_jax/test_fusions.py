"""Fusion providers: fused candidates run where they apply, decline cleanly, change nothing."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import boundary_jax as bj
import pallas_kernels as pk
from boundary_jax.fusions import (
    AddRmsNorm,
    AllReduceAddRmsNorm,
    FusionProvider,
    platform_fusions,
)

from .standin import (
    HIDDEN,
    Setup,
    StandInDecoder,
    count_patterns,
    make_batch,
    reference,
    sharded_forward,
)

P = bj.ReductionPolicy
CALLS: list[tuple[str, str, bool]] = []


@dataclasses.dataclass(frozen=True)
class Counting:
    """Records, under the label of the stage input it was bound to, whether the wrapped
    candidate took or declined each request."""

    inner: object
    label: str

    def __call__(self, request):
        result = self.inner(request)
        CALLS.append((self.label, type(self.inner).__name__, result is not None))
        return result


def _interpret(setup: Setup, prefix: str = "") -> FusionProvider:
    def candidates(label):
        return (
            Counting(AllReduceAddRmsNorm("cpu", pk.Impl.PALLAS_INTERPRET), prefix + label),
            Counting(AddRmsNorm("cpu", pk.Impl.PALLAS_INTERPRET), prefix + label),
        )

    return FusionProvider(attn_input=candidates("attn"), ffn_input=candidates("ffn"))


def _run(setup, scattered, *, check_vma):
    model = StandInDecoder(setup, jax.random.key(0), jnp.float32)
    counts = count_patterns(setup.dp)["ragged"]
    batch = make_batch(setup, scattered, counts)
    fn, leaves, place = sharded_forward(model, setup, batch, check_vma=check_vma)
    x = jax.random.normal(jax.random.key(1), (setup.dp * setup.rows, HIDDEN))
    CALLS.clear()
    got = fn(leaves, place(x), batch)
    want = reference(model, x, setup, counts)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))), list(CALLS)


@pytest.mark.parametrize(
    "dp,tp,policy,scattered,taken",
    [
        (1, 2, P.AR, False, {"AllReduceAddRmsNorm"}),
        (2, 2, P.AR, False, {"AllReduceAddRmsNorm", "AddRmsNorm"}),
        (1, 4, P.RS, True, {"AddRmsNorm"}),
    ],
)
def test_fused_candidates_give_the_same_outputs(dp, tp, policy, scattered, taken):
    """With Pallas candidates (interpret mode) the stack equals its reference, and they ran,
    with shard_map's varying-axes check on."""
    setup = Setup(dp=dp, tp=tp, layers=3, policy=policy)
    setup = dataclasses.replace(setup, fusions=_interpret(setup))
    error, calls = _run(setup, scattered, check_vma=True)
    assert error < 1e-5
    assert {name for _, name, took in calls if took} == taken
    assert {label for label, _, took in calls if took} == {"attn", "ffn"}, (
        "each stage kind's own candidates ran at its inputs"
    )


def test_candidates_run_alike_with_the_varying_axes_check_on_or_off():
    """The kernels declare how their outputs vary, so check_vma changes no candidate's
    decision: the same candidates take the same requests, and the outputs are right."""
    setup = Setup(dp=1, tp=2, layers=2, policy=P.AR)
    setup = dataclasses.replace(setup, fusions=_interpret(setup))
    checked_error, checked = _run(setup, False, check_vma=True)
    error, unchecked = _run(setup, False, check_vma=False)
    assert checked_error < 1e-5 and error < 1e-5
    assert checked == unchecked and any(took for _, _, took in checked)


def test_stacks_bind_no_candidates_unless_asked_and_platform_kernels_decline_on_cpu():
    """The default binds the built-in path; the platform's Pallas candidates decline on CPU."""
    setup = Setup(dp=1, tp=2, layers=2, policy=P.AR)
    model = StandInDecoder(setup, jax.random.key(0), jnp.float32)
    assert model.layers[1].attn_boundary.plan.input_fusions == ()
    candidates = platform_fusions(setup.topology, platform="cpu").attn_input
    assert [type(c).__name__ for c in candidates] == [
        "AllReduceAddRmsNorm",
        "AddRmsNorm",
        "AddRmsNormQuantize",
    ]
    value = jnp.ones((8, HIDDEN))
    request = bj.fusions.FusionRequest(
        value,
        value,
        model.layers[1].input_norm,
        bj.designs.PlainAdd(),
        bj.designs.AddNormRead(),
        (bj.TokenAxis.ATTN_TP,),
        setup.topology,
    )
    assert all(candidate(request) is None for candidate in candidates)


def test_a_stage_option_overrides_the_stack_default():
    """A stage's own `fusions` option replaces the stack's provider for that stage only."""
    setup = Setup(dp=2, tp=2, layers=2, policy=P.RSV, fusions=FusionProvider())
    setup = dataclasses.replace(setup, ffn_fusions=_interpret(setup, prefix="own-"))
    model = StandInDecoder(setup, jax.random.key(0), jnp.float32)
    layer = model.layers[1]
    assert layer.attn_boundary.plan.input_fusions == ()
    assert len(layer.ffn_boundary.plan.input_fusions) == 2
    error, calls = _run(setup, False, check_vma=True)
    assert error < 1e-5
    taken = [label for label, _, took in calls if took]
    assert taken == ["own-ffn"] * setup.layers, "each FFN input ran its own candidates, only"


def test_the_fusions_option_takes_a_provider():
    """A fusions option that is not a FusionProvider is rejected when appended."""
    with pytest.raises(TypeError, match="takes a FusionProvider"), bj.layer_stack(bj.Topology()):
        bj.append_stages((bj.declare_ffn(), None, {"fusions": "pallas"}))
