"""FP8 experts padded to capacity buckets (`Fp8GroupedImpl.PADDED_GPU_INTERPRET`: the wgmma
kernel in the Mosaic GPU interpreter; `GPU_BY_SIZE` above 2048 routed rows) against the same
layer's grouped reference products."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from models.config import MoeConfig
from models.layers.fp8_linear import Fp8Quantization
from models.layers.moe import fp8 as fp8_moe
from models.layers.moe.fp8 import Fp8MoeFfn
from models.layers.moe.routing import Routing
from pallas_kernels import compat
from pallas_kernels.fp8_matmul import Fp8GroupedImpl, Fp8MatmulImpl

pytestmark = pytest.mark.skipif(
    compat.gpu_interpret_params() is None, reason="this JAX has no Mosaic GPU interpreter"
)

HIDDEN, WIDTH, EXPERTS, TOKENS = 256, 128, 4, 48
# Top-2 over 4 experts: an even share of 24 rows, buckets of 32 and 40 rows.
CONFIG = MoeConfig(num_experts=EXPERTS, top_k=2, expert_intermediate_size=WIDTH, renormalize=True)


def layer(grouped: Fp8GroupedImpl) -> Fp8MoeFfn:
    """The same FP8 experts (same draw) whatever `grouped` runs them."""
    quantization = Fp8Quantization(grouped=grouped)
    topology = bj.Topology()
    return Fp8MoeFfn(
        HIDDEN, CONFIG, topology, quantization=quantization, dtype=jnp.float32, rngs=nnx.Rngs(3)
    )


def skewed_routing(busiest_load: int, offset: int = 0) -> Routing:
    """Top-2 choices of distinct experts, expert `offset` getting `busiest_load` rows and the
    others about an even share of the rest; weights differ per token and choice."""
    chosen = np.zeros((TOKENS, 2), np.int32)
    for t in range(TOKENS):
        others = [1 + (t + i) % (EXPERTS - 1) for i in range(2)]
        chosen[t] = [0, others[0]] if t < busiest_load else others
    weights = np.linspace(0.2, 0.8, TOKENS * 2).reshape(TOKENS, 2)
    return Routing(jnp.asarray(weights, jnp.float32), jnp.asarray(chosen + offset))


def inputs() -> jax.Array:
    # Features of different magnitudes per 128-group, so a scale read for the wrong group shows.
    x = jax.random.normal(jax.random.key(0), (TOKENS, HIDDEN))
    return x * (1 + jnp.arange(HIDDEN) // 128)[None, :]


@pytest.mark.parametrize(
    "busiest_load, branch",
    [
        pytest.param(32, "padded 32", marks=pytest.mark.slow),
        pytest.param(40, "padded 40", marks=pytest.mark.slow),
        (41, "grouped"),
    ],
)
def test_padded_fp8_experts_take_the_first_bucket_that_fits(monkeypatch, busiest_load, branch):
    """The busiest expert's load picks the branch (the first bucket that holds it, else the
    grouped products) and every branch equals the grouped reference. Every other branch is
    poisoned, so a wrong pick (a dropped row, or a needless fallback) shows."""
    routing = skewed_routing(busiest_load)
    assert np.bincount(np.asarray(routing.experts).reshape(-1)).max() == busiest_load
    x = inputs()
    want = np.asarray(jax.jit(layer(Fp8GroupedImpl.XLA).routed)(x, routing))
    batched, grouped = fp8_moe.fp8_batched_matmul, fp8_moe.fp8_grouped_matmul

    def poisoned_batched(x_values, *args, **kwargs):
        out = batched(x_values, *args, **kwargs)
        name = f"padded {x_values.shape[1]}"
        return out if name == branch else jnp.full_like(out, jnp.nan)

    def poisoned_grouped(*args, **kwargs):
        out = grouped(*args, **kwargs)
        return out if branch == "grouped" else jnp.full_like(out, jnp.nan)

    monkeypatch.setattr(fp8_moe, "fp8_batched_matmul", poisoned_batched)
    monkeypatch.setattr(fp8_moe, "fp8_grouped_matmul", poisoned_grouped)
    got = np.asarray(jax.jit(layer(Fp8GroupedImpl.PADDED_GPU_INTERPRET).routed)(x, routing))
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
    assert np.abs(want).min(axis=-1).max() > 0  # every (token, choice) has an output


def test_padded_fp8_experts_of_one_expert_parallel_rank_finalize_their_share():
    """A rank holding experts 2-5 of 6 (`expert_offset` 2): rows of experts 0 and 1 come out
    zero, and the finalized share (routing-weighted, plus a shared share) equals the grouped
    reference's. Expert 2, this rank's first, is the busiest."""
    routing = skewed_routing(30, offset=2)
    routing = Routing(routing.weights, jnp.where(routing.experts == 5, 0, routing.experts))
    x = inputs()
    shared = jnp.tanh(x)

    def run(grouped: Fp8GroupedImpl, combine: bool) -> np.ndarray:
        experts = layer(grouped)

        def call(x, routing, shared):
            return experts.routed(x, routing, expert_offset=2, shared=shared, combine=combine)

        return np.asarray(jax.jit(call)(x, routing, shared if combine else None))

    per_choice = run(Fp8GroupedImpl.PADDED_GPU_INTERPRET, False)
    elsewhere = np.asarray(routing.experts) < 2
    assert elsewhere.any() and np.all(per_choice[elsewhere] == 0)
    np.testing.assert_allclose(
        per_choice, run(Fp8GroupedImpl.XLA, False), atol=1e-5 * np.abs(per_choice).max()
    )
    got, want = run(Fp8GroupedImpl.PADDED_GPU_INTERPRET, True), run(Fp8GroupedImpl.XLA, True)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
    assert np.abs(want - np.asarray(shared)).max() > 1e-2  # the experts' share matters


@pytest.mark.parametrize("tokens, path", [(1024, "grouped"), (1032, "padded")])
def test_gpu_by_size_pads_the_experts_above_the_triton_rows(monkeypatch, tokens, path):
    """GPU_BY_SIZE runs the grouped products up to 2048 routed rows and the padded wgmma products
    (`PALLAS_GPU`) above: each product records the kernel asked for and runs XLA's reference, so
    the layer equals the XLA layer whichever path it takes."""
    chosen = np.stack([np.arange(tokens) % EXPERTS, (np.arange(tokens) + 1) % EXPERTS], 1)
    routing = Routing(jnp.full((tokens, 2), 0.5), jnp.asarray(chosen, jnp.int32))
    x = jax.random.normal(jax.random.key(1), (tokens, HIDDEN))
    want = np.asarray(jax.jit(layer(Fp8GroupedImpl.XLA).routed)(x, routing))
    batched, grouped, asked = fp8_moe.fp8_batched_matmul, fp8_moe.fp8_grouped_matmul, []

    def recorded(product, reference):
        def call(*args, impl, **kwargs):
            asked.append(impl)
            return product(*args, impl=reference, **kwargs)

        return call

    monkeypatch.setattr(fp8_moe, "fp8_batched_matmul", recorded(batched, Fp8MatmulImpl.XLA))
    monkeypatch.setattr(fp8_moe, "fp8_grouped_matmul", recorded(grouped, Fp8GroupedImpl.XLA))
    got = np.asarray(jax.jit(layer(Fp8GroupedImpl.GPU_BY_SIZE).routed)(x, routing))
    # Equal but for a few activations whose FP8 rounding flips (the two forms of the first
    # product differ in float32 rounding): a few hundred outputs of half a million.
    off = np.abs(got - want) > 1e-5 * np.abs(want).max()
    assert off.mean() < 2e-3 and np.abs(got - want).max() < 1e-2 * np.abs(want).max()
    if path == "grouped":
        assert asked == [Fp8GroupedImpl.GPU_BY_SIZE] * 2
    else:  # both products of each capacity branch, then the grouped fallback's two
        assert asked[:-2] == [Fp8MatmulImpl.PALLAS_GPU] * (len(asked) - 2) and len(asked) > 2
        assert asked[-2:] == [Fp8GroupedImpl.GPU_BY_SIZE] * 2
