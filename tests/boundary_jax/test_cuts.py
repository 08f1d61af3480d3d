"""Every pipeline cut of heterogeneous stacks, at binding level.

For stacks of 2 to 4 stages drawn from the six stage kinds, cut at every stage boundary under
two parallel configurations (attention TP alone under the all-reduce policy; attention DP x TP
under the scatter policy; every batch variant each configuration supports is bound and
checked): both sides of every edge agree on the residual's rows, the handoff carries the
residual on the attention's rows, the stages away from the cut bind as they do uncut, and a cut
rejects only what the uncut stack rejects.
"""

import dataclasses
import itertools

import pytest

import boundary_jax as bj
from boundary_jax import ops

from .hetero import DEFERS, Hetero, Kind, declare

# Binding sees a topology only through which token axes are active (size > 1) and how the
# attention TP, attention DP and full TP sizes compare with 1 and with a dense FFN's
# `dense_tp_size`; the sizes themselves enter a plan only as the `parts` of its reduce-scatters
# and block takes. So dp1-tp2 binds every stack and cut exactly as dp1-tp4 does, and dp2-tp2 as
# dp4-tp2, up to those parts (checked for all 10,260 bindings of each policy when they were
# dropped from this sweep). dp4-tp2 stays rather than dp2-tp2: its DP and TP sizes differ. Each
# configuration binds under one policy, so both policies and both configurations are swept once
# each: the all-reduce policy without attention DP, the scatter policy (reduce-scatters, then
# the residual on slices) where attention DP gives it the most to move.
# By default the stacks of 2 and 3 stages (every pair and triple of kinds, so every edge and
# every edge next to a cut); the 4-stage stacks, and the second configuration, under -m slow.
SWEEPS = [
    pytest.param(1, 4, bj.ReductionPolicy.AR, (2, 3), id="ar-dp1-tp4-2to3"),
    pytest.param(1, 4, bj.ReductionPolicy.AR, (4,), id="ar-dp1-tp4-4", marks=pytest.mark.slow),
    pytest.param(
        4, 2, bj.ReductionPolicy.RS_RSV, (2, 3, 4), id="rs+rsv-dp4-tp2", marks=pytest.mark.slow
    ),
]


def _bind(model: Hetero, layers: range):
    """The plans of layers [a, b) of `model`, or the exception binding raised."""
    try:
        with bj.layer_stack(
            model.topology,
            reduction=model.policy,
            input_sum=bj.SumGroup.ATTN_TP,
            fusions=DEFERS,
            stage_facts=model.stage_facts,
            num_layers=len(model.kinds),
            layers=layers,
        ):
            boundaries = [
                b for i in layers for b in bj.append_stages((declare(model.kinds[i]), None))
            ]
    except (NotImplementedError, ValueError) as error:
        return error
    return [b.plan for b in boundaries]


def _entries(path):
    return {
        dataclasses.replace(e, primary=False, transport=False)
        for e in path.entries
        if not e.transport
    }


def _check_edges(plans, model):
    """Within one stack, the consumer binds an entry for every handoff of its producer, on the
    rows the producer keeps the residual on."""
    for producer, consumer in itertools.pairwise(plans):
        for variant in (p.variant for p in producer.paths):
            out, into = producer.path(variant), consumer.path(variant)
            for option in out.exits:
                entry = into.entry(option.handoff, out.residual_layout)
                assert entry is not None, (model, variant, option.kind)


def _check_cut(uncut, sender, receiver, cut, model):
    topology = model.topology
    attention = topology.attention_rows()
    last, first = sender[-1], receiver[0]
    assert last.declaration.place.outgoing.kind is bj.declare.EdgeKind.PIPELINE_SEND
    assert first.declaration.place.incoming.kind is bj.declare.EdgeKind.PIPELINE_RECEIVE
    for variant in (p.variant for p in uncut[0].paths):
        send, receive = last.path(variant), first.path(variant)
        (transport,) = [e for e in receive.entries if e.transport]
        assert transport.residual_from == attention
        sums = ops.AllReduce | ops.ReduceScatter | ops.Finalize
        steps = transport.complete + transport.residual_move
        assert not transport.fused_sum and not any(isinstance(s, sums) for s in steps), (
            "the receiver sums nothing"
        )
        writes = bj.bind.sends_written(last.declaration, send.residual_layout, topology)
        assert (transport.handoff is None) == writes
        for option in send.exits:
            assert option.leave.sends_written == writes
            leave = option.leave.entry(option.handoff)
            residual = bj.plan.Placement(leave.residual_from)
            landed = ops.simulate(
                leave.complete + ops.all_reduce(leave.fused_sum, topology), leave.handoff
            )
            assert landed == residual, "to_pp completes every owed item"
            moved = ops.simulate(leave.move_input, residual)
            assert moved == bj.plan.Placement(attention), "the handoff is on the attention's rows"
            assert writes or moved == residual
        assert [o.handoff for o in send.exits] == [
            o.handoff for o in uncut[cut - 1].path(variant).exits
        ], "the sender hands on what it hands on uncut"
        assert _entries(receive) >= _entries(uncut[cut].path(variant)) - {
            e for e in _entries(uncut[cut].path(variant)) if e.residual_from == attention
        }
    for index, plan in enumerate(sender[:-1] + receiver[1:]):
        original = uncut[index if index < cut - 1 else index + 2]
        assert plan.paths == original.paths, "stages away from the cut bind as uncut"


@pytest.mark.parametrize("dp,tp,policy,sizes", SWEEPS)
def test_every_cut_binds_consistently(dp, tp, policy, sizes, record_property):
    """Every cut of every stack of `sizes` stages keeps rows and sums consistent across the
    handoff."""
    scenarios = rejected = 0
    for kinds in (k for n in sizes for k in itertools.product(Kind, repeat=n)):
        model = Hetero(kinds, dp, tp, policy)
        uncut = _bind(model, range(len(kinds)))
        if not isinstance(uncut, Exception):
            _check_edges(uncut, model)
        for cut in range(1, len(kinds)):
            sender, receiver = _bind(model, range(cut)), _bind(model, range(cut, len(kinds)))
            scenarios += 1
            failed = [p for p in (sender, receiver) if isinstance(p, Exception)]
            if isinstance(uncut, Exception):
                assert failed, f"{kinds} cut at {cut} binds, but uncut it raises {uncut!r}"
                assert all(type(f) is type(uncut) for f in failed)
                rejected += 1
                continue
            assert not failed, f"{kinds} cut at {cut} raises {failed}, uncut it binds"
            _check_edges(sender, model)
            _check_edges(receiver, model)
            _check_cut(uncut, sender, receiver, cut, model)
    print(f"\n{scenarios} cuts checked on dp={dp} tp={tp} {policy.value} ({rejected} rejected)")
    record_property("cuts", scenarios)
