"""Model-facing primitives that complete a small sum of their own: the sharded RMSNorm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
from boundary_jax.designs import rms_norm
from pallas_kernels import axes

from .standin import make_mesh

MESHES = [(1, 4, bj.SumGroup.ATTN_TP), (2, 2, bj.SumGroup.ATTN_TP), (2, 4, bj.SumGroup.FULL_TP)]


@pytest.mark.parametrize("dp,tp,group", MESHES, ids=lambda v: getattr(v, "name", v))
def test_a_norm_over_columns_split_over_a_group_equals_the_whole_norm(dp, tp, group):
    """Each rank's columns normalized by the group's mean of squares equal the RMSNorm of the
    whole rows (float32); the local mean alone would not."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    mesh = make_mesh(dp, tp)
    cols = topology.shard_entry(group)
    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (6, 32)) * jnp.linspace(0.2, 3.0, 32)[None, :]
    weight = 1 + 0.2 * jax.random.normal(k2, (32,))

    def body(x, weight):
        return bj.ops.sharded_rms_norm(x, weight, topology, group, eps=1e-6)

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(None, cols), P(cols)), out_specs=P(None, cols))
    )
    placed = (
        jax.device_put(x, NamedSharding(mesh, P(None, cols))),
        jax.device_put(weight, NamedSharding(mesh, P(cols))),
    )
    want = rms_norm(x, weight, eps=1e-6)
    np.testing.assert_allclose(fn(*placed), want, rtol=1e-5, atol=1e-6)
    parts = topology.size(topology.sum_axes(group))
    local = jnp.concatenate(
        [
            rms_norm(block, w, eps=1e-6)
            for block, w in zip(jnp.split(x, parts, axis=1), jnp.split(weight, parts), strict=True)
        ],
        axis=1,
    )
    assert float(jnp.max(jnp.abs(local - want))) > 1e-2, "the inputs must need the group's sum"


def test_norms_of_two_inputs_share_one_all_reduce_and_allow_shared_columns():
    """sharded_rms_norms normalizes q-like columns split over attention TP and k-like heads each
    shared by two ranks (their squares and width counted alike) with one all-reduce."""
    topology = bj.Topology(attn_tp=4)
    mesh = make_mesh(1, 4)
    cols = topology.shard_entry(bj.SumGroup.ATTN_TP)
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (6, 32)) * jnp.linspace(0.2, 3.0, 32)[None, :]
    k = jax.random.normal(keys[1], (6, 16)) * jnp.linspace(3.0, 0.5, 16)[None, :]
    wq = 1 + 0.2 * jax.random.normal(keys[2], (32,))
    wk = 1 + 0.2 * jax.random.normal(keys[3], (16,))

    def body(q, k, wq, wk):
        head = bj.ops.shard_index(topology, bj.SumGroup.ATTN_TP) // 2  # 2 heads of 8, 2 ranks each
        k_mine = jax.lax.dynamic_slice_in_dim(k, head * 8, 8, axis=1)
        wk_mine = jax.lax.dynamic_slice_in_dim(wk, head * 8, 8)
        return bj.ops.sharded_rms_norms(
            (q, k_mine), (wq, wk_mine), topology, bj.SumGroup.ATTN_TP, eps=1e-6
        )

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(None, cols), P(), P(cols), P()),
            out_specs=(P(None, cols), P(None, cols)),
        )
    )
    args = (q, k, wq, wk)
    specs = (P(None, cols), P(), P(cols), P())
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
    got_q, got_k = fn(*placed)
    np.testing.assert_allclose(got_q, rms_norm(q, wq, eps=1e-6), rtol=1e-5, atol=1e-6)
    want_k = rms_norm(k, wk, eps=1e-6)  # rank r holds head r // 2
    want_k = jnp.concatenate([want_k[:, 0:8], want_k[:, 0:8], want_k[:, 8:16], want_k[:, 8:16]], 1)
    np.testing.assert_allclose(got_k, want_k, rtol=1e-5, atol=1e-6)
    report = bj.report.parse_hlo(fn.lower(*placed).compile().as_text())
    assert report.sequence(None) == ("all-reduce",)


def test_norms_reject_mismatched_inputs():
    """As many weights as inputs, all over the same rows."""
    topology = bj.Topology()
    with pytest.raises(ValueError, match="as many weights as inputs"):
        bj.ops.sharded_rms_norms((jnp.ones((2, 4)),), (), topology, bj.SumGroup.ATTN_TP, eps=1e-6)
    with pytest.raises(ValueError, match="same rows"):
        bj.ops.sharded_rms_norms(
            (jnp.ones((2, 4)), jnp.ones((3, 4))),
            (jnp.ones(4), jnp.ones(4)),
            topology,
            bj.SumGroup.ATTN_TP,
            eps=1e-6,
        )


# TP 4 and DP 2 x TP 2 by default; TP 8 (the TP 4 case on more ranks) under -m slow.
@pytest.mark.parametrize("dp,tp", [(1, 4), (2, 2), pytest.param(1, 8, marks=pytest.mark.slow)])
def test_vocab_parallel_cross_entropy_equals_the_gathered_one(dp, tp):
    """Per-row cross-entropy of vocab columns split over attention TP (padding columns past the
    vocabulary ignored, label -1 masked), and its gradient w.r.t. the logits, equal those of the
    whole rows; the summed loss over DP-split rows counts each row once."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    mesh = make_mesh(dp, tp)
    rows, vocab, columns = 8, 29, 32  # 3 padding columns
    k1, k2 = jax.random.split(jax.random.key(1))
    logits = 4 * jax.random.normal(k1, (rows, columns))
    labels = jax.random.randint(k2, (rows,), 0, vocab).at[3].set(-1)
    row_entry = topology.spec_entry((bj.TokenAxis.ATTN_DP,))
    col_entry = topology.shard_entry(bj.SumGroup.ATTN_TP)

    def body(logits, labels):
        losses = bj.ops.vocab_parallel_cross_entropy(
            logits, labels, topology, bj.SumGroup.ATTN_TP, vocab_size=vocab
        )
        return bj.ops.total_over_rows(losses, topology)

    total = jax.shard_map(
        body, mesh=mesh, in_specs=(P(row_entry, col_entry), P(row_entry)), out_specs=P()
    )
    placed = (
        jax.device_put(logits, NamedSharding(mesh, P(row_entry, col_entry))),
        jax.device_put(labels, NamedSharding(mesh, P(row_entry))),
    )
    got, grad = jax.jit(jax.value_and_grad(total))(*placed)

    def reference(logits):
        real = logits[:, :vocab]
        picked = jnp.take_along_axis(real, jnp.maximum(labels, 0)[:, None], axis=1)[:, 0]
        losses = jax.nn.logsumexp(real, axis=1) - picked
        return jnp.sum(jnp.where(labels >= 0, losses, 0))

    want, want_grad = jax.value_and_grad(reference)(logits)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert not np.any(np.asarray(grad)[:, vocab:]) and not np.any(np.asarray(grad)[3])


def test_group_order_is_a_stable_sort_by_group_with_its_inverse():
    groups = np.array([3, 0, 3, 1, 0, 3, 4, 1, 0, 3], np.int32)  # group 2 empty
    order, positions, sizes = jax.jit(bj.ops.group_order, static_argnums=1)(groups, 5)
    np.testing.assert_array_equal(order, np.argsort(groups, kind="stable"))
    np.testing.assert_array_equal(positions, np.argsort(np.argsort(groups, kind="stable")))
    np.testing.assert_array_equal(sizes, np.bincount(groups, minlength=5))
    with pytest.raises(ValueError, match=r"\[N\] group ids"):
        bj.ops.group_order(groups.reshape(2, 5), 5)


def test_group_order_keeps_the_varying_axes_so_gradients_of_gathers_hold():
    """Rows gathered by per-rank orders give the true gradient with `bj.ops.group_order`; the same
    orders typed invariant (as `jnp.argsort` typed them in JAX 0.12.0) sum the gradient across
    ranks too early."""
    mesh = make_mesh(1, 4)
    x = jax.random.normal(jax.random.key(2), (6, 3))
    weights = jax.random.normal(jax.random.key(3), (2, 4, 6, 3))
    axis = bj.MeshAxis.ATTN_TP.value

    def loss(sort):
        def body(x, weights):
            groups = (jnp.arange(6) * (jax.lax.axis_index(axis) + 1)) % 5
            order, positions = sort(groups)
            rows, back = jnp.take(x, order, axis=0), jnp.take(x, positions, axis=0)
            return jax.lax.psum(jnp.sum(rows * weights[0, 0] + back * weights[1, 0]), axis)

        in_specs = (P(), P(None, axis))
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P())

    def reference(x):
        total = 0.0
        for rank in range(4):
            order = np.argsort((np.arange(6) * (rank + 1)) % 5, kind="stable")
            back = np.argsort(order)
            total = total + jnp.sum(x[order] * weights[0, rank] + x[back] * weights[1, rank])
        return total

    want = jax.grad(reference)(x)
    weights = jax.device_put(weights, NamedSharding(mesh, P(None, axis)))
    x = jax.device_put(x, NamedSharding(mesh, P()))
    counted = jax.jit(jax.grad(loss(lambda g: bj.ops.group_order(g, 5)[:2])))(x, weights)
    np.testing.assert_allclose(counted, want, rtol=1e-6)

    def typed_invariant(groups):
        return tuple(map(axes.invariant_copy, bj.ops.group_order(groups, 5)[:2]))

    wrong = jax.jit(jax.grad(loss(typed_invariant)))(x, weights)
    assert float(jnp.max(jnp.abs(wrong - want))) > 1e-3  # the bug the varying orders avoid
