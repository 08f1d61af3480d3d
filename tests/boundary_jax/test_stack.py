"""Topology, layouts, declarations and stack binding: every decision made before tracing."""

import itertools
import math

import flax.nnx
import jax
import numpy as np
import pytest

import boundary_jax as bj
from boundary_jax.layout import Layout
from boundary_jax.plan import ExitKind

from .standin import HIDDEN, make_mesh

A = bj.TokenAxis


def _stack(topology, *declarations, policy=bj.ReductionPolicy.AR, **options):
    with bj.layer_stack(topology, reduction=policy, **options) as stack:
        boundaries = bj.append_stages(*((d, None) for d in declarations))
    return stack, boundaries


def test_topology_reads_named_mesh_axes():
    """A mesh's attn_dp / attn_tp axes become the topology; absent axes have size one."""
    topology = bj.Topology.from_mesh(make_mesh(2, 4))
    assert topology == bj.Topology(attn_dp=2, attn_tp=4)
    assert topology.tp_size == 8
    assert topology.sum_axes(bj.SumGroup.FULL_TP) == (A.ATTN_DP, A.ATTN_TP)
    assert topology.sum_axes(bj.SumGroup.ATTN_CP) == ()
    assert topology.shard_entry(bj.SumGroup.FULL_TP) == ("attn_dp", "attn_tp")
    assert topology.shard_entry(bj.SumGroup.ATTN_TP) == "attn_tp"


def test_topology_rejects_unknown_axes():
    """A mesh axis boundary-jax does not know is rejected by name."""
    with pytest.raises(ValueError, match=r"unknown axes \['tp'\]"):
        bj.Topology.from_axis_sizes({"tp": 4})


D, DE, T, TE = "attn_dp", "attn_dp_ep", "attn_tp", "attn_tp_ep"
FACTORINGS = [
    # (dp, tp, moe_ep): the mesh axes of size > 1, the MOE_EP mesh axes, the MOE_TP mesh axes
    (1, 8, 1, {T: 8}, (), (T,)),
    (1, 4, 2, {TE: 2, T: 2}, (TE,), (T,)),
    (1, 8, 4, {TE: 4, T: 2}, (TE,), (T,)),
    (2, 4, 2, {D: 2, T: 4}, (D,), (T,)),
    (2, 4, 4, {D: 2, TE: 2, T: 2}, (D, TE), (T,)),
    (2, 4, 8, {D: 2, T: 4}, (D, T), ()),
    (4, 2, 2, {DE: 2, D: 2, T: 2}, (DE,), (D, T)),
    (6, 4, 4, {DE: 2, D: 3, TE: 2, T: 2}, (DE, TE), (D, T)),  # EP not a block of the TP group
]


@pytest.mark.parametrize("dp,tp,ep,shape,experts,width", FACTORINGS)
def test_expert_parallel_size_factors_the_token_axes(dp, tp, ep, shape, experts, width):
    """Each token axis gives gcd(moe_ep left, its size) ranks to the expert-parallel group,
    outermost first; an axis split strictly is two mesh axes (its part outer), which collectives
    over the token axis name together. Every rank has its own (expert, width) position."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp, moe_ep=ep)
    mesh_shape = topology.mesh_shape()
    assert {name: size for name, size in mesh_shape.items() if size > 1} == shape
    assert list(mesh_shape) == [a.value for a in bj.MeshAxis if a.value in mesh_shape]
    assert topology.group_names(bj.SumGroup.MOE_EP) == experts
    assert topology.group_names(bj.SumGroup.MOE_TP) == width
    assert topology.group_size(bj.SumGroup.MOE_EP) == ep
    assert topology.group_size(bj.SumGroup.MOE_TP) == dp * tp // ep
    for axis, size in ((A.ATTN_DP, dp), (A.ATTN_TP, tp)):
        names = topology.mesh_names((axis,))
        assert math.prod(mesh_shape[name] for name in names) == size
        assert names[-1] == axis.mesh_name and names[0] in (axis.mesh_name, axis.expert_mesh_axis)
    assert topology.group_names(bj.SumGroup.FULL_TP) == tuple(n for n in mesh_shape if n in shape)
    entry = topology.shard_entry(bj.SumGroup.MOE_EP)
    assert entry == (None if not experts else experts[0] if len(experts) == 1 else experts)
    coordinates = list(itertools.product(*(range(size) for size in shape.values())))
    position = {name: i for i, name in enumerate(shape)}

    def index(coordinate, names):
        if not names:
            return 0
        at = [coordinate[position[name]] for name in names]
        return int(np.ravel_multi_index(at, [shape[name] for name in names]))

    ranks = {(index(c, experts), index(c, width)) for c in coordinates}
    assert len(ranks) == dp * tp and {e for e, _ in ranks} == set(range(ep))


def test_a_split_mesh_reads_back_and_a_mismatched_one_is_rejected():
    """make_mesh builds the factored axes and from_mesh reads them back; whole-axis sizes are
    read with any moe_ep, while a mesh or sizes naming another factoring are rejected."""
    topology = bj.Topology(attn_dp=2, attn_tp=4, moe_ep=4)
    mesh = bj.make_mesh(topology)
    assert dict(mesh.shape) == topology.mesh_shape()
    assert bj.Topology.from_mesh(mesh, moe_ep=4) == topology
    assert bj.Topology.from_axis_sizes(topology.mesh_shape(), moe_ep=4) == topology
    assert bj.Topology.from_axis_sizes({"attn_dp": 2, "attn_tp": 4}, moe_ep=4) == topology
    with pytest.raises(ValueError, match=r"make_mesh\(topology\)"):
        bj.Topology.from_mesh(make_mesh(2, 4), moe_ep=4)
    with pytest.raises(ValueError, match="factors the mesh axes as"):
        bj.Topology.from_mesh(mesh)
    with pytest.raises(ValueError, match="factors the mesh axes as"):
        bj.Topology.from_axis_sizes({"attn_tp_ep": 2, "attn_tp": 2}, moe_ep=4)
    with pytest.raises(ValueError, match="group_names"):
        topology.sum_axes(bj.SumGroup.MOE_EP)


def test_layouts_drop_size_one_axes():
    """Layouts keep only axes of size > 1, in canonical order, and give row PartitionSpecs."""
    topology = bj.Topology(attn_dp=1, attn_tp=4)
    assert topology.layout(A.ATTN_TP, A.ATTN_DP) == Layout((A.ATTN_TP,))
    assert topology.row_spec(topology.layout(A.ATTN_DP)) == jax.sharding.PartitionSpec(None)
    wide = bj.Topology(attn_dp=2, attn_tp=2)
    assert wide.row_spec(wide.layout(A.ATTN_DP, A.ATTN_TP), None) == jax.sharding.PartitionSpec(
        ("attn_dp", "attn_tp"), None
    )
    with pytest.raises(ValueError, match="canonical order"):
        Layout((A.ATTN_TP, A.ATTN_DP))


def test_stages_bind_when_the_stack_closes():
    """Plans appear only when the stack closes; each declaration gets its place."""
    topology = bj.Topology(attn_tp=2)
    with bj.layer_stack(topology):
        first = bj.append_stages((bj.declare_attn(), None))
        second = bj.append_stages((bj.declare_ffn(), None), (bj.declare_attn(), None))
        assert all(b.plan is None for b in first + second)
    last = second[-1]
    places = [b.declaration.place for b in first + second]
    assert places[0].incoming.kind is bj.declare.EdgeKind.STACK_ENTRY
    assert places[0].previous == bj.declare.StackInput(None)
    assert second[0].declaration.place.previous == first[0].declaration.facts()
    assert [p.incoming.kind for p in places[1:]] == [bj.declare.EdgeKind.NEXT_STAGE] * 2
    assert places[-1].outgoing.kind is bj.declare.EdgeKind.STACK_EXIT
    assert isinstance(places[-1].outgoing.consumer, bj.declare.FinalRead)
    assert [p.terminal for p in places] == [False, False, True]
    assert last.plan.path(bj.BatchVariant.ORDINARY).initial_entry is None
    assert first[0].plan.path(bj.BatchVariant.ORDINARY).initial_entry is not None
    for boundary in first + second:
        primaries = [e for e in boundary.plan.path(bj.BatchVariant.ORDINARY).entries if e.primary]
        assert len(primaries) == 1, "exactly one entry is the one the producer leads to"
    assert first[0].plan.path(bj.BatchVariant.ORDINARY).initial_entry.primary


def test_prepare_before_the_stack_closes_is_rejected():
    """Running a stage whose stack is still open names the fix."""
    topology = bj.Topology()
    stream = bj.residual_stream.start(bj.BatchFacts.ordinary(topology))
    with bj.layer_stack(topology):
        (boundary,) = bj.append_stages((bj.declare_attn(), None))
        with pytest.raises(RuntimeError, match="is not bound yet"):
            boundary.prepare(jax.numpy.ones((4, HIDDEN)), stream)


def test_an_option_a_stage_does_not_take_is_rejected():
    """append_stages rejects options the stage kind does not take, when appended."""
    with pytest.raises(TypeError, match="do not take the options"), bj.layer_stack(bj.Topology()):
        bj.append_stages((bj.declare_ffn(), None, {"qkv_latent_func": print}))


def test_a_declaration_from_a_bound_boundary_is_rejected():
    """Reusing a bound boundary's declaration in another stack is rejected."""
    _, (attn,) = _stack(bj.Topology(), bj.declare_attn())
    with pytest.raises(ValueError, match="already has its place"), bj.layer_stack(bj.Topology()):
        bj.append_stages((attn.declaration, None))


def test_a_binding_error_names_its_append_stages_call():
    """An error raised while binding carries a note with the append_stages call site."""
    with (
        pytest.raises(ValueError, match="dense_tp_size must be 1, attention TP") as info,
        bj.layer_stack(bj.Topology(attn_dp=2, attn_tp=2)),
    ):
        bj.append_stages((bj.declare_attn(), None))
        bj.append_stages((bj.declare_ffn(dense_tp_size=3), None))  # the line the note names
    (note,) = info.value.__notes__
    assert __file__ in note
    assert "while binding the stage appended at" in note


def test_next_sparse_must_match_the_next_ffn():
    """A declared next_sparse that contradicts the stack is rejected at binding."""
    with pytest.raises(ValueError, match="next FFN in the stack is dense"):
        _stack(
            bj.Topology(),
            bj.declare_attn(),
            bj.declare_ffn(next_sparse=True),
            bj.declare_attn(),
            bj.declare_ffn(),
        )


def test_pipeline_and_context_parallel_topologies_are_rejected_when_built():
    """Unsupported axes fail at construction, never at run time: a pipeline without the model's
    declarations, context parallelism with a pipeline."""
    with pytest.raises(NotImplementedError, match="pipeline"), bj.layer_stack(bj.Topology(pp=2)):
        pass
    with (
        pytest.raises(NotImplementedError, match="attn_cp with pp=1"),
        bj.layer_stack(bj.Topology(attn_cp=2, pp=2), stage_facts=lambda i: (), num_layers=1),
    ):
        pass


def test_input_scattered_paths_bind_only_where_every_attention_gathers():
    """INPUT_SCATTERED needs attention TP > 1 and stages that take gathered attention-TP input;
    UNPADDED needs attention TP > 1 without attention DP."""
    V = bj.BatchVariant
    _, boundaries = _stack(bj.Topology(attn_tp=2), bj.declare_attn(), bj.declare_ffn())
    assert tuple(p.variant for p in boundaries[0].plan.paths) == (
        V.ORDINARY,
        V.INPUT_SCATTERED,
        V.UNPADDED,
    )
    _, boundaries = _stack(bj.Topology(attn_dp=2), bj.declare_attn(), bj.declare_ffn())
    assert tuple(p.variant for p in boundaries[0].plan.paths) == (V.ORDINARY,)
    _, boundaries = _stack(bj.Topology(attn_dp=2, attn_tp=2), bj.declare_attn(), bj.declare_ffn())
    assert tuple(p.variant for p in boundaries[0].plan.paths) == (V.ORDINARY, V.INPUT_SCATTERED)
    mixer = bj.declare_mixer()
    _, boundaries = _stack(bj.Topology(attn_tp=2), mixer, bj.declare_ffn())
    assert tuple(p.variant for p in boundaries[1].plan.paths) == (V.ORDINARY, V.UNPADDED)


def test_reduction_policies_parse_and_resolve():
    """Policies parse from their CLI spelling; AUTO resolves per architecture."""
    assert bj.ReductionPolicy.parse("rs+rsv") is bj.ReductionPolicy.RS_RSV
    with pytest.raises(ValueError, match="one of ar, rs, rsv, rs\\+rsv, auto"):
        bj.ReductionPolicy.parse("reduce")
    auto = bj.ReductionPolicy.AUTO
    assert bj.policy.resolve_reduction_policy(auto) is bj.ReductionPolicy.RS_RSV
    bj.policy.register_reduction_default("TestOnlyForCausalLM", bj.ReductionPolicy.AR)
    assert bj.policy.resolve_reduction_policy(auto, "TestOnlyForCausalLM") is bj.ReductionPolicy.AR
    assert (
        bj.policy.resolve_reduction_policy(bj.ReductionPolicy.RS, "TestOnlyForCausalLM").value
        == "rs"
    )


def _ffn_exits(topology, policy, variant=bj.BatchVariant.ORDINARY):
    _, boundaries = _stack(
        topology,
        bj.declare_attn(),
        bj.declare_ffn(),
        bj.declare_attn(),
        bj.declare_ffn(),
        policy=policy,
    )
    return [o.kind for o in boundaries[1].plan.path(variant).exits]


def test_ineligible_scatter_policies_fall_back_to_the_all_reduce():
    """rs and rsv are permissions: where they cannot apply, only the all-reduce path binds."""
    P = bj.ReductionPolicy
    plain_tp = bj.Topology(attn_tp=4)
    for policy in P.RS, P.RSV, P.RS_RSV:
        assert _ffn_exits(plain_tp, policy) == [ExitKind.LEAVE_TO_NEXT_INPUT]
    dp_tp = bj.Topology(attn_dp=2, attn_tp=2)
    assert _ffn_exits(dp_tp, P.RS_RSV) == [
        ExitKind.DP_REDUCE_SCATTER,
        ExitKind.REDUCE_SCATTER,
        ExitKind.ALL_REDUCE,
    ]
    assert _ffn_exits(dp_tp, P.RSV, bj.BatchVariant.INPUT_SCATTERED) == [ExitKind.ALL_REDUCE]
    assert _ffn_exits(dp_tp, P.AR) == [ExitKind.ALL_REDUCE]


def test_mixer_exit_leaves_its_sum_to_an_ffn_and_completes_before_a_mixer_under_dp():
    """A mixer carries its attention-TP sum to an FFN always, to a mixer only without DP."""
    mixer = bj.declare_mixer(gathers_attn_tp_input=True)
    for dp, expected in ((1, ExitKind.LEAVE_TO_NEXT_INPUT), (2, ExitKind.ALL_REDUCE)):
        _, (first, second, ffn) = _stack(
            bj.Topology(attn_dp=dp, attn_tp=2), mixer, mixer, bj.declare_ffn()
        )
        ordinary = bj.BatchVariant.ORDINARY
        assert first.plan.path(ordinary).exits[0].kind is expected
        assert second.plan.path(ordinary).exits[0].kind is ExitKind.LEAVE_TO_NEXT_INPUT


def _facts(index):
    return (bj.declare_attn(), bj.declare_ffn())


def test_a_partial_stack_needs_the_models_stage_facts():
    """layers= without stage_facts, layers outside the model and a pipeline axis without
    stage_facts are rejected when the stack opens."""
    with (
        pytest.raises(ValueError, match="pass stage_facts"),
        bj.layer_stack(bj.Topology(), layers=range(1)),
    ):
        pass
    with (
        pytest.raises(ValueError, match="within"),
        bj.layer_stack(bj.Topology(), stage_facts=_facts, num_layers=2, layers=range(1, 3)),
    ):
        pass


def test_layers_must_declare_what_stage_facts_declares():
    """A layer that appends other stages than the model's stage_facts says is rejected."""
    with (
        pytest.raises(ValueError, match="differing first at stage 1"),
        bj.layer_stack(bj.Topology(attn_tp=2), stage_facts=_facts, num_layers=1),
    ):
        bj.append_stages((bj.declare_attn(), None), (bj.declare_ffn(dense_tp_size=1), None))


def test_each_side_of_a_cut_leaves_and_enters_only_its_own_way():
    """final_norm after a pipeline send, to_pp after the terminal stage, and from_pp on a stage
    no pipeline receive enters each raise with the fix."""
    topology = bj.Topology(attn_tp=2)
    with bj.layer_stack(topology, stage_facts=_facts, num_layers=2, layers=range(1)):
        sender = bj.append_stages((bj.declare_attn(), None), (bj.declare_ffn(), None))
    with bj.layer_stack(topology, stage_facts=_facts, num_layers=2, layers=range(1, 2)):
        receiver = bj.append_stages((bj.declare_attn(), None), (bj.declare_ffn(), None))
    assert sender[-1].declaration.place.outgoing.kind is bj.declare.EdgeKind.PIPELINE_SEND
    assert receiver[0].declaration.place.incoming.kind is bj.declare.EdgeKind.PIPELINE_RECEIVE
    assert receiver[0].declaration.place.previous == sender[-1].declaration.facts()
    batch = bj.BatchFacts.ordinary(bj.Topology())
    with bj.layer_stack(bj.Topology()):
        (only,) = bj.append_stages((bj.declare_ffn(), None))
    out, stream = only.prepare(jax.numpy.ones((4, HIDDEN)), bj.residual_stream.start(batch))
    out, stream = only.finish(jax.numpy.ones((4, HIDDEN)), stream)
    with pytest.raises(RuntimeError, match="no next pipeline rank"):
        bj.residual_stream.to_pp(out, stream)
    with pytest.raises(RuntimeError, match="entered through stack entry"):
        only.from_pp({"hidden_states": jax.numpy.ones((4, HIDDEN))}, batch)


def test_final_norm_after_a_pipeline_send_is_rejected():
    """A rank whose stack continues on the next rank leaves through to_pp, not final_norm."""
    topology = bj.Topology()
    with bj.layer_stack(topology, stage_facts=_facts, num_layers=2, layers=range(1)):
        attn, ffn = bj.append_stages((bj.declare_attn(), None), (bj.declare_ffn(), None))
    stream = bj.residual_stream.start(bj.BatchFacts.ordinary(topology))
    h, stream = attn.prepare(jax.numpy.ones((4, HIDDEN)), stream)
    out, stream = attn.finish(h, stream)
    h, stream = ffn.prepare(out, stream)
    out, stream = ffn.finish(h, stream)
    with pytest.raises(RuntimeError, match="leave through to_pp"):
        bj.residual_stream.final_norm(out, stream, bj.RMSNorm(HIDDEN))
    tensors = bj.residual_stream.to_pp(out, stream)
    assert set(tensors) == {"hidden_states", "residual"}


class _Owner(flax.nnx.Module):
    """A layer that owns one norm and appends one stage with it."""

    def __init__(self, owned: bool):
        self.input_norm = bj.RMSNorm(HIDDEN)
        norm = self.input_norm if owned else bj.RMSNorm(HIDDEN)
        (self.boundary,) = bj.append_stages((bj.declare_attn(), norm), owner=self)


def test_a_stage_norm_is_the_layer_s_parameter():
    """A module design is reached through its layer: its parameters are named by the layer's
    part, and the boundary holds no copy; one that is no attribute of the owner, or passed
    without an owner, is rejected when appended."""
    with bj.layer_stack(bj.Topology()):
        layer = _Owner(owned=True)
    paths = [path for path, _ in flax.nnx.to_flat_state(flax.nnx.state(layer, flax.nnx.Param))]
    assert paths == [("input_norm", "weight")]
    assert layer.boundary.norm is layer.input_norm
    stack = bj.layer_stack(bj.Topology())
    with pytest.raises(ValueError, match="is not an attribute of its owner"), stack:
        _Owner(owned=False)
    stack = bj.layer_stack(bj.Topology())
    with pytest.raises(TypeError, match=r"pass append_stages\(\.\.\., owner=self\)"), stack:
        bj.append_stages((bj.declare_attn(), bj.RMSNorm(HIDDEN)))
