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

from . import hetero
from .cases import SWEEP_MESHES
from .cases import compiled as standin_compiled
from .reads import (
    OFFERED,
    EveryRowRead,
    ReadSetup,
    compiled,
    declining_fusion,
    declining_gather,
    declining_read,
    gathering_norm,
    psum_add,
    psum_add_norm,
    psum_gather,
    reversed_gather,
    tiling_gather,
)
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
        marks=[]
        if (dp, tp) == (2, 2) or (dp, tp, scattered) == (1, 4, False)
        else [pytest.mark.slow],
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


GATHERS = {"own gather": psum_gather, "declining gather": declining_gather}


def _own_gathers(model, variant: bj.BatchVariant) -> int:
    """The gathers over attention TP that try a stage's own gather first, on the entries and
    exits a batch of `variant` runs (each primary entry, each first exit option)."""
    steps = []
    for layer in model.layers:
        for boundary in (layer.attn_boundary, layer.ffn_boundary):
            path = boundary.plan.path(variant)
            for entry in path.entries:
                if entry.primary:
                    steps += [*entry.residual_move, *entry.complete, *entry.move_input]
            steps += path.exits[0].steps
    return sum(isinstance(step, bj.ops.AllGather) and step.custom is not None for step in steps)


GATHER_MATRIX = [
    pytest.param(
        dp,
        tp,
        scattered,
        ffn,
        gather,
        id=f"dp{dp}-tp{tp}-{'scattered' if scattered else 'ordinary'}-{ffn}-{gather}",
        marks=[]
        if ((dp, tp, scattered, ffn) in {(1, 4, False, "own-rows"), (2, 2, True, "full-tp")})
        else [pytest.mark.slow],
    )
    for dp, tp in SWEEP_MESHES
    if tp > 1
    for scattered in (False, True)
    for ffn in ("own-rows", "full-tp")
    for gather in GATHERS
]


@pytest.mark.parametrize("dp,tp,scattered,ffn,gather", GATHER_MATRIX)
def test_a_stage_gathers_with_its_own_gather_first(dp, tp, scattered, ffn, gather):
    """An attention declaring its own gather over attention TP (`attn_tp_gather`) has it tried
    on every batch before the built-in one, at its entry (after an FFN on its own rows, in an
    input-scattered batch) and at its producer's exit (an FFN's reduce-scatter then gather
    back): equal to the float64 reference; where it gathers, each bound gather into the
    attention runs as an all-reduce in place of an all-gather in the compiled program; where it
    declines, the built-in all-gathers run."""
    policy = bj.ReductionPolicy.RS if ffn == "full-tp" else bj.ReductionPolicy.RS_RSV
    setup = ReadSetup(dp=dp, tp=tp, every_row=False, gather=GATHERS[gather], ffn=ffn, policy=policy)
    case = compiled(setup, scattered)
    assert max(_errors(case).values()) < 1e-12
    variant = bj.BatchVariant.INPUT_SCATTERED if scattered else bj.BatchVariant.ORDINARY
    bound = _own_gathers(case.model, variant)
    plain = compiled(dataclasses.replace(setup, gather=None), scattered).report

    def count(report, kind):
        return sum(c.kind == kind for c in report.collectives)

    replaced = count(plain, "all-gather") - count(case.report, "all-gather")
    assert count(case.report, "all-reduce") - count(plain, "all-reduce") == replaced
    if gather == "declining gather" or not bound:
        assert replaced == 0
    else:
        assert replaced > 0


def test_a_producer_across_a_pipeline_cut_runs_the_next_ranks_gather():
    """The FFN that ends a pipeline rank's layers binds its exit against the next rank's first
    stage, from `stage_facts`: its gather back over attention TP is that stage's own gather."""
    topology = bj.Topology(attn_dp=2, attn_tp=2)

    def stage_facts(index):
        del index
        return bj.declare_attn(attn_tp_gather=psum_gather), bj.declare_ffn()

    with bj.layer_stack(
        topology,
        reduction=bj.ReductionPolicy.RS,
        stage_facts=stage_facts,
        num_layers=2,
        layers=range(0, 1),
    ):
        _, ffn = bj.append_stages(*((d, None) for d in stage_facts(0)))
    assert ffn.plan.declaration.place.outgoing.kind is bj.declare.EdgeKind.PIPELINE_SEND
    exit = ffn.plan.path(bj.BatchVariant.ORDINARY).exits[0]
    assert exit.kind is bj.plan.ExitKind.REDUCE_SCATTER
    gathers = [step for step in exit.steps if isinstance(step, bj.ops.AllGather)]
    assert [step.custom for step in gathers] == [psum_gather]
    assert "the stage's own gather over attn_tp" in bj.report.describe_steps(exit.steps)


def test_only_a_mixer_or_attention_declares_its_own_gather():
    """An FFN's rows move by its declaration: `attn_tp_gather` on one is refused."""
    with pytest.raises(ValueError, match="attn_tp_gather is an attention or mixer fact"):
        bj.StageDeclaration(
            kind=bj.declare.StageKind.FFN,
            read=bj.designs.AddNormRead(),
            update=PlainAdd(),
            reduction=bj.ProducerReduction.EXIT_SCOPED,
            attn_tp_gather=psum_gather,
        )


FINAL_MATRIX = [
    pytest.param(
        dp,
        tp,
        scattered,
        ffn,
        final,
        id=f"dp{dp}-tp{tp}-{'scattered' if scattered else 'ordinary'}-{ffn}-{final}",
        marks=[]
        if (dp, tp, scattered) in {(1, 4, False), (2, 2, True)} and ffn == "own-rows"
        else [pytest.mark.slow],
    )
    for dp, tp in SWEEP_MESHES
    if tp > 1
    for scattered in (False, True)
    for ffn in ("own-rows", "full-tp")
    for final in ("slices", "slices+own gather", "own gather", "every row")
]
FINALS = {
    "slices": {"final_slices": True},
    "slices+own gather": {"final_slices": True, "final_gather": psum_gather},
    "own gather": {"final_gather": psum_gather},
    "every row": {"final_every_row": True},
}


@pytest.mark.parametrize("dp,tp,scattered,ffn,final", FINAL_MATRIX)
def test_a_final_read_that_is_more_than_a_norm(dp, tp, scattered, ffn, final):
    """A final read that reads this rank's attention-TP slice (`final_reads_attn_tp_slices`:
    the last FFN leaves its output there), one with its own gather over attention TP, and one
    that needs every row of the attention's equal the float64 reference; reading the slice,
    the last stage's exit no longer folds and gathers the residual."""
    setup = ReadSetup(dp=dp, tp=tp, every_row=False, ffn=ffn, **FINALS[final])
    case = compiled(setup, scattered)
    assert max(_errors(case).values()) < 1e-12
    variant = bj.BatchVariant.INPUT_SCATTERED if scattered else bj.BatchVariant.ORDINARY
    last = case.model.layers[-1].ffn_boundary.plan.path(variant)
    if setup.final_slices:
        assert all(option.fold_to is None for option in last.exits)


def test_a_skipped_or_misordered_final_gather_is_caught():
    """The mutant whose final read's gather skips its communication (each rank tiles its own
    slice) fails when traced (its output varies over attention TP), and one that gathers the
    slices in the wrong rank order moves the output away from the reference."""
    skipped = ReadSetup(dp=1, tp=4, every_row=False, final_slices=True, final_gather=tiling_gather)
    with pytest.raises(ValueError, match="varying"):
        compiled(skipped, False)
    reversed_ = dataclasses.replace(skipped, final_gather=reversed_gather)
    assert max(_errors(compiled(reversed_, False)).values()) > 1e-3


def test_a_final_read_of_every_row_cannot_read_a_slice():
    """A final read that needs every row of the attention's cannot also read this rank's
    slice: the stack refuses it when opened."""
    stack = bj.layer_stack(
        bj.Topology(attn_tp=2), final_read=EveryRowRead(), final_reads_attn_tp_slices=True
    )
    with pytest.raises(ValueError, match="cannot read this rank's attention-TP slice"), stack:
        pass


OWN_CANDIDATES = {
    "completing": ((psum_add,), (), ["completing"]),
    "declined then completing and reading": (
        (declining_fusion, psum_add_norm),
        (),
        ["declined", "completing and reading"],
    ),
    "declined": ((declining_fusion,), (), ["declined"]),
    "gathering": ((), (gathering_norm,), ["gathering"]),
    "declined gathering": ((), (declining_read,), ["declined"]),
}


@pytest.mark.parametrize("candidates", list(OWN_CANDIDATES))
@pytest.mark.parametrize("ffn", ["full-tp", "own-rows"])
def test_a_read_tries_its_own_fused_candidates_in_order(ffn, candidates):
    """A read's own candidates are tried in order, with fallback: `completing_fusions` where a
    sum is left for the attention's input (after an FFN over the whole TP group on TP 4),
    `gathering_reads` where it reads on this rank's slice and gathers (after an FFN on its own
    rows); each equals the float64 reference, and the trace ran exactly the candidates
    expected in each layer after the first (none where the entry offers none)."""
    completing, gathering, ran = OWN_CANDIDATES[candidates]
    policy = bj.ReductionPolicy.AR
    setup = ReadSetup(
        dp=1,
        tp=4,
        every_row=False,
        ffn=ffn,
        policy=policy,
        completing=completing,
        gathering=gathering,
    )
    OFFERED.clear()
    case = compiled(setup, False)
    offered = list(OFFERED)
    assert max(_errors(case).values()) < 1e-12
    applies = bool(completing) == (ffn == "full-tp")
    # Layers 1 and 2 enter after an FFN; layer 0's entry takes the stack input.
    assert offered == (ran * (setup.layers - 1) if applies else [])


def gather_on_attention(index: int) -> dict:
    """The stand-in model's declarations: the attention layers (even indices) gather with
    their own gather."""
    return {"attn_tp_gather": psum_gather} if index % 2 == 0 else {}


@pytest.mark.parametrize("cut", [None, 2], ids=["uncut", "cut"])
def test_an_own_gather_across_a_pipeline_cut_equals_one_device(cut):
    """Attention, FFN, attention, FFN on DP 2 x TP 2 under the scatter policy, the attentions
    declaring their own gather: cut before the second attention (to_pp, the simulated
    transport, from_pp), the first rank's last FFN runs the next rank's gather at its exit
    (from `stage_facts`), and the output equals the single-device reference and the uncut
    stack's for even, ragged and idle DP ranks."""
    model = hetero.Hetero(
        (hetero.Kind.ATTN, hetero.Kind.FFN) * 2,
        dp=2,
        tp=2,
        policy=bj.ReductionPolicy.RS,
        fusions=bj.fusions.NO_FUSIONS,
        design=gather_on_attention,
    )
    built = hetero.build(model, cut)
    sender = built.stacks[0].stages[1].boundary.plan.path(bj.BatchVariant.ORDINARY)
    gathers = [s for s in sender.exits[0].steps if isinstance(s, bj.ops.AllGather)]
    assert [step.custom for step in gathers] == [psum_gather]
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(5), (2 * ROWS, HIDDEN), jnp.float64)
        want = hetero.reference(built.stacks, x, 2)
        for name, counts in count_patterns(2).items():
            got = built.run(x, counts, bj.BatchVariant.ORDINARY)
            keep = (jnp.arange(ROWS)[None, :] < jnp.asarray(counts)[:, None]).reshape(-1)
            masked = jnp.where(keep[:, None], want, 0)
            assert _relative_error(got, masked) < 1e-12, name
