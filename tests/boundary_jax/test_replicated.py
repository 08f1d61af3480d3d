"""Replicated parts of a stage's output (a row-parallel projection's bias, a shared expert with
its own TP size 1) are counted once on every mesh, and the deferral rule decides where such an
FFN's all-reduce runs."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import boundary_jax as bj
from boundary_jax.declare import Replicated
from boundary_jax.plan import ExitKind

from .cases import SWEEP_MESHES
from .replicated import O_BIAS, SHARED, RepSetup, compiled
from .standin import HIDDEN, ROWS, count_patterns

TABLE = pathlib.Path(__file__).parents[2] / "docs" / "collectives.md"
NAMES = {"AR": "all-reduce", "RS": "reduce-scatter", "AG": "all-gather"}


def _relative_error(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _check(case) -> None:
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(7), (case.setup.dp * ROWS, HIDDEN), jnp.float64)
        for name, counts in count_patterns(case.setup.dp).items():
            got = case.run(x, counts)
            assert _relative_error(got, case.reference(x, counts)) < 1e-12, name


MATRIX = [
    pytest.param(
        dp,
        tp,
        scattered,
        ffn,
        id=f"dp{dp}-tp{tp}-{ffn}-{'scattered' if scattered else 'ordinary'}",
        marks=[]
        if (ffn == "full-tp" and not scattered) or (dp, tp) == (2, 2)
        else [pytest.mark.slow],
    )
    for dp, tp in SWEEP_MESHES
    for scattered in ((False, True) if tp > 1 else (False,))
    for ffn in ("full-tp", "own-rows")
]


@pytest.mark.parametrize("dp,tp,scattered,ffn", MATRIX)
def test_replicated_parts_are_counted_once(dp, tp, scattered, ffn):
    """A bias on the attention's row-parallel projection and a shared expert every rank computes
    whole are added once per token on every mesh of the stand-in matrix (FFN over the full TP
    group, or on its own rows, where every rank adds its own rows' share): equal to the float64
    single-device reference for even, ragged and idle DP ranks."""
    _check(compiled(RepSetup(dp=dp, tp=tp, ffn=ffn), scattered))


def test_a_part_added_on_every_rank_is_caught(monkeypatch):
    """The mutant that adds the replicated parts on every rank (the sum counts them per rank)
    is caught by the reference comparison."""
    monkeypatch.setattr(bj.ops, "is_first_rank", lambda ranks: True)
    case = compiled(dataclasses.replace(RepSetup(dp=2, tp=2), layers=2), False)
    compiled.cache_clear()  # the mutant's program is not shared
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(7), (2 * ROWS, HIDDEN), jnp.float64)
        counts = count_patterns(2)["even"]
        assert _relative_error(case.run(x, counts), case.reference(x, counts)) > 1e-3


def test_the_plan_says_where_each_part_is_added():
    """The bound plan names the ranks that add each part: the first of the sum's mesh axes, or
    every rank on an FFN's own rows."""
    full = compiled(RepSetup(dp=2, tp=2), False).model.layers[0]
    assert full.attn_boundary.plan.counted_once[0].ranks == ("attn_tp",)
    assert full.ffn_boundary.plan.counted_once[0].ranks == ("attn_dp", "attn_tp")
    own = compiled(RepSetup(dp=2, tp=2, ffn="own-rows"), False).model.layers[0]
    assert own.ffn_boundary.plan.counted_once[0].describe().startswith("added on every rank")
    described = bj.report.describe_stages(
        [(0, "ffn", full.ffn_boundary.plan)], bj.BatchVariant.ORDINARY
    )
    assert described[0]["replicated"] == {
        SHARED: "added on the first rank of attn_dp x attn_tp only"
    }


def test_replicated_parts_are_checked_when_declared_and_asked():
    """Two parts of one name, a part on a stage that sums its own output without naming the
    group compute sums it over, and a part the stage does not declare are refused."""
    with pytest.raises(ValueError, match="its own name"):
        bj.declare_ffn(replicated=(Replicated("a"), Replicated("a")))
    with pytest.raises(ValueError, match="output_complete=True: compute sums"):
        bj.declare_ffn(output_complete=True, replicated=(Replicated("a"),))
    bj.declare_ffn(output_complete=True, replicated=(Replicated("a", bj.SumGroup.MOE_TP),))
    with pytest.raises(TypeError, match="tuple of Replicated"):
        bj.declare_ffn(replicated=("bias",))
    layer = compiled(RepSetup(dp=1, tp=4), False).model.layers[0]
    batch = bj.BatchFacts.ordinary(layer.attn_boundary.plan.topology, [ROWS], rows_per_block=ROWS)
    stream = bj.residual_stream.start(batch)
    with pytest.raises(ValueError, match=f"declares no replicated part 'bias'.*{O_BIAS}"):
        layer.attn_boundary.counts("bias", stream)


@dataclasses.dataclass(frozen=True)
class Deferral(bj.fusions.FusionProvider):
    """Defers the all-reduce of an FFN with replicated parts only for batches of at most
    `limit` local rows."""

    limit: int = 0

    def can_defer_all_reduce(self, batch, rows):
        return rows <= self.limit


DEFERS = bj.fusions.FusionProvider(defer_all_reduce=True)
DEFERRAL = {
    "no provider": RepSetup(dp=1, tp=4, policy=bj.ReductionPolicy.AR),
    "provider defers": RepSetup(dp=1, tp=4, policy=bj.ReductionPolicy.AR, fusions=DEFERS),
    "provider declines the batch": RepSetup(
        dp=1,
        tp=4,
        policy=bj.ReductionPolicy.AR,
        fusions=Deferral(defer_all_reduce=True, limit=ROWS - 1),
    ),
    "sum over attention TP only": RepSetup(
        dp=2, tp=2, policy=bj.ReductionPolicy.AR, ffn="attn-tp", fusions=DEFERS
    ),
}


def _deferral_rows() -> dict[str, dict[str, str]]:
    text = TABLE.read_text().split("## Replicated parts", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[2:]
    ]
    return {row["case"]: row for row in rows}


@pytest.mark.parametrize("name", list(DEFERRAL))
def test_the_deferral_rule_binds_and_runs_each_case(name):
    """An FFN with replicated parts leaves its all-reduce to the next input only where the rule
    lets it (a sum over the whole TP group, a provider that defers and accepts the batch); each
    case equals the reference and runs the collectives docs/collectives.md lists per layer."""
    setup = DEFERRAL[name]
    case = compiled(setup, False)
    row = _deferral_rows()[name]
    middle = case.model.layers[0].ffn_boundary
    bound = [option.kind for option in middle.plan.path(bj.BatchVariant.ORDINARY).exits]
    defers = ExitKind.LEAVE_TO_NEXT_INPUT in bound
    assert defers == (row["binds deferral"] == "yes")
    _check(case)
    for index in range(setup.layers):
        want = tuple(NAMES[kind] for kind in row[f"layer {index}"].split() if kind != "–")
        assert case.report.sequence(index) == want, f"layer {index}"


class SummingProjection(nnx.Module, bj.ops.ReducingModule):
    """A projection that sums its own result over attention TP (`reduce_results=True`)."""

    def __init__(self, reduce_results: bool):
        self.reduce_results = reduce_results

    @property
    def reduces_output(self) -> bool:
        return self.reduce_results


class LayerWithProjection(nnx.Module):
    def __init__(self, reduce_results: bool, ffn: bj.StageDeclaration):
        self.norm = bj.RMSNorm(HIDDEN)
        self.proj = SummingProjection(reduce_results)
        self.attn_boundary, self.ffn_boundary = bj.append_stages(
            (bj.declare_attn(), self.norm), (ffn, self.norm), owner=self
        )


def test_a_module_that_sums_its_own_result_is_refused_when_built():
    """A layer holding a module that completes its own sum under a boundary fails when built,
    naming the module and the fix; the same module not reducing, or under a stage that declares
    output_complete, is built."""
    topology = bj.Topology(attn_tp=2)
    refused = r"module at proj \(SummingProjection\) sums its own"
    with pytest.raises(ValueError, match=refused), bj.layer_stack(topology):
        LayerWithProjection(True, bj.declare_ffn())
    with bj.layer_stack(topology):
        LayerWithProjection(False, bj.declare_ffn())
    with bj.layer_stack(topology):
        LayerWithProjection(True, bj.declare_ffn(output_complete=True))
