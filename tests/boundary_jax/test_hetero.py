"""Heterogeneous stacks on simulated meshes: FFNs on their own rows, deferred finalizes, and
values through every pipeline cut, against a float64 single-device reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import boundary_jax as bj
from boundary_jax import ops, residual_stream
from boundary_jax.layout import Layout

from .hetero import HIDDEN, Built, Hetero, Kind, build, reference
from .standin import ROWS, count_patterns

K = Kind
V = bj.BatchVariant
SLOW = pytest.mark.slow
# (kinds, dp, tp, variant, marks): the defect shapes of the pipeline PR among them. By default
# four scenarios that between them hold every batch kind, every stage kind and both mesh
# classes: an MoE and a mixer under DP x TP, a mixer opening the stack and following a mixer, an
# MoE on input-scattered rows beside one on its own rows, an FFN on its own rows in an unpadded
# batch.
# The rest (FFNs on their own rows at cuts, which the defect tests below also cut) run under
# -m slow.
SCENARIOS = [
    ((K.ATTN, K.FFN_DP, K.ATTN, K.FFN), 1, 4, V.ORDINARY, SLOW),
    ((K.ATTN, K.FFN_DP, K.ATTN, K.FFN), 2, 2, V.ORDINARY, SLOW),
    ((K.ATTN, K.MOE_OWN, K.ATTN, K.MOE), 1, 2, V.ORDINARY, SLOW),
    ((K.ATTN, K.MOE, K.MIXER, K.FFN), 2, 2, V.ORDINARY, ()),
    ((K.MIXER, K.FFN, K.MIXER, K.MIXER), 1, 4, V.ORDINARY, ()),
    ((K.ATTN, K.FFN, K.ATTN, K.FFN_DP), 2, 2, V.INPUT_SCATTERED, SLOW),
    ((K.ATTN, K.MOE, K.ATTN, K.MOE_OWN), 1, 4, V.INPUT_SCATTERED, ()),
    ((K.ATTN, K.FFN_DP, K.MIXER, K.MOE), 1, 4, V.UNPADDED, ()),
]
SCENARIO_PARAMS = [
    pytest.param(
        kinds,
        dp,
        tp,
        variant,
        id=f"{'-'.join(k.name for k in kinds)}-dp{dp}-tp{tp}-{variant.value}",
        marks=marks,
    )
    for kinds, dp, tp, variant, marks in SCENARIOS
]


def _rows(variant: V) -> int:
    return ROWS + 1 if variant is V.UNPADDED else ROWS


@functools.cache
def _uncut(model: Hetero):
    return build(model, None)


def _error(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _inputs(model: Hetero, variant: V, counts: str = "ragged"):
    rows = _rows(variant)
    x = jax.random.normal(jax.random.key(5), (model.dp * rows, HIDDEN), jnp.float64)
    return x, count_patterns(model.dp, rows)[counts]


def _want(stacks, x, counts, dp):
    valid = (np.arange(x.shape[0] // dp)[None, :] < np.asarray(counts)[:, None]).reshape(-1)
    return jnp.where(valid[:, None], reference(stacks, jnp.where(valid[:, None], x, 0), dp), 0)


@pytest.mark.parametrize("kinds,dp,tp,variant", SCENARIO_PARAMS)
def test_every_cut_equals_the_uncut_stack_and_the_reference(kinds, dp, tp, variant):
    """Sender, to_pp, transport, from_pp and receiver equal the uncut run and the float64
    single-device reference, at every cut; FFNs on their own rows and deferred finalizes among
    the stages."""
    model = Hetero(kinds, dp, tp)
    with jax.enable_x64(True):
        x, counts = _inputs(model, variant)
        run, stacks = _uncut(model).run, _uncut(model).stacks
        uncut = run(x, counts, variant)
        assert _error(uncut, _want(stacks, x, counts, dp)) < 1e-12
        # The simulated transport sends one slice per attention-TP rank, which an unpadded
        # batch's rows do not divide into; its stack is checked uncut.
        cuts = () if variant is V.UNPADDED else range(1, len(kinds))
        for cut in cuts:
            got = build(model, cut).run(x, counts, variant)
            assert _error(got, uncut) < 1e-12, f"cut at {cut}"


@pytest.mark.parametrize("terminal", [False, True], ids=["into-next-input", "into-final-norm"])
def test_a_deferred_finalize_equals_completing_it_at_the_exit(terminal):
    """A sparse FFN handing its finalize (and sum) to the next input, or to the final norm,
    equals the same stack finalizing inside compute and completing at its exit."""
    kinds = (K.ATTN, K.MOE) if terminal else (K.ATTN, K.MOE, K.ATTN, K.FFN)
    deferring = Hetero(kinds, 1, 4)
    completing = Hetero(kinds, 1, 4, fusions=bj.fusions.NO_FUSIONS)
    with jax.enable_x64(True):
        x, counts = _inputs(deferring, V.ORDINARY)
        run, stacks = _uncut(deferring).run, _uncut(deferring).stacks
        moe = stacks[0].stages[1].boundary.plan.path(V.ORDINARY)
        assert moe.exits[0].kind is bj.plan.ExitKind.HAND_FINALIZE
        assert (
            _uncut(completing).stacks[0].stages[1].boundary.plan.path(V.ORDINARY).exits[0].kind
            is not bj.plan.ExitKind.HAND_FINALIZE
        )
        want = _uncut(completing).run(x, counts, V.ORDINARY)
        assert _error(run(x, counts, V.ORDINARY), want) < 1e-12
        assert _error(want, _want(stacks, x, counts, 1)) < 1e-12


def _fused_finalize_norm(request: residual_stream.FinalizeRequest) -> jax.Array:
    """A stand-in fused service: finalize, sum, add and norm in one function."""
    value = jax.lax.psum(request.handoff.complete(), request.axis_names)
    return request.norm(request.residual + value)


def test_final_norm_takes_a_finalize_through_its_service():
    """final_norm(finalize_norm=...) receives the terminal MoE's handoff and equals the unfused
    final norm."""
    model = Hetero((K.ATTN, K.FFN, K.ATTN, K.MOE), 1, 4)
    calls = []

    def service(request):
        calls.append(request)
        return _fused_finalize_norm(request)

    with jax.enable_x64(True):
        x, counts = _inputs(model, V.ORDINARY)
        fused = build(model, None, finalize_norm=service).run(x, counts, V.ORDINARY)
        want = _uncut(model).run(x, counts, V.ORDINARY)
    assert calls and isinstance(calls[0].handoff, bj.DeferredFinalize)
    assert _error(fused, want) < 1e-12


def test_a_sum_before_a_finalize_is_rejected():
    """No sum or row move runs on an unfinalized value: the steps refuse at binding."""
    owed = bj.plan.Placement(Layout(), (bj.TokenAxis.ATTN_TP,), finalize=True)
    for step in (
        ops.AllReduce((bj.TokenAxis.ATTN_TP,), bj.Topology(attn_tp=2)),
        ops.ReduceScatter((bj.TokenAxis.ATTN_TP,), bj.Topology(attn_tp=2)),
    ):
        with pytest.raises(bj.PlanError, match="unfinalized"):
            ops.simulate((step, ops.Finalize()), owed)
    assert ops.complete_onto(owed, Layout(), bj.Topology(attn_tp=2))[0] == ops.Finalize()


MUTANTS = {
    "skip": {
        ops.AllReduce: lambda original, step, x: x,
        ops.ReduceScatter: lambda original, step, x: ops.TakeBlock(step.axes, step.topology)(x),
        ops.AllGather: lambda original, step, x: jnp.concatenate(
            [x] * (original(step, x).shape[0] // x.shape[0])
        ),
        ops.TakeBlock: lambda original, step, x: x[: x.shape[0] // step.parts],
        ops.Finalize: lambda original, step, x: x.expert_outputs.sum(axis=1),
    },
    # A norm follows many steps and hides a scaled value, so rows move instead of scaling.
    "double or misplace": {
        ops.AllReduce: lambda original, step, x: 2 * original(step, x),
        ops.ReduceScatter: lambda original, step, x: 2 * original(step, x),
        ops.AllGather: lambda original, step, x: jnp.roll(original(step, x), x.shape[0], axis=0),
        ops.TakeBlock: lambda original, step, x: original(
            step, jnp.roll(x, -x.shape[0] // step.parts, axis=0)
        ),
        ops.Finalize: lambda original, step, x: bj.DeferredFinalize(
            x.expert_outputs * x.weights[..., None], x.weights
        ).complete(),
    },
}
MUTANT_MODELS = [
    (Hetero((K.ATTN, K.MOE, K.ATTN, K.FFN_DP), 1, 4), V.ORDINARY, 2),
    (Hetero((K.ATTN, K.FFN, K.ATTN, K.MOE), 2, 2), V.INPUT_SCATTERED, None),
    (Hetero((K.ATTN, K.FFN, K.MIXER, K.FFN), 2, 2, policy=bj.ReductionPolicy.RS), V.ORDINARY, 3),
]


def _calls(monkeypatch, built: Built, variant):
    """Every step call one trace of `built` runs, in order."""
    calls = []
    for step_class in MUTANTS["skip"]:
        original = step_class.__call__

        def recorder(step, x, original=original):
            calls.append(type(step))
            return original(step, x)

        monkeypatch.setattr(step_class, "__call__", recorder)
    with jax.enable_x64(True):
        x, counts = _inputs(built.model, variant, "even")
        built.retraced().run(x, counts, variant)
    monkeypatch.undo()
    return calls


def test_the_mutant_models_run_every_kind_of_step(monkeypatch):
    """Together the mutant models run every sum, gather, slice and finalize kind."""
    kinds = set()
    for model, variant, cut in MUTANT_MODELS:
        with jax.enable_x64(True):
            built = build(model, cut, check_vma=False)
        kinds |= set(_calls(monkeypatch, built, variant))
    assert kinds == set(MUTANTS["skip"])


@pytest.mark.parametrize("index", range(len(MUTANT_MODELS)))
def test_a_mutant_at_any_sum_gather_slice_or_finalize_is_caught(monkeypatch, index):
    """Skipping, doubling or misplacing the n-th collective, slice or finalize of a path, for
    every n, makes the output differ from the reference (or fail to run)."""
    model, variant, cut = MUTANT_MODELS[index]
    with jax.enable_x64(True):
        built = build(model, cut, check_vma=False)
    calls = _calls(monkeypatch, built, variant)
    assert {ops.AllReduce, ops.ReduceScatter} & set(calls) and ops.AllGather in calls
    with jax.enable_x64(True):
        # Every row is a real token: a wrong slice cannot hide in padding rows.
        x, counts = _inputs(model, variant, "even")
        want = _uncut(model).run(x, counts, variant)
    caught = 0
    for name, mutants in MUTANTS.items():
        for position, step_class in enumerate(calls):
            mutate, original = mutants[step_class], step_class.__call__
            nth = calls[: position + 1].count(step_class)
            seen = []

            def patched(step, x, mutate=mutate, original=original, seen=seen, nth=nth):
                seen.append(step)
                return mutate(original, step, x) if len(seen) == nth else original(step, x)

            monkeypatch.setattr(step_class, "__call__", patched)
            try:
                with jax.enable_x64(True):
                    got = built.retraced().run(x, counts, variant)
                error = _error(got, want)
            except (ValueError, TypeError):
                error = np.inf
            monkeypatch.undo()
            assert error > 1e-6, f"{name} of call {position} ({step_class.__name__}) not caught"
            caught += 1
    print(f"\n{caught} mutants caught over {len(calls)} step calls")


# The five defects `pr-keep-rows-and-sums-consistent-across-pipeline` fixed, one regression each:
# (kinds, dp, tp, variant, policy, cut).
DEFECTS = {
    "an append after an always-partial attention slices the residual once": (
        (K.ATTN, K.MOE_OWN, K.ATTN, K.FFN),
        1,
        4,
        V.ORDINARY,
        bj.ReductionPolicy.RS_RSV,
        2,
    ),
    "a stack ending on attention after an FFN on its own rows leaves on the attention's rows": (
        (K.ATTN, K.FFN_DP, K.ATTN, K.FFN),
        2,
        2,
        V.ORDINARY,
        bj.ReductionPolicy.RS_RSV,
        3,
    ),
    "a later rank takes an input-scattered batch from its facts, not from a handle": (
        (K.ATTN, K.FFN, K.ATTN, K.FFN),
        1,
        2,
        V.INPUT_SCATTERED,
        bj.ReductionPolicy.RS,
        2,
    ),
    "the FFN before a handoff keeps one set of rows after a fully data-parallel FFN": (
        (K.ATTN, K.FFN_DP, K.ATTN, K.FFN, K.ATTN, K.FFN),
        2,
        2,
        V.ORDINARY,
        bj.ReductionPolicy.AR,
        4,
    ),
    "to_pp completes a mixer's declared partial sum before the handoff": (
        (K.MIXER, K.FFN, K.ATTN, K.FFN),
        1,
        2,
        V.INPUT_SCATTERED,
        bj.ReductionPolicy.AR,
        1,
    ),
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_a_pipeline_defect_of_the_original_stays_fixed(defect):
    """Each defect's stack binds, the receiver sums nothing, and the cut run equals the float64
    single-device reference on a small ragged batch."""
    kinds, dp, tp, variant, policy, cut = DEFECTS[defect]
    model = Hetero(kinds, dp, tp, policy)
    with jax.enable_x64(True):
        x, counts = _inputs(model, variant)
        built = build(model, cut)
        run, stacks = built.run, built.stacks
        receiver = stacks[1].stages[0].boundary.plan.path(variant)
        (transport_entry,) = [e for e in receiver.entries if e.transport]
        assert not transport_entry.fused_sum
        assert not any(
            isinstance(s, ops.AllReduce | ops.ReduceScatter) for s in transport_entry.complete
        )
        assert _error(run(x, counts, variant), _want(stacks, x, counts, dp)) < 1e-12
