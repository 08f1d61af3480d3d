"""Nemotron-H's single-stage layers on boundaries, with stand-in compute
(`tests/boundary_jax/hetero.py`): every hybrid pattern of up to four layers over {M, *, -, E}
binds the guide's MixerExit decisions; a covering set of patterns, holding every stage context
those patterns have, equals one device in float64 with per-rank different weights; the
decisions show in the compiled HLO as docs/collectives.md lists them."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import boundary_jax as bj
from boundary_jax import bind as binding
from models.config import HybridLayer, parse_pattern
from models.families.nemotron_h import hybrid_stage
from tests.boundary_jax.hetero import DEFERS, Hetero, Kind, build, build_many, declare, reference
from tests.boundary_jax.standin import HIDDEN, ROWS, count_patterns

P = bj.ReductionPolicy
E = bj.plan.ExitKind
STAND_INS = {
    HybridLayer.MAMBA2: Kind.MIXER,
    HybridLayer.ATTENTION: Kind.MIXER,
    HybridLayer.MLP: Kind.FFN,
    HybridLayer.MOE: Kind.MOE,
}
"""The stand-in of each hybrid layer: same declaration, stand-in compute."""
PATTERNS = tuple("".join(p) for n in range(1, 5) for p in itertools.product("M*-E", repeat=n))
"""Every hybrid pattern of one to four layers (340)."""
BOUNDARY_PATTERNS = tuple(p for p in PATTERNS if "*" not in p)
"""The patterns as the boundaries see them (120): attention declares as Mamba2 does
(`test_the_stand_ins_declare_what_the_hybrid_layers_declare`), so a pattern with `*` binds
what the same pattern with `M` binds."""
COVER = (
    "M*M-",
    "*-M",
    "-M*E",
    "ME*",
    "E*--",
    "--M-E",
    "-E*E-",
    "E-MEE",
    "EE---E-EEEM*",
    "M",
    "*",
    "-",
    "E",
)
"""Patterns holding every stage context of `PATTERNS` (a stage's context is its own kind and
its neighbours', or the stack's ends): built from a de Bruijn sequence of the mixer / MLP / MoE
triples, cut so that every pair of kinds starts one pattern and ends one."""
SLOW = (pytest.mark.slow,)
# (attn_dp, attn_tp, policy, marks): at attention DP 1 the policies bind the same paths. The
# slow ones repeat what a faster one shows (every pattern binds them as the cover does, and the
# documented collectives compile them: TP 2 the paths of TP 4, ar's at DP 2 x TP 2; TP 1 runs no
# collective).
CONFIGS = [
    pytest.param(dp, tp, policy, id=f"dp{dp}-tp{tp}-{policy.value}", marks=marks)
    for dp, tp, policy, marks in (
        (2, 2, P.RS_RSV, ()),
        (1, 4, P.RS_RSV, SLOW),
        (2, 2, P.AR, SLOW),
        (1, 2, P.RS_RSV, SLOW),
        (1, 1, P.RS_RSV, SLOW),
    )
]
BINDING_CONFIGS = [
    pytest.param(dp, tp, policy, id=f"dp{dp}-tp{tp}-{policy.value}")
    for dp, tp, policy in ((2, 2, P.RS_RSV), (2, 2, P.AR), (1, 4, P.RS_RSV))
]


def kinds(pattern: str) -> tuple[Kind, ...]:
    return tuple(STAND_INS[layer] for layer in parse_pattern(pattern))


def contexts(pattern: str) -> list[tuple[str, str, str]]:
    """Each stage's (previous, own, next) kind: `^` the stack entry, `$` its exit; Mamba2 and
    attention are the one mixer kind `X` (they declare alike)."""
    letters = ["^", *("X" if c in "M*" else c for c in pattern), "$"]
    return [tuple(letters[i : i + 3]) for i in range(len(pattern))]


def test_the_stand_ins_declare_what_the_hybrid_layers_declare():
    """Each stand-in kind's declaration is its hybrid layer's, and Mamba2 and attention declare
    alike: so a stand-in stack binds the paths the hybrid model binds."""
    for layer, kind in STAND_INS.items():
        assert hybrid_stage(layer).facts() == declare(kind).facts(), layer
    assert hybrid_stage(HybridLayer.MAMBA2) == hybrid_stage(HybridLayer.ATTENTION)


def test_the_cover_holds_every_context_of_every_pattern():
    """Every (previous, own, next) stage context of the 340 patterns occurs in `COVER`."""
    covered = {context for pattern in COVER for context in contexts(pattern)}
    needed = {context for pattern in PATTERNS for context in contexts(pattern)}
    assert needed <= covered and len(needed) == 48


def bind(pattern: str, dp: int, tp: int, policy: bj.ReductionPolicy) -> list[bj.plan.StagePlan]:
    """The plans of `pattern`'s stages, bound without parameters (as the stand-in stack and
    the model bind them: the embedding's attention-TP sum owed to the first stage)."""
    declared = [declare(kind) for kind in kinds(pattern)]
    with bj.layer_stack(
        bj.Topology(attn_dp=dp, attn_tp=tp),
        reduction=policy,
        input_sum=bj.SumGroup.ATTN_TP,
        fusions=DEFERS,
        stage_facts=lambda i: (declare(kinds(pattern)[i]),),
        num_layers=len(pattern),
    ):
        boundaries = [bj.append_stages((d, None))[0] for d in declared]
    return [boundary.plan for boundary in boundaries]


def mixer_exit(following: str, dp: int, tp: int) -> bj.plan.ExitKind:
    """The guide's MixerExit for a mixer whose consumer is `following` (`$`: the final read):
    before an FFN it leaves its sum to the FFN's input, under attention DP too; before a mixer
    it leaves it without attention DP and completes it with; at the stack's end it completes it."""
    if tp == 1:
        return E.MOVE_COMPLETE
    if following == "$":
        return E.ALL_REDUCE
    if following in "-E" or dp == 1:
        return E.LEAVE_TO_NEXT_INPUT
    return E.ALL_REDUCE


@pytest.mark.parametrize("dp,tp,policy", BINDING_CONFIGS)
def test_every_pattern_binds_the_mixer_exit_and_the_cover_plans(dp, tp, policy):
    """In every pattern, each mixer's first exit option is the guide's MixerExit decision, and
    every stage binds the ordinary batch's path its context binds in `COVER` (so the cover's
    numerical check holds for the pattern; a pattern without a mixer also binds the
    input-scattered variant, which the hybrid model does not run)."""

    def ordinary(plan: bj.plan.StagePlan) -> tuple:
        return plan.declaration, plan.path(bj.BatchVariant.ORDINARY)

    by_context = {}
    for pattern in COVER:
        for context, plan in zip(contexts(pattern), bind(pattern, dp, tp, policy), strict=True):
            by_context[context] = ordinary(plan)
    deferred = 0
    for pattern in BOUNDARY_PATTERNS:
        plans = bind(pattern, dp, tp, policy)
        for (before, own, after), plan in zip(contexts(pattern), plans, strict=True):
            want = by_context[before, own, after]
            assert ordinary(plan) == want, (pattern, before, own, after)
            first = plan.path(bj.BatchVariant.ORDINARY).exits[0]
            if own == "X":
                assert first.kind is mixer_exit(after, dp, tp), (pattern, own, after)
            deferred += first.kind is E.HAND_FINALIZE
    # a MoE hands its finalize on without attention DP only
    assert deferred == (0 if dp > 1 else sum(p.count("E") for p in BOUNDARY_PATTERNS))


@functools.cache
def cover_program(dp: int, tp: int, policy: bj.ReductionPolicy):
    return build_many(tuple(Hetero(kinds(p), dp, tp, policy) for p in COVER))


def one_device(stack, x: jax.Array, counts: np.ndarray, dp: int) -> jax.Array:
    """The stand-in stack on one device, zero on padding rows."""
    valid = (np.arange(x.shape[0] // dp)[None, :] < counts[:, None]).reshape(-1)
    return jnp.where(valid[:, None], reference([stack], jnp.where(valid[:, None], x, 0), dp), 0)


@pytest.mark.parametrize("dp,tp,policy", CONFIGS)
def test_the_cover_equals_one_device(dp, tp, policy):
    """Every pattern of `COVER`, sharded with per-rank different weights and input shares and
    ragged token counts, equals its float64 single-device stand-in within 1e-12."""
    built = cover_program(dp, tp, policy)
    counts = count_patterns(dp, ROWS)["ragged"]
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(5), (dp * ROWS, HIDDEN), jnp.float64)
        got = built.run(x, counts)
        for pattern, stack, out in zip(COVER, built.stacks, got, strict=True):
            want = one_device(stack, x, counts, dp)
            error = float(jnp.max(jnp.abs(out - want)) / jnp.max(jnp.abs(want)))
            assert error < 1e-12, pattern


# --------------------------------------------------------------------------------------------
# The MixerExit decisions in the compiled HLO (docs/collectives.md, "Single-stage mixers")
# --------------------------------------------------------------------------------------------

TABLE = pathlib.Path(__file__).parents[3] / "docs" / "collectives.md"
NAMES = {"AR": "all-reduce", "RS": "reduce-scatter", "AG": "all-gather"}


def documented_rows() -> list[dict[str, str]]:
    """The rows of the "Single-stage mixers" table."""
    section = TABLE.read_text().split("## Single-stage mixers", 1)[1].split("\n## ", 1)[0]
    table = "| pattern |" + section.split("\n| pattern |", 1)[1].split("\n\n", 1)[0]
    lines = table.splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[2:]
    ]


@pytest.mark.parametrize(
    "row", documented_rows(), ids=lambda row: f"{row['pattern']}-{row['dp']}x{row['tp']}"
)
def test_each_mixer_exit_runs_the_documented_collectives(row):
    """Each layer of the table's hybrid stacks runs exactly its row's collectives in the
    compiled program (its entry, then its exit), and the final read its cell."""
    pattern, dp, tp = row["pattern"], int(row["dp"]), int(row["tp"])
    model = Hetero(kinds(pattern), dp, tp, P.parse(row["policy"]))
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(5), (dp * ROWS, HIDDEN), jnp.float64)
        report = build(model, None).report(x, np.full(dp, ROWS), bj.BatchVariant.ORDINARY)

    def names(cell: str) -> tuple[str, ...]:
        return tuple(NAMES[kind] for kind in cell.split() if kind != "–")

    for index in range(len(pattern)):
        assert report.sequence(index) == names(row[f"layer {index}"]), f"layer {index}"
    assert report.sequence(None) == names(row["final read"])


# --------------------------------------------------------------------------------------------
# Mutants of the boundaries a hybrid stack runs
# --------------------------------------------------------------------------------------------


def _is_mixer(declaration: bj.StageDeclaration) -> bool:
    return (
        declaration.kind is bj.declare.StageKind.ATTN
        and declaration.reduction is bj.ProducerReduction.EXIT_SCOPED
    )


def _rewrite_exits(monkeypatch, rewrite) -> None:
    """Binds every stage (and its consumer's entries) with `rewrite(declaration, outgoing, stack,
    rows, fusions, option)` in place of each of its exit options."""
    honest = binding.exit_options

    def mutated(declaration, outgoing, variant, stack, rows, fusions, *, fold=True):
        options = honest(declaration, outgoing, variant, stack, rows, fusions, fold=fold)
        return tuple(rewrite(declaration, outgoing, stack, rows, fusions, o) for o in options)

    monkeypatch.setattr(binding, "exit_options", mutated)


def _handing_on(option, placement: bj.plan.Placement, rows, stack, steps=None):
    work = binding.owed_work(placement, rows.residual, stack.topology)
    steps = option.steps if steps is None else steps
    return dataclasses.replace(option, handoff=placement, work=work, steps=steps)


def mixer_drops_its_sum(monkeypatch):
    """The mixer not handing on its sum: it leaves the sum to the next input but hands on the
    output as complete."""

    def rewrite(declaration, outgoing, stack, rows, fusions, option):
        if _is_mixer(declaration) and option.kind is E.LEAVE_TO_NEXT_INPUT:
            return _handing_on(option, option.handoff.completed(), rows, stack)
        return option

    _rewrite_exits(monkeypatch, rewrite)


def mixer_sums_twice(monkeypatch):
    """A mixer before a mixer under attention DP completing its sum at its exit and handing it
    on as still owed (summed again by the next input)."""

    def rewrite(declaration, outgoing, stack, rows, fusions, option):
        if _is_mixer(declaration) and option.kind is E.ALL_REDUCE:
            owed = bj.plan.Placement(rows.compute, option.output.owed)
            if outgoing.kind is bj.declare.EdgeKind.NEXT_STAGE:
                return _handing_on(option, owed, rows, stack)
        return option

    _rewrite_exits(monkeypatch, rewrite)


def ffn_sums_before_a_mixer(monkeypatch):
    """The FFN not leaving its sum to the mixer after it: it runs its all-reduce and still hands
    the sum on."""

    def rewrite(declaration, outgoing, stack, rows, fusions, option):
        mixer_next = outgoing.kind is bj.declare.EdgeKind.NEXT_STAGE and _is_mixer(
            outgoing.consumer
        )
        leaves = option.kind is E.LEAVE_TO_NEXT_INPUT
        if declaration.kind is bj.declare.StageKind.FFN and mixer_next and leaves:
            steps = bj.ops.all_reduce(option.output.owed, stack.topology)
            return _handing_on(option, option.handoff, rows, stack, steps)
        return option

    _rewrite_exits(monkeypatch, rewrite)


def mixer_carries_under_dp(monkeypatch):
    """A mixer before a mixer carrying its sum to that mixer's input under attention DP (the
    guide's MixerExit completes it there): consistent on both sides, so the values hold; the
    plan and the compiled collectives show it."""

    def rewrite(declaration, outgoing, stack, rows, fusions, option):
        consumer = outgoing.consumer
        to_mixer = outgoing.kind is bj.declare.EdgeKind.NEXT_STAGE and _is_mixer(consumer)
        if _is_mixer(declaration) and to_mixer and option.kind is E.ALL_REDUCE:
            owed = bj.plan.Placement(rows.compute, option.output.owed)
            leave = binding._leave(declaration, outgoing, stack, fusions, owed, rows.residual, None)
            carried = _handing_on(option, owed, rows, stack, ())
            return dataclasses.replace(carried, kind=E.LEAVE_TO_NEXT_INPUT, leave=leave)
        return option

    _rewrite_exits(monkeypatch, rewrite)


def entry_skips_the_sum(monkeypatch):
    """The next input adding a handed-on output to the residual without completing its sum (the
    all-reduce fused with its add + norm dropped)."""
    honest = binding._entry

    def mutated(handoff, **keywords):
        return dataclasses.replace(honest(handoff, **keywords), fused_sum=())

    monkeypatch.setattr(binding, "_entry", mutated)


def stack_start_skips_the_embedding_sum(monkeypatch):
    """An FFN at the stack's start reading the embedding's partial sum as its input (the stack
    entry's completion dropped)."""
    honest = binding._entry

    def mutated(handoff, *, initial, **keywords):
        path = honest(handoff, initial=initial, **keywords)
        return dataclasses.replace(path, complete=()) if initial else path

    monkeypatch.setattr(binding, "_entry", mutated)


NUMERIC_MUTANTS = {
    "the mixer not handing on its sum": (mixer_drops_its_sum, "MM-M", 1, 4),
    "the mixer summing twice under attention DP": (mixer_sums_twice, "MM-M", 2, 2),
    "the FFN not leaving its sum to a mixer": (ffn_sums_before_a_mixer, "M-M*", 1, 4),
    "an input not completing the sum it is handed": (entry_skips_the_sum, "*-EM", 1, 4),
    "an FFN at the stack start read before its sum": (
        stack_start_skips_the_embedding_sum,
        "-EM",
        2,
        2,
    ),
}


@pytest.mark.parametrize("mutant", NUMERIC_MUTANTS)
def test_a_boundary_mutant_is_caught(monkeypatch, mutant):
    """Each mutant's stack either fails binding's own check (a step that does not bring the
    value where its plan says) or, with that check off, runs values that differ from one
    device."""
    mutate, pattern, dp, tp = NUMERIC_MUTANTS[mutant]
    mutate(monkeypatch)
    model = Hetero(kinds(pattern), dp, tp)
    try:
        with jax.enable_x64(True):
            build(model, None)
        caught_at_binding = False
    except bj.PlanError:
        caught_at_binding = True
    monkeypatch.setattr(bj.stack, "check_plan", lambda plan: None)
    counts = count_patterns(dp, ROWS)["even"]
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(5), (dp * ROWS, HIDDEN), jnp.float64)
        built = build(model, None, check_vma=False)
        got = built.run(x, counts, bj.BatchVariant.ORDINARY)
        want = one_device(built.stacks[0], x, counts, dp)
        error = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert error > 1e-6, f"{mutant}: values unchanged ({caught_at_binding=})"


def test_a_mixer_carrying_its_sum_under_attention_dp_shows_in_plan_and_hlo(monkeypatch):
    """The MixerExit mutant that stays consistent (a mixer before a mixer carrying its sum under
    attention DP) keeps the values but breaks the plan rule and the documented collectives."""
    mixer_carries_under_dp(monkeypatch)
    plans = bind("MM-M", 2, 2, P.RS_RSV)
    kind = plans[0].path(bj.BatchVariant.ORDINARY).exits[0].kind
    assert kind is not mixer_exit("M", 2, 2)
    row = next(r for r in documented_rows() if (r["pattern"], r["dp"]) == ("MM-M", "2"))
    with pytest.raises(AssertionError, match="layer 0"):
        test_each_mixer_exit_runs_the_documented_collectives(row)


def test_a_layer_outside_a_started_stream_is_refused():
    """A hybrid stack run without `residual.start` (the stack never entered) raises."""
    built = build(Hetero(kinds("M-"), 1, 2), None)
    with pytest.raises(RuntimeError, match="start the layer stack"):
        built.stacks[0].run(jnp.zeros((ROWS, HIDDEN)), None)
