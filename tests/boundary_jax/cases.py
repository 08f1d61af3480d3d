"""Compiled stand-in stacks shared by the core tests: one compile per distinct bound plan set.

Policies whose bound paths coincide for a configuration (all of them without attention DP, for
instance) run the same program, so each distinct set of paths is compiled once and checked on
behalf of every policy that binds it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

import boundary_jax as bj
from boundary_jax.report import CollectiveReport, parse_hlo

from .standin import (
    HIDDEN,
    POLICIES,
    ROWS,
    Setup,
    StandInDecoder,
    make_batch,
    reference,
    sharded_forward,
)


@dataclasses.dataclass
class Case:
    setup: Setup
    scattered: bool
    model: StandInDecoder
    fn: object
    leaves: object
    place: object
    report: CollectiveReport
    reference: object

    def run(self, x, counts):
        return self.fn(self.leaves, self.place(x), make_batch(self.setup, self.scattered, counts))


def plan_key(model: StandInDecoder) -> tuple:
    return tuple(
        boundary.plan.paths
        for layer in model.layers
        for boundary in (layer.attn_boundary, layer.ffn_boundary)
    )


@functools.cache
def build(setup: Setup) -> StandInDecoder:
    with jax.enable_x64(True):
        return StandInDecoder(setup, jax.random.key(setup.layers * 100 + setup.dp * 10 + setup.tp))


_compiled: dict[tuple, Case] = {}


def compiled(setup: Setup, scattered: bool) -> Case:
    """The compiled case for `setup`, shared with every setup whose plans bind the same paths."""
    model = build(setup)
    key = (setup.dp, setup.tp, setup.layers, scattered, plan_key(model))
    if key not in _compiled:
        with jax.enable_x64(True):
            batch = make_batch(setup, scattered, np.full(setup.dp, ROWS))
            fn, leaves, place = sharded_forward(model, setup, batch)
            x = np.zeros((setup.dp * ROWS, HIDDEN))
            lowered = fn.lower(leaves, place(x), batch)
            report = parse_hlo(lowered.compile().as_text())
        want = jax.jit(functools.partial(reference, model, setup=setup))
        _compiled[key] = Case(setup, scattered, model, fn, leaves, place, report, want)
    return _compiled[key]


# Binding sees a mesh only through which token axes are active and how their sizes compare (the
# sizes themselves enter as the parts of reduce-scatters and slices), and a stack only through
# its first, middle and last layers: so one mesh per such class (none, TP alone, DP alone) plus
# the three DP x TP shapes (DP below, equal to and above TP), and depths 1 (the first layer is
# the last) and 3 (first, middle, last: every edge a deeper stack has), cover every binding;
# each policy and batch variant on each. By default depth 3 runs every policy and batch on the
# meshes with no, one or both axes of equal size active (every column of the table for every
# binding), and on the DP x TP meshes of unequal sizes one policy per row of the table (ar, rs
# and rsv ordinary, ar and rs input-scattered: each collective shape at each size order); depth 1
# (the first layer also the last) runs on DP 2 x TP 2 only, where both token axes are active. The
# rest repeat those bindings and run under -m slow.
# Tests of one mesh share compiled programs (one xdist worker).
SWEEP_MESHES = ((1, 1), (1, 4), (8, 1), (2, 2), (2, 4), (4, 2))
DEPTH_ONE_MESH = (2, 2)
P = bj.ReductionPolicy
ROW_POLICIES = {False: (P.AR, P.RS, P.RSV), True: (P.AR, P.RS)}


def _default(dp: int, tp: int, layers: int, policy: bj.ReductionPolicy, scattered: bool) -> bool:
    if layers == 1:
        return (dp, tp) == DEPTH_ONE_MESH
    return dp == 1 or tp == 1 or dp == tp or policy in ROW_POLICIES[scattered]


SWEEP = [
    pytest.param(
        dp,
        tp,
        layers,
        policy,
        scattered,
        id=f"dp{dp}-tp{tp}-L{layers}-{policy.value}-{'scattered' if scattered else 'ordinary'}",
        marks=[pytest.mark.xdist_group(f"core-{dp}x{tp}")]
        + ([] if _default(dp, tp, layers, policy, scattered) else [pytest.mark.slow]),
    )
    for dp, tp in SWEEP_MESHES
    for layers in (1, 3)
    for policy in POLICIES
    for scattered in ((False, True) if tp > 1 else (False,))
]
