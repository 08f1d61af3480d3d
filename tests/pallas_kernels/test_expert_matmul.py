"""expert_matmul: the gather-by-expert grouped matmul equals `lax.ragged_dot` on the rows it
covers, in the Pallas interpreter (CPU) and compiled for Triton (GPU only)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import moe
from pallas_kernels.expert_matmul import (
    ExpertMatmulBlocks,
    expert_matmul,
    expert_matmul_reference,
)

BLOCKS = ExpertMatmulBlocks(block_rows=16, block_n=128, block_k=64)


def case(group_sizes, k=128, n=256, dtype=jnp.float32, seed=0):
    """Rows filling `group_sizes` plus 3 rows past them; weights differ per group."""
    m = sum(group_sizes) + 3
    kr, kw = jax.random.split(jax.random.key(seed))
    rows = jax.random.normal(kr, (m, k), jnp.float32).astype(dtype)
    weights = jax.random.normal(kw, (len(group_sizes), k, n), jnp.float32).astype(dtype)
    return rows, weights, jnp.asarray(group_sizes, jnp.int32)


@pytest.mark.parametrize(
    "group_sizes",
    [(3, 0, 17, 0, 0, 1), (0, 0, 0, 5), (40,)],
    ids=["empty-and-two-row-blocks", "last-only", "one-group-three-blocks"],
)
def test_interpreted_kernel_matches_ragged_dot(group_sizes):
    """Every covered row equals ragged_dot's: empty groups skipped, a group spanning several
    row blocks, groups starting mid-block."""
    rows, weights, sizes = case(group_sizes)
    covered = sum(group_sizes)
    got = expert_matmul(rows, weights, sizes, blocks=BLOCKS, interpret=True)[:covered]
    want = expert_matmul_reference(rows, weights, sizes)[:covered]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_a_row_read_with_the_wrong_weights_would_show():
    """The check above notices a row given its neighbour group's weights."""
    rows, weights, sizes = case((3, 0, 17, 0, 0, 1))
    shifted = expert_matmul_reference(rows, weights, jnp.asarray([4, 0, 16, 0, 0, 1]))
    want = expert_matmul_reference(rows, weights, sizes)
    assert not np.allclose(np.asarray(shifted[:21]), np.asarray(want[:21]), atol=1e-2)


def test_bad_shapes_and_tilings_are_rejected():
    rows, weights, sizes = case((4, 4))
    with pytest.raises(ValueError, match="does not divide"):
        expert_matmul(rows, weights, sizes, blocks=ExpertMatmulBlocks(block_n=96))
    with pytest.raises(ValueError, match="group_sizes"):
        expert_matmul(rows, weights, sizes[:1])


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="Triton runs on GPU only")
def test_pallas_triton_layer_matches_ragged_dot_on_gpu():  # pragma: no cover - GPU only
    """On a GPU, the MoE expert outputs through PALLAS_TRITON equal RAGGED_DOT's (bf16)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((24, 256)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((256, 16)), jnp.bfloat16)
    gate, up = (jnp.asarray(rng.standard_normal((16, 256, 128)) / 16, jnp.bfloat16) for _ in "gu")
    down = jnp.asarray(rng.standard_normal((16, 128, 256)) / 11, jnp.bfloat16)
    routing = moe.route(x, router, top_k=4, renormalize=True)
    outs = [
        jax.jit(moe.expert_outputs, static_argnames="impl")(x, routing, gate, up, down, impl=impl)
        for impl in (moe.GroupedMatmulImpl.RAGGED_DOT, moe.GroupedMatmulImpl.PALLAS_TRITON)
    ]
    want, got = (np.asarray(o, np.float32) for o in outs)
    assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))
