"""SwiGLU over full TP: the rank partials sum to the unsharded FFN."""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
from models.config import Activation
from models.layers.mlp import SwiGLU
from tests.models import MESHES, make_mesh, run_sharded, sum_over, unsharded_copy

HIDDEN, INTERMEDIATE = 16, 64


# float32 on attention TP 4 and DP 2 x TP 2 (the full TP group spanning DP), bfloat16 on DP 2 x
# TP 2 by default; the other meshes under -m slow.
DEFAULT_CASES = {(1, 4, jnp.float32), (2, 2, jnp.float32), (2, 2, jnp.bfloat16)}


@pytest.mark.parametrize(
    "dp,tp,dtype,tol",
    [
        pytest.param(
            *mesh, dtype, tol, marks=() if (*mesh, dtype) in DEFAULT_CASES else pytest.mark.slow
        )
        for mesh in MESHES
        for dtype, tol in [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)]
    ],
)
def test_swiglu_partials_sum_to_unsharded(dp, tp, dtype, tol):
    """Summed over full TP (attn_dp x attn_tp) the partials equal the one-device SwiGLU."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    make = lambda t: SwiGLU(HIDDEN, INTERMEDIATE, topology=t, dtype=dtype, rngs=nnx.Rngs(0))  # noqa: E731
    mlp = make(topology)
    entry = topology.shard_entry(bj.SumGroup.FULL_TP)
    spec = nnx.get_partition_spec(nnx.state(mlp)).gate_up_proj.kernel.get_value()
    assert spec == P(None, None, entry)
    x = jax.random.normal(jax.random.key(1), (8, HIDDEN), jnp.float32).astype(dtype)

    def body(module, x):
        return sum_over(module(x), topology, bj.SumGroup.FULL_TP)

    got = run_sharded(mlp, make_mesh(dp, tp), body, (x,), (P(),), P())
    want = unsharded_copy(mlp, make)(x)
    chex.assert_trees_all_close(got.astype(jnp.float32), want.astype(jnp.float32), atol=tol)


def test_rejects_intermediate_not_divisible_by_tp():
    """intermediate_size must divide over the full TP group, named in the error."""
    with pytest.raises(ValueError, match=r"intermediate_size \(60\).*full TP size \(8"):
        SwiGLU(16, 60, topology=bj.Topology(attn_dp=2, attn_tp=4), rngs=nnx.Rngs(0))


def test_geglu_uses_the_tanh_gelu():
    """With Activation.GELU_TANH the gate goes through the tanh-form GELU (Gemma's GeGLU),
    which differs from SiLU and from the exact GELU."""
    topology = bj.Topology()
    mlp = SwiGLU(
        HIDDEN, INTERMEDIATE, topology=topology, activation=Activation.GELU_TANH, rngs=nnx.Rngs(0)
    )
    x = 3 * jax.random.normal(jax.random.key(1), (8, HIDDEN), jnp.float32)
    kernel = mlp.gate_up_proj.kernel[...]
    gate, up = x @ kernel[:, 0], x @ kernel[:, 1]
    tanh_gelu = 0.5 * gate * (1 + jnp.tanh(jnp.sqrt(2 / jnp.pi) * (gate + 0.044715 * gate**3)))
    want = (tanh_gelu * up) @ mlp.down_proj.kernel[...]
    chex.assert_trees_all_close(mlp(x), want, atol=1e-5)
    exact = (jax.nn.gelu(gate, approximate=False) * up) @ mlp.down_proj.kernel[...]
    assert float(jnp.max(jnp.abs(exact - want))) > 1e-4
