"""Branches: stages prepared from a source's input and merged back into its output, on simulated
meshes against a float64 single-device reference (values, gradients, pipeline cuts), mutants of
the merge, and every misuse."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
from boundary_jax import ops, residual_stream
from boundary_jax.adapters import branch as branch_adapter

from .branching import Branched, BranchStack, Part, build, built, reference
from .hetero import Kind
from .standin import (
    HIDDEN,
    ROWS,
    StandInAttention,
    StandInFfn,
    TanhUpdate,
    count_patterns,
    input_shares,
    make_mesh,
    random_norm,
)

A, F, M = Kind.ATTN, Kind.FFN, Kind.MOE
AR, RS_RSV = bj.ReductionPolicy.AR, bj.ReductionPolicy.RS_RSV
SLOW = pytest.mark.slow

# LongCat-Flash's layer: attention, then a MoE with a dense FFN, attention and FFN branched from
# its prepared input; in two layers the last branch merges into the final read.
LONGCAT = ((Part(A), Part(M, (F, A, F))),) * 2
# The same with the MoE on its own rows (all-to-all dispatch): the residual moves onto
# attention-TP slices and the branch forks there.
LONGCAT_OWN = ((Part(A), Part(Kind.MOE_OWN, (F, A, F))),) * 2
# Two branches a layer: one from the attention's prepared input, one from the FFN's.
TWO = ((Part(A, (F,)), Part(F, (A, F))),) * 2
# One stage a layer, so a pipeline cut falls just before the branch's source and just after its
# merge.
CUT = ((Part(A),), (Part(M, (F, A, F)),), (Part(A),), (Part(F),))

# One case per layout kind by default (TP 2, TP 4, DP 2 x TP 2, each policy and model once);
# the rest of the matrix under -m slow.
CASES = [
    pytest.param(layers, dp, tp, policy, id=f"{name}-dp{dp}-tp{tp}-{policy.value}", marks=marks)
    for name, layers, dp, tp, policy, marks in [
        ("two", TWO, 1, 2, RS_RSV, ()),
        ("longcat", LONGCAT, 1, 4, AR, ()),
        ("longcat", LONGCAT, 2, 2, RS_RSV, ()),
        ("two", TWO, 2, 2, AR, ()),
        ("longcat-own-rows", LONGCAT_OWN, 2, 2, RS_RSV, ()),
        ("longcat-own-rows", LONGCAT_OWN, 1, 4, AR, SLOW),
        ("longcat", LONGCAT, 1, 2, AR, SLOW),
        ("longcat", LONGCAT, 1, 2, RS_RSV, SLOW),
        ("two", TWO, 1, 2, AR, SLOW),
        ("longcat", LONGCAT, 1, 4, RS_RSV, SLOW),
        ("two", TWO, 1, 4, AR, SLOW),
        ("two", TWO, 1, 4, RS_RSV, SLOW),
        ("longcat", LONGCAT, 2, 2, AR, SLOW),
        ("two", TWO, 2, 2, RS_RSV, SLOW),
    ]
]


def _error(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _inputs(dp: int, counts: str = "ragged"):
    x = jax.random.normal(jax.random.key(5), (dp * ROWS, HIDDEN), jnp.float64)
    return x, count_patterns(dp)[counts]


@pytest.mark.parametrize("layers,dp,tp,policy", CASES)
def test_branches_equal_one_device(layers, dp, tp, policy):
    """Stacks with branches (LongCat's, or one from the attention's and one from the FFN's
    prepared input in every layer; the last one merging into the final read) equal one device,
    with ragged and idle DP ranks."""
    model = Branched(layers, dp, tp, policy)
    with jax.enable_x64(True):
        run = built(model)
        for counts in ("ragged", "idle") if dp > 1 else ("ragged",):
            x, counts = _inputs(dp, counts)
            assert _error(run.run(x, counts), reference(run.stacks, x, dp, counts)) < 1e-12


@pytest.mark.parametrize(
    "dp,tp", [pytest.param(2, 2, id="dp2-tp2"), pytest.param(1, 4, id="dp1-tp4", marks=SLOW)]
)
def test_cuts_just_before_and_after_a_merge(dp, tp):
    """A pipeline cut just before the branch's source (the receiving rank forks the branch)
    and just after its merge (to_pp sends the merged output) equals the uncut stack."""
    model = Branched(CUT, dp, tp)
    with jax.enable_x64(True):
        x, counts = _inputs(dp)
        uncut = built(model).run(x, counts)
        assert _error(uncut, reference(built(model).stacks, x, dp, counts)) < 1e-12
        for cut in (1, 2):
            assert _error(build(model, cut).run(x, counts), uncut) < 1e-12, f"cut at {cut}"


@pytest.mark.parametrize(
    "layers,dp,tp,policy",
    [
        pytest.param(LONGCAT, 2, 2, RS_RSV, id="longcat-dp2-tp2-rs+rsv"),
        pytest.param(TWO, 1, 4, AR, id="two-dp1-tp4-ar", marks=SLOW),
    ],
)
def test_gradients_equal_one_device(layers, dp, tp, policy):
    """jax.grad through the branches equals the single-device gradient for every parameter, the
    branch stages' own included."""
    model = Branched(layers, dp, tp, policy)
    with jax.enable_x64(True):
        run = built(model)
        x, counts = _inputs(dp)
        weights = jax.random.normal(jax.random.key(9), x.shape, jnp.float64)
        placed, batch = run.place(x), run.batch(x, counts)
        graphdef, plain = nnx.split(nnx.List(run.stacks))
        with jax.set_mesh(make_mesh(dp, tp)):
            grads = jax.jit(jax.grad(lambda s: jnp.sum(run.program(s, placed, batch) * weights)))(
                run.sharded.leaves
            )
            got = run.sharded.state_of(grads)
        want = jax.grad(
            lambda s: jnp.sum(reference(list(nnx.merge(graphdef, s)), x, dp, counts) * weights)
        )(plain)
    got_flat, want_flat = dict(nnx.to_flat_state(got)), dict(nnx.to_flat_state(want))
    assert set(got_flat) == set(want_flat)
    assert any("branch_compute_1" in map(str, path) for path in want_flat)
    for path, leaf in want_flat.items():
        value = np.asarray(jax.device_get(got_flat[path][...]))
        np.testing.assert_allclose(value, leaf[...], rtol=1e-9, atol=1e-12, err_msg=str(path))


# An attention-sourced branch (an FFN, then attention) whose last stage hands its partial sum
# on: the merge defers it to the source attention's own pending sum (one all-reduce completes
# both).
DEFERRING = Branched(((Part(A, (F, A)), Part(F)),), 1, 2, AR, bj.fusions.NO_FUSIONS)
# LongCat's layers under TP 2: the MoE hands its finalize on, so the branch's partial sum
# completes in a fold of its own before the merge.
FOLDING = Branched(LONGCAT, 1, 2, AR)


def _complete_twice(residual, branch, pending, deferred):
    value = ops.run(deferred.work.in_place, deferred.value)
    return branch, pending.moved(pending.work, pending.value + value, None)


def _skip(residual, branch, pending, deferred):
    return branch + deferred.value, pending


def _on_a_row_slice(residual, branch, pending, deferred):
    axes, topology = deferred.placement.owed, DEFERRING.topology
    value = ops.run(
        ops.reduce_scatter(axes, topology) + ops.all_gather(axes, topology), deferred.value
    )
    return branch, pending.moved(pending.work, pending.value + value, None)


def _wrong_stream(residual, branch, pending, deferred):
    return residual, pending.moved(pending.work, pending.value + deferred.value, None)


def _fold_skipping_the_sum(output, stream):
    pending = stream.pending
    return stream.written(
        pending.apply(stream.residual, pending.value), stream.rows, leave=stream.leave
    )


MUTANTS = {
    "deferred sum completed twice": (DEFERRING, "_combine", _complete_twice),
    "deferred sum skipped": (DEFERRING, "_combine", _skip),
    "deferred sum completed on a row slice before the merge": (
        DEFERRING,
        "_combine",
        _on_a_row_slice,
    ),
    "merged into the source's residual, not the branch's": (DEFERRING, "_combine", _wrong_stream),
    "branch_output's sum skipped": (FOLDING, "fold", _fold_skipping_the_sum),
}


@functools.cache
def _plans(model):
    return built(model)


def test_the_mutant_models_take_the_paths_they_mutate():
    """The deferring model's branch hands on what its source hands on (the merge adds them
    unsummed); the folding model's source hands on a finalize, so the branch completes its own."""
    ordinary = bj.BatchVariant.ORDINARY
    with jax.enable_x64(True):
        deferring = _plans(DEFERRING).stacks[0].layers[0].parts[0]
        folding = _plans(FOLDING).stacks[0].layers[0].parts[1]
    path, source = deferring.branch[-1].plan.path(ordinary), deferring.boundary.plan.path(ordinary)
    assert path.exits[0].handoff == source.exits[0].handoff in path.merge.defers
    assert not path.exits[0].handoff.complete
    path, source = folding.branch[-1].plan.path(ordinary), folding.boundary.plan.path(ordinary)
    assert source.exits[0].defers_finalize and not path.exits[0].handoff.complete


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_mutated_merge_is_caught(monkeypatch, mutant):
    """Each mutant of the branch's completion or merge changes the output."""
    model, name, mutate = MUTANTS[mutant]
    with jax.enable_x64(True):
        x, counts = _inputs(model.dp)
        want = reference(_plans(model).stacks, x, model.dp, counts)
        assert _error(_plans(model).run(x, counts), want) < 1e-12
        monkeypatch.setattr(branch_adapter, name, mutate)
        got = build(model, check_vma=False).run(x, counts)
        assert _error(got, want) > 1e-3, mutant


# Misuse, on one device (every step is local, so the calls run eagerly).
ONE = Branched(((Part(A), Part(F, (F, A))),), 1, 1)


@pytest.fixture(scope="module")
def one():
    stack = BranchStack(ONE, range(1), jax.random.key(1), jnp.float32)
    attn, ffn = stack.layers[0].parts
    x = jax.random.normal(jax.random.key(2), (ROWS, HIDDEN), jnp.float32)
    batch = bj.BatchFacts.ordinary(ONE.topology, np.array([ROWS]), rows_per_block=ROWS)
    return stack, attn, ffn, x, batch


def _to_source(one):
    """Runs the attention and prepares the FFN source: `(h, stream)`."""
    _, attn, ffn, x, batch = one
    h, stream = attn.boundary.prepare(x, residual_stream.start(batch))
    out, stream = attn.boundary.finish(attn.compute(h), stream)
    return ffn.boundary.prepare(out, stream)


def _branch_out(one, h, branch):
    _, _, ffn, _, _ = one
    y, branch = ffn.branch[0].finish(ffn.branch_part(0)[1](h), branch)
    g, branch = ffn.branch[1].prepare(y, branch)
    y, branch = ffn.branch[1].finish(ffn.branch_part(1)[1](g), branch)
    return bj.adapters.branch_output(ffn.branch[1], y, branch)


def test_prepare_on_a_branch_is_rejected(one):
    """A prepared branch's first stage entered with prepare() raises the guide's error."""
    h, stream = _to_source(one)
    with pytest.raises(RuntimeError, match="a prepared branch must enter through branch_input"):
        one[2].branch[0].prepare(h, stream)


def test_a_branch_never_merged_is_rejected(one):
    """Leaving the stack, or preparing another stage, with a branch open raises."""
    _, attn, ffn, _, _ = one
    h, stream = _to_source(one)
    _, stream, _ = bj.adapters.branch_input(ffn.branch[0], ffn.boundary, h, stream)
    out, stream = ffn.boundary.finish(ffn.compute(h), stream)
    with pytest.raises(RuntimeError, match="a branch was never merged before final_norm"):
        residual_stream.final_norm(out, stream, one[0].final_norm)
    with pytest.raises(RuntimeError, match="a branch was never merged before take_output"):
        residual_stream.take_output(*residual_stream.fold(out, stream))
    with pytest.raises(RuntimeError, match="a branch was never merged before prepare"):
        attn.boundary.prepare(out, stream)


def test_a_merge_into_another_stream_is_rejected(one):
    """A branch merges only into the stream it forked from (not another microbatch's)."""
    _, _, ffn, _, _ = one
    h, stream = _to_source(one)
    h2, other = _to_source(one)
    g, stream, branch = bj.adapters.branch_input(ffn.branch[0], ffn.boundary, h, stream)
    y, branch = _branch_out(one, g, branch)
    out, other = ffn.boundary.finish(ffn.compute(h2), other)
    with pytest.raises(ValueError, match="into the stream it forked from"):
        bj.adapters.merge_branch(out, other, y, branch)


def test_misordered_branch_calls_are_rejected(one):
    """branch_input after the source's finish, a merge before branch_output or before the
    source's finish, branch_output twice, and final_norm on a branch's stream raise."""
    stack, _, ffn, _, _ = one
    h, stream = _to_source(one)
    g, forked, branch = bj.adapters.branch_input(ffn.branch[0], ffn.boundary, h, stream)
    out, finished = ffn.boundary.finish(ffn.compute(h), forked)
    with pytest.raises(RuntimeError, match="call it after that stage's prepare"):
        bj.adapters.branch_input(ffn.branch[0], ffn.boundary, h, finished)
    y, mid = ffn.branch[0].finish(ffn.branch_part(0)[1](g), branch)
    with pytest.raises(RuntimeError, match="follows the finish\\(\\) of the branch's last stage"):
        bj.adapters.branch_output(ffn.branch[1], y, mid)
    y, done = _branch_out(one, g, branch)
    with pytest.raises(RuntimeError, match="ran twice"):
        bj.adapters.branch_output(ffn.branch[1], y, done)
    with pytest.raises(RuntimeError, match="on a branch's stream"):
        residual_stream.final_norm(y, done, stack.final_norm)
    with pytest.raises(RuntimeError, match="pending after its finish"):
        bj.adapters.merge_branch(forked.output, forked, y, done)
    merged_out, merged = bj.adapters.merge_branch(out, finished, y, done)
    assert merged.state is residual_stream.StreamState.PENDING and not merged.branches


def _declare_branch(topology, *, prepared_from=None, source=None, twice=False, read=None):
    with bj.layer_stack(topology):
        (first,) = bj.append_stages((bj.declare_attn(), None))
        (main,) = bj.append_stages((source or bj.declare_ffn(), None))
        extra = {} if read is None else {"read": read}
        bj.append_stages(
            (bj.declare_ffn(**extra), None), prepared_from=prepared_from or main.declaration
        )
        if twice:
            bj.append_stages((bj.declare_ffn(), None), prepared_from=main)
    return first, main


def test_construction_rejects_unsupported_branches():
    """Context parallelism, two branches from one source, an unknown source, a source whose
    update is not a plain add, a mismatched input format and a source whose update is applied
    at its exit (its output must stay pending for the merge) are rejected when the stack
    binds."""
    with pytest.raises(NotImplementedError, match="context parallelism"):
        _declare_branch(bj.Topology(attn_cp=2))
    with pytest.raises(ValueError, match="already the source of a branch"):
        _declare_branch(bj.Topology(), twice=True)
    with pytest.raises(ValueError, match="prepared_from names the stage"):
        _declare_branch(bj.Topology(), prepared_from=bj.declare_ffn())
    with pytest.raises(NotImplementedError, match="must be a plain add"):
        _declare_branch(bj.Topology(), source=bj.declare_ffn(update=TanhUpdate()))
    fp8 = bj.designs.AddNormRead(quantize=bj.designs.Fp8TokenGroups())
    with pytest.raises(ValueError, match="same input format"):
        _declare_branch(bj.Topology(), read=fp8)
    at_exit = bj.declare_ffn(update=bj.designs.PlainAdd(applied_at_exit=True))
    with pytest.raises(NotImplementedError, match="cannot be applied_at_exit"):
        _declare_branch(bj.Topology(attn_tp=2), source=at_exit)


def test_an_input_scattered_batch_is_rejected_with_the_reason():
    """A stack with branches binds no input-scattered (sequence-parallel) path; such a batch
    raises the guide's error with the reason."""
    first, _ = _declare_branch(bj.Topology(attn_tp=2))
    stream = residual_stream.start(
        bj.BatchFacts.input_scattered(bj.Topology(attn_tp=2), None, rows_per_block=4)
    )
    with pytest.raises(NotImplementedError, match="active INPUT_SCATTERED batch.*branch transport"):
        first.prepare(jnp.zeros((4, HIDDEN)), stream)


def test_the_plan_shows_fork_and_merge_edges_and_where_the_branch_sum_completes():
    """describe_stages names a branch's fork and merge edges, the moves at the fork and where
    its last output's sum completes."""
    with jax.enable_x64(True):
        part = _plans(DEFERRING).stacks[0].layers[0].parts[0]
    stages = [(0, "attention", part.boundary.plan)] + [
        (0, f"branch {i}", b.plan) for i, b in enumerate(part.branch)
    ]
    source, first, last = bj.report.describe_stages(stages, bj.BatchVariant.ORDINARY)
    assert "fork" not in source and "merge" not in source
    assert first["fork"]["edge"] == bj.declare.EdgeKind.BRANCH_FORK.value
    assert first["entries"] == [] and "merge" not in first
    assert last["merge"]["edge"] == bj.declare.EdgeKind.BRANCH_MERGE.value
    (completes,) = last["merge"]["branch_sum_completes"]
    assert completes["sum"].startswith("added unsummed to the source's output at the merge")
    assert "all-reduce over attn_tp" in completes["sum"]


class Nested(nnx.Module):
    """Attention, then an FFN with a branch [attention, FFN] whose attention is itself the
    source of a branch [FFN] (merged into the first branch before its FFN)."""

    def __init__(self, topology: bj.Topology, key):
        keys = iter(jax.random.split(key, 12))
        self.norm_a, self.norm_f, self.norm_f1 = (
            random_norm(next(keys), jnp.float64) for _ in range(3)
        )
        attn = lambda: StandInAttention(topology, next(keys), jnp.float64)  # noqa: E731
        ffn = lambda: StandInFfn(topology, next(keys), jnp.float64)  # noqa: E731
        self.attn, self.ffn, self.attn1, self.ffn1, self.ffn2 = attn(), ffn(), attn(), ffn(), ffn()
        self.final_norm = random_norm(next(keys), jnp.float64)
        with bj.layer_stack(topology, input_sum=bj.SumGroup.ATTN_TP):
            self.a, self.f = bj.append_stages(
                (bj.declare_attn(), self.norm_a), (bj.declare_ffn(), self.norm_f), owner=self
            )
            self.a1, self.f1 = bj.append_stages(
                (bj.declare_attn(), self.norm_f),
                (bj.declare_ffn(), self.norm_f1),
                owner=self,
                prepared_from=self.f,
            )
            (self.f2,) = bj.append_stages(
                (bj.declare_ffn(), self.norm_f), owner=self, prepared_from=self.a1.declaration
            )

    def __call__(self, x, batch):
        h, stream = self.a.prepare(x, residual_stream.start(batch))
        x, stream = self.a.finish(self.attn(h), stream)
        h, stream = self.f.prepare(x, stream)
        g, stream, branch = bj.adapters.branch_input(self.a1, self.f, h, stream)
        x, stream = self.f.finish(self.ffn(h), stream)
        k, branch, nested = bj.adapters.branch_input(self.f2, self.a1, g, branch)
        y, branch = self.a1.finish(self.attn1(g), branch)
        z, nested = self.f2.finish(self.ffn2(k), nested)
        z, nested = bj.adapters.branch_output(self.f2, z, nested)
        y, branch = bj.adapters.merge_branch(y, branch, z, nested)
        g, branch = self.f1.prepare(y, branch)
        y, branch = self.f1.finish(self.ffn1(g), branch)
        y, branch = bj.adapters.branch_output(self.f1, y, branch)
        x, stream = bj.adapters.merge_branch(x, stream, y, branch)
        return residual_stream.final_norm(x, stream, self.final_norm)

    def reference(self, x):
        rows = x + self.attn(self.norm_a(x))
        h = self.norm_f(rows)
        branch = rows + self.attn1(h) + self.ffn2(h)
        branch = branch + self.ffn1(self.norm_f1(branch))
        return self.final_norm(branch + self.ffn(h))


def test_a_branch_from_a_branch_stage_equals_one_device():
    """A branch whose source is a stage of another branch merges into that branch's stream."""
    topology = bj.Topology(attn_tp=2)
    with jax.enable_x64(True):
        model = Nested(topology, jax.random.key(4))
        x = jax.random.normal(jax.random.key(5), (ROWS, HIDDEN), jnp.float64)
        sharded = bj.ShardedModule(model, make_mesh(1, 2))
        spec = bj.BatchFacts(bj.BatchVariant.ORDINARY, topology, P())
        run = sharded.program(
            lambda m, x, b: m(x, b), in_specs=(P(None, "attn_tp"), spec), out_specs=P()
        )
        placed = jax.device_put(
            input_shares(x, 2), NamedSharding(make_mesh(1, 2), P(None, "attn_tp"))
        )
        got = run(sharded.leaves, placed, bj.BatchFacts.ordinary(topology))
        assert _error(got, model.reference(x)) < 1e-12


def test_scanned_layers_with_branches_equal_the_unrolled_stack():
    """Layers with branches scan (lax.scan over stacked parameters): the open branches close
    inside each layer, so the carry keeps its form."""
    model = Branched(LONGCAT * 2, 1, 2)
    with jax.enable_x64(True):
        run = built(model)
        x, counts = _inputs(1)
        stack = run.stacks[0]

        def body(stacks, x, batch):
            (stack,) = stacks
            stream = residual_stream.start(batch)
            out, stream = stack.layers[0](x, stream)
            layers = bj.StackedLayers(list(stack.layers)[1:-1], start=1)
            (out, stream), _ = layers.scan(
                lambda layer, carry, _: (layer(*carry), None), (out, stream)
            )
            out, stream = stack.layers[-1](out, stream)
            return residual_stream.final_norm(out, stream, stack.final_norm, skip_empty=True)

        sharded = bj.ShardedModule(nnx.List([stack]), make_mesh(1, 2))
        spec = bj.BatchFacts(bj.BatchVariant.ORDINARY, model.topology, P())
        in_rows = P(None, "attn_tp")
        scanned = sharded.program(body, in_specs=(in_rows, spec), out_specs=P())
        got = scanned(sharded.leaves, run.place(x), run.batch(x, counts))
        assert _error(got, run.run(x, counts)) < 1e-12


def test_an_unpadded_batch_runs_through_branches():
    """Rows that do not divide over attention TP (the unpadded variant, where an FFN on its own
    rows stays on the attention's rows) run through branches and equal one device."""
    model = Branched(LONGCAT_OWN, 1, 2)
    with jax.enable_x64(True):
        run = built(model)
        x = jax.random.normal(jax.random.key(5), (ROWS + 1, HIDDEN), jnp.float64)
        counts = np.array([ROWS])
        got = run.run(x, counts, bj.BatchVariant.UNPADDED)
        assert _error(got, reference(run.stacks, x, 1, counts)) < 1e-12
