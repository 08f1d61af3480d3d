"""Model-facing primitives that complete a small sum of their own: the sharded RMSNorm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
from boundary_jax.residual import rms_norm

from .standin import make_mesh

MESHES = [(1, 4, bj.SumGroup.ATTN_TP), (2, 2, bj.SumGroup.ATTN_TP), (2, 4, bj.SumGroup.TP)]


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
        return bj.sharded_rms_norm(x, weight, topology, group, eps=1e-6)

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
