"""The ungated MLP over full TP (relu^2 or xIELU): the rank partials sum to the unsharded MLP;
xIELU equals transformers' formula on both branches, and its alphas get their gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
from models.config import Activation
from models.layers.activations import Xielu, relu2
from models.layers.buffer import Buffer
from models.layers.mlp import SwiGLU
from models.layers.ungated_mlp import UngatedMlp
from tests.models import make_mesh, run_sharded, sum_over, unsharded_copy

HIDDEN, INTERMEDIATE = 16, 64
# Off transformers' starting values, and alpha_p far from alpha_n, so a swap shows.
RAW_ALPHA_P, RAW_ALPHA_N, BETA, EPS = 1.3, -0.6, 0.35, -1e-6


def xielu_reference(x: np.ndarray, alpha_p: float, alpha_n: float, beta: float, eps: float):
    """transformers' `XIELUActivation._xielu_python`, in float64 NumPy."""
    softplus = lambda v: np.log1p(np.exp(v))  # noqa: E731
    a_p, a_n = softplus(alpha_p), beta + softplus(alpha_n)
    negative = (np.expm1(np.minimum(x, eps)) - x) * a_n + beta * x
    return np.where(x > 0, a_p * x * x + beta * x, negative)


def off_default_xielu(dtype=jnp.float32) -> Xielu:
    act = Xielu(dtype=dtype)
    act.alpha_p[...] = jnp.full((1,), RAW_ALPHA_P, dtype)
    act.alpha_n[...] = jnp.full((1,), RAW_ALPHA_N, dtype)
    act.beta[...] = jnp.asarray(BETA, dtype)
    return act


def test_xielu_starts_at_transformers_defaults():
    """A fresh xIELU gives softplus(alpha_p) = 0.8 and beta + softplus(alpha_n) = 0.8, beta 0.5,
    eps -1e-6; beta and eps are buffers (untrained), the alphas [1] parameters."""
    act = Xielu()
    assert float(jax.nn.softplus(act.alpha_p[0])) == pytest.approx(0.8, rel=1e-6)
    assert float(act.beta[...] + jax.nn.softplus(act.alpha_n[0])) == pytest.approx(0.8, rel=1e-6)
    assert (float(act.beta[...]), float(act.eps[...])) == pytest.approx((0.5, -1e-6))
    assert act.alpha_p.shape == act.alpha_n.shape == (1,)
    assert isinstance(act.beta, Buffer) and isinstance(act.eps, Buffer)
    assert not isinstance(act.alpha_p, Buffer) and not isinstance(act.alpha_n, Buffer)


def test_xielu_equals_transformers_on_both_branches():
    """float32 xIELU within 1e-6 (relative) of the float64 formula for inputs on both sides of
    0, the band (eps, 0] included; the alphas swapped differ (the golden mutant's check)."""
    x = np.concatenate([np.linspace(-6, 4, 201), [0.0, -1e-7, -1e-6, 1e-7]])
    got = np.asarray(off_default_xielu()(jnp.asarray(x, jnp.float32)))
    want = xielu_reference(x, RAW_ALPHA_P, RAW_ALPHA_N, BETA, EPS)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    swapped = xielu_reference(x, RAW_ALPHA_N, RAW_ALPHA_P, BETA, EPS)
    assert np.max(np.abs(swapped - want)) > 1.0


def test_xielu_rejects_starting_values_no_softplus_gives():
    """alpha_n must exceed beta (its softplus is alpha_n - beta), named in the error."""
    with pytest.raises(ValueError, match=r"alpha_n > beta.*alpha_n=0.4, beta=0.5"):
        Xielu(alpha_n=0.4)


def test_xielu_alphas_get_their_gradients():
    """d sum(xielu(x)) / d alpha_p = sigmoid(alpha_p) * sum over x > 0 of x^2, and d / d alpha_n
    = sigmoid(alpha_n) * sum over x <= 0 of (expm1(min(x, eps)) - x): each alpha gets its own
    branch's gradient."""
    act = off_default_xielu()
    x = jax.random.normal(jax.random.key(0), (64,), jnp.float32) * 2
    graphdef, params, rest = nnx.split(act, nnx.Param, ...)
    grads = jax.grad(lambda p: nnx.merge(graphdef, p, rest)(x).sum())(params)
    x64 = np.asarray(x, np.float64)
    sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    want_p = sigmoid(RAW_ALPHA_P) * np.sum(np.where(x64 > 0, x64 * x64, 0))
    negative = np.expm1(np.minimum(x64, EPS)) - x64
    want_n = sigmoid(RAW_ALPHA_N) * np.sum(np.where(x64 > 0, 0, negative))
    assert float(grads["alpha_p"][0]) == pytest.approx(want_p, rel=1e-5)
    assert float(grads["alpha_n"][0]) == pytest.approx(want_n, rel=1e-5)


ACTIVATIONS = {"relu2": lambda dtype: relu2, "xielu": off_default_xielu}


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dp,tp", [(2, 2), (1, 4)])
def test_ungated_partials_sum_to_unsharded(activation, dp, tp):
    """Summed over full TP (attn_dp x attn_tp) the partials equal the one-device
    `down(act(up(x)))`, each rank its own columns of the drawn weights."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)

    def make(t):
        act = ACTIVATIONS[activation](jnp.float32)
        return UngatedMlp(HIDDEN, INTERMEDIATE, activation=act, topology=t, rngs=nnx.Rngs(0))

    mlp = make(topology)
    entry = topology.shard_entry(bj.SumGroup.FULL_TP)
    specs = nnx.get_partition_spec(nnx.state(mlp))
    assert specs.up_proj.kernel.get_value() == P(None, entry)
    assert specs.down_proj.kernel.get_value() == P(entry, None)
    x = jax.random.normal(jax.random.key(1), (8, HIDDEN), jnp.float32)

    def body(module, x):
        return sum_over(module(x), topology, bj.SumGroup.FULL_TP)

    got = run_sharded(mlp, make_mesh(dp, tp), body, (x,), (P(),), P())
    reference = unsharded_copy(mlp, make)
    want = reference(x)
    up, down = reference.up_proj.kernel[...], reference.down_proj.kernel[...]
    assert float(jnp.min(x @ up)) < -1  # inputs reach the activation's negative side
    chex.assert_trees_all_close(want, reference.act_fn(x @ up) @ down, atol=1e-5)
    chex.assert_trees_all_close(got, want, atol=1e-5)


def test_ungated_rejects_intermediate_not_divisible_by_tp():
    """intermediate_size must divide over the full TP group, named in the error."""
    with pytest.raises(ValueError, match=r"intermediate_size \(60\).*full TP size \(8"):
        UngatedMlp(
            16, 60, activation=relu2, topology=bj.Topology(attn_dp=2, attn_tp=4), rngs=nnx.Rngs(0)
        )


@pytest.mark.parametrize("activation", [Activation.RELU2, Activation.XIELU])
def test_swiglu_refuses_an_ungated_activation(activation):
    """The gated MLP takes a gate activation only; an ungated one names the ungated MLP."""
    with pytest.raises(ValueError, match="ungated activation is .*UngatedMlp"):
        SwiGLU(16, 64, topology=bj.Topology(), activation=activation, rngs=nnx.Rngs(0))
