"""The compiled CP prefill, decode step and training step run, in their middle layer, the
collectives docs/collectives.md ("Context parallelism") documents, in each attention mode."""

from __future__ import annotations

import collections
import dataclasses
import functools
import pathlib

import jax
import numpy as np
import optax
import pytest

import boundary_jax as bj
from boundary_jax.report import CollectiveReport, parse_hlo
from models.build import build_model
from models.config import PRESETS
from models.inputs.rows import decode_rows
from models.layers.attention.context_parallel import CpAttentionMode
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM
from models.training.trainer import Trainer

TABLE = pathlib.Path(__file__).parents[2] / "docs" / "collectives.md"
NAMES = {
    "AR": "all-reduce",
    "RS": "reduce-scatter",
    "AG": "all-gather",
    "PERM": "collective-permute",
}
MODES = {"all-gather": CpAttentionMode.ALL_GATHER, "ring": CpAttentionMode.RING}
CONFIG = dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=3)
MIDDLE = 1
SEQUENCES = ([1] * 13, [2] * 5, [3] * 9, [4] * 2)
PROGRAMS = ("prefill", "decode step", "training step")


def _documented() -> dict[tuple[int, int, int, CpAttentionMode], dict[str, tuple[str, ...]]]:
    text = TABLE.read_text().split("## Context parallelism", 1)[1]
    lines = [line for line in text.split("\n## ", 1)[0].splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        key = (int(cells["dp"]), int(cells["cp"]), int(cells["tp"]), MODES[cells["mode"]])
        rows[key] = {name: tuple(NAMES[kind] for kind in cells[name].split()) for name in PROGRAMS}
    return rows


DOCUMENTED = _documented()
DEFAULT = {(2, 2, 2, CpAttentionMode.ALL_GATHER)}


@functools.cache
def compiled(dp: int, cp: int, tp: int, mode: CpAttentionMode) -> dict[str, CollectiveReport]:
    """The collectives of the runtime's prefill (filling the caches) and decode programs and of
    one training step's loss and gradients, on an attn_dp x attn_cp x attn_tp mesh."""
    topology = bj.Topology(attn_dp=dp, attn_cp=cp, attn_tp=tp)
    mesh = bj.make_mesh(topology)
    runner = ShardedCausalLM(build_model(CONFIG, topology, BuildOptions(cp_attention=mode)), mesh)
    packed = runner.pack(list(SEQUENCES), bucketed=True)
    caches = runner.new_caches(packed.decode_rows_per_rank, 128)
    key = jax.random.key(0)
    last_rows = runner.place_array(packed.last_row_index())
    prefill = runner.lower_prefill(*runner.place(packed), caches, last_rows, key)
    lengths = np.asarray(packed.lengths, np.int32)
    rows, batch = runner.place(decode_rows(packed, np.zeros_like(lengths), lengths))
    decode = runner.lower_decode(rows, batch, caches, key, 2, capacity=16)
    trainer = Trainer(
        build_model(CONFIG, topology, BuildOptions(cp_attention=mode)), mesh, optax.sgd(0.1)
    )
    step = jax.jit(jax.value_and_grad(trainer.sharded_loss)).lower(
        trainer.state.params, trainer.pack(list(SEQUENCES))
    )
    return {
        name: parse_hlo(lowered.compile().as_text())
        for name, lowered in zip(PROGRAMS, (prefill, decode, step), strict=True)
    }


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(
            key,
            id=f"dp{key[0]}-cp{key[1]}-tp{key[2]}-{key[3].value}",
            marks=[] if key in DEFAULT else [pytest.mark.slow],
        )
        for key in DOCUMENTED
    ],
)
def test_cp_programs_run_the_documented_collectives(key):
    """The middle layer of each program runs the documented collectives (as a multiset: XLA's
    schedule may order independent ones either way), nothing more."""
    reports = compiled(*key)
    for name in PROGRAMS:
        got = collections.Counter(reports[name].sequence(MIDDLE))
        want = collections.Counter(DOCUMENTED[key][name])
        assert got == want, name


def test_the_table_covers_both_modes_under_cp_tp_and_dp():
    """Rows for CP 2 and 4 alone, CP x TP and DP x CP x TP, each in both modes."""
    meshes = {(1, 2, 1), (1, 4, 1), (1, 2, 2), (2, 2, 2)}
    assert set(DOCUMENTED) == {(*mesh, mode) for mesh in meshes for mode in CpAttentionMode}
