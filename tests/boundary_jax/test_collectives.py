"""The compiled HLO runs exactly the collectives docs/collectives.md documents, per layer."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import boundary_jax as bj
from boundary_jax.report import parse_hlo

from .branching import Branched, Part
from .branching import build as build_branched
from .cases import SWEEP, compiled
from .hetero import Hetero, Kind, build
from .standin import HIDDEN, ROWS, Setup

TABLE = pathlib.Path(__file__).parents[2] / "docs" / "collectives.md"
NAMES = {"AR": "all-reduce", "RS": "reduce-scatter", "AG": "all-gather"}
COLUMNS = ("stack entry", "attention input", "FFN input", "FFN exit", "last FFN exit")


def _documented() -> dict[tuple[str, str, str, str], dict[str, tuple[str, ...]]]:
    rows = {}
    dense = TABLE.read_text().split("## Heterogeneous stacks", 1)[0]
    lines = [line for line in dense.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for policy in cells["policy"].split(", "):
            key = (cells["dp"], cells["tp"], cells["batch"], policy)
            rows[key] = {
                column: tuple(NAMES[kind] for kind in cells[column].split() if kind != "–")
                for column in COLUMNS
            }
    return rows


DOCUMENTED = _documented()


def expected_layers(dp, tp, scattered, policy, layers):
    """Per-layer collective sequences the table composes for a stack of `layers` layers."""
    row = DOCUMENTED[
        (
            "1" if dp == 1 else ">1",
            "1" if tp == 1 else ">1",
            "input-scattered" if scattered else "ordinary",
            policy.value,
        )
    ]
    sequences = []
    for index in range(layers):
        entry = row["stack entry"] if index == 0 else row["attention input"]
        exit_ = row["last FFN exit"] if index == layers - 1 else row["FFN exit"]
        sequences.append(entry + row["FFN input"] + exit_)
    return sequences


def test_table_covers_every_configuration():
    """Every (dp, tp, batch, policy) class of the sweep has one documented row."""
    for param in SWEEP:
        dp, tp, _, policy, scattered = param.values
        expected_layers(dp, tp, scattered, policy, 1)


@pytest.mark.parametrize("dp,tp,layers,policy,scattered", SWEEP)
def test_each_layer_runs_the_documented_collectives(dp, tp, layers, policy, scattered):
    """Each layer's collectives, in program order, are the table's; none run outside layers."""
    report = compiled(Setup(dp=dp, tp=tp, layers=layers, policy=policy), scattered).report
    for index, want in enumerate(expected_layers(dp, tp, scattered, policy, layers)):
        assert report.sequence(index) == want, f"layer {index}"
    assert report.sequence(None) == ()
    assert report.layers == tuple(i for i in range(layers) if report.sequence(i))


@pytest.mark.xdist_group("core-2x2")
def test_report_counts_bytes_and_groups():
    """The report counts kinds per layer and the bytes of each buffer."""
    with jax.enable_x64(True):
        report = compiled(Setup(dp=2, tp=2, layers=2, policy=bj.ReductionPolicy.RS), False).report
    # layer 1: AR of one DP block (8 x 16 f64), AG over DP (16 rows), RS over DP x TP (16 rows),
    # AG over TP (8 rows)
    assert report.counts(1) == {
        "all-reduce": 1,
        "reduce-scatter": 1,
        "all-gather": 2,
        "all-to-all": 0,
        "collective-permute": 0,
    }
    assert report.bytes(1) == 8 * (8 * 16 + 16 * 16 + 16 * 16 + 8 * 16)
    assert [c.group_size for c in report.collectives if c.layer == 1] == [2, 2, 4, 2]


ASYNC_HLO = """
  %all-reduce-start = (bf16[4,4096]{1,0}, bf16[4,4096]{1,0}) all-reduce-start(bf16[4,4096]{1,0} %p), channel_id=1, replica_groups=[1,2]<=[2], metadata={op_name="jit(f)/shard_map/layer_3/psum"}
  %all-reduce-done = bf16[4,4096]{1,0} all-reduce-done(%all-reduce-start)
  %rs = f32[2,8]{1,0} reduce-scatter(f32[8,8]{1,0} %q), replica_groups={{0,1,2,3}}, dimensions={0}
  %ag = f32[8,8]{1,0} all-gather(f32[2,8]{1,0} %r), replica_groups=[2,4]<=[8], dimensions={0}, metadata={op_name="jit(f)/layer_0/all_gather"}
"""


def test_parse_hlo_reads_async_and_classic_group_forms():
    """Async starts count once; list and iota replica groups give the group size."""
    report = parse_hlo(ASYNC_HLO)
    assert report.sequence() == ("all-reduce", "reduce-scatter", "all-gather")
    assert [c.bytes for c in report.collectives] == [2 * 4 * 4096, 4 * 8 * 8, 4 * 8 * 8]
    assert [c.group_size for c in report.collectives] == [2, 4, 4]
    assert [c.layer for c in report.collectives] == [3, None, 0]


HETERO_KINDS = {
    "attn": "ATTN",
    "mixer": "MIXER",
    "ffn": "FFN",
    "ffn-dp": "FFN_DP",
    "moe": "MOE",
    "moe-own": "MOE_OWN",
}


def _hetero_rows():
    text = TABLE.read_text().split("## Heterogeneous stacks", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[2:]
    ]


@pytest.mark.parametrize(
    "row",
    _hetero_rows(),
    ids=lambda row: f"{row['stages']}-{row['dp']}x{row['tp']}-{row['batch']}-{row['finalize']}",
)
def test_heterogeneous_stacks_run_the_documented_collectives(row):
    """FFNs on their own rows and finalize handoffs run exactly the table's collectives."""
    kinds = tuple(Kind[HETERO_KINDS[name]] for name in row["stages"].split(", "))
    defer = row["finalize"] == "handed on"
    model = Hetero(
        kinds,
        int(row["dp"]),
        int(row["tp"]),
        bj.ReductionPolicy.parse(row["policy"]),
        fusions=bj.fusions.FusionProvider(defer_finalize=defer, terminal_finalize=defer),
    )
    variant = {"ordinary": bj.BatchVariant.ORDINARY, "unpadded": bj.BatchVariant.UNPADDED}[
        row["batch"]
    ]
    rows = ROWS + 1 if variant is bj.BatchVariant.UNPADDED else ROWS
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(5), (model.dp * rows, HIDDEN), jnp.float64)
        report = build(model, None).report(x, np.full(model.dp, rows), variant)

    def names(cell):
        return tuple(NAMES[kind] for kind in cell.split() if kind != "–")

    for index in range(len(kinds)):
        assert report.sequence(index) == names(row[f"layer {index}"]), f"layer {index}"
    assert report.sequence(None) == names(row["final read"])


BRANCH_LAYERS = {
    "attn, moe [ffn, attn, ffn]": (
        Part(Kind.ATTN),
        Part(Kind.MOE, (Kind.FFN, Kind.ATTN, Kind.FFN)),
    ),
    "attn [ffn], ffn [attn, ffn]": (
        Part(Kind.ATTN, (Kind.FFN,)),
        Part(Kind.FFN, (Kind.ATTN, Kind.FFN)),
    ),
}


def _branch_rows():
    text = TABLE.read_text().split("## Branches", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[2:]
    ]
    return [
        pytest.param(
            row,
            id=f"{row['layer']}-{row['dp']}x{row['tp']}-{row['policy']}-{row['finalize']}",
            marks=() if index < 3 else pytest.mark.slow,
        )
        for index, row in enumerate(rows)
    ]


@pytest.mark.parametrize("row", _branch_rows())
def test_branch_stacks_run_the_documented_collectives(row):
    """Stacks with branches run exactly the table's collectives: a branch's sum deferred to its
    source's completion where the merge allows, completed once before it otherwise."""
    defer = row["finalize"] == "handed on"
    layer = BRANCH_LAYERS[row["layer"]]
    model = Branched(
        (layer, layer),
        int(row["dp"]),
        int(row["tp"]),
        bj.ReductionPolicy.parse(row["policy"]),
        bj.fusions.FusionProvider(defer_finalize=defer, terminal_finalize=defer),
    )
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(5), (model.dp * ROWS, HIDDEN), jnp.float64)
        report = build_branched(model).report(x, np.full(model.dp, ROWS))

    def names(cell):
        return tuple(NAMES[kind] for kind in cell.split() if kind != "–")

    for index in range(2):
        assert report.sequence(index) == names(row[f"layer {index}"]), f"layer {index}"
    assert report.sequence(None) == names(row["final read"])
