"""expert_matmul: the gather-by-expert grouped matmul equals `lax.ragged_dot` on the rows it
covers, in the Pallas interpreter (CPU) and compiled for Triton (GPU only)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import boundary_jax as bj
from models.layers import moe
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
    gate_up = jnp.asarray(rng.standard_normal((16, 256, 2, 128)) / 16, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((16, 128, 256)) / 11, jnp.bfloat16)
    routing = moe.route(x, router, top_k=4, renormalize=True)
    outs = [
        jax.jit(moe.expert_outputs, static_argnames="impl")(x, routing, gate_up, down, impl=impl)
        for impl in (moe.GroupedMatmulImpl.RAGGED_DOT, moe.GroupedMatmulImpl.PALLAS_TRITON)
    ]
    want, got = (np.asarray(o, np.float32) for o in outs)
    assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


def test_gpu_by_size_picks_the_kernel_by_routed_rows(monkeypatch):
    """GPU_BY_SIZE runs the Triton kernel up to TRITON_MAX_ROUTED_ROWS rows, the Hopper kernel
    above (both stood in for by ragged_dot, recording which ran)."""
    ran = []

    def triton(rows, weights, group_sizes, *, blocks):
        ran.append(("triton", rows.shape[0]))
        return expert_matmul_reference(rows, weights, group_sizes)

    def hopper(rows, weights, *, group_sizes, **tiling):
        ran.append(("hopper", rows.shape[0]))
        return expert_matmul_reference(rows, weights, group_sizes)

    monkeypatch.setattr(moe, "expert_matmul", triton)
    monkeypatch.setattr(moe, "_ragged_dot_mgpu", type("Mosaic", (), {"ragged_dot": hopper}))
    weights = jnp.zeros((4, 128, 128), jnp.bfloat16)
    sizes = jnp.asarray([1, 0, 2, 1], jnp.int32)
    limit = moe.TRITON_MAX_ROUTED_ROWS
    for m in (8, limit, limit + 8):
        rows = jnp.zeros((m, 128), jnp.bfloat16)
        moe._grouped_matmul(
            rows, weights, group_sizes=sizes, impl=moe.GroupedMatmulImpl.GPU_BY_SIZE
        )
    assert ran == [("triton", 8), ("triton", limit), ("hopper", limit + 8)]
    # Expert widths neither kernel tiles (a tiny test model's 16) fall back to ragged_dot.
    ran.clear()
    narrow = jnp.ones((4, 128, 16), jnp.bfloat16)
    for m in (8, limit + 8):
        rows = jnp.ones((m, 128), jnp.bfloat16)
        got = moe._grouped_matmul(
            rows, narrow, group_sizes=sizes, impl=moe.GroupedMatmulImpl.GPU_BY_SIZE
        )
        np.testing.assert_allclose(np.asarray(got[:4], np.float32), 128.0)
    assert ran == []


def test_gpu_by_size_pads_prefill_layers_and_falls_back_to_the_hopper_kernel(monkeypatch):
    """A layer of more than TRITON_MAX_ROUTED_ROWS routed rows runs PADDED_BATCHED, with the
    Hopper kernel past its buckets; a decode-sized layer runs the Triton kernel (the kernels
    stood in for by ragged_dot, recording which ran)."""
    ran = []

    def triton(rows, weights, group_sizes, *, blocks):
        ran.append("triton")
        return expert_matmul_reference(rows, weights, group_sizes)

    def hopper(rows, weights, *, group_sizes, **tiling):
        ran.append("hopper")
        return expert_matmul_reference(rows, weights, group_sizes)

    padded = moe._padded_expert_outputs

    def record_padded(x, rows, weights, capacity):
        ran.append(f"padded {capacity}")
        return padded(x, rows, weights, capacity)

    monkeypatch.setattr(moe, "expert_matmul", triton)
    monkeypatch.setattr(moe, "_ragged_dot_mgpu", type("Mosaic", (), {"ragged_dot": hopper}))
    monkeypatch.setattr(moe, "_padded_expert_outputs", record_padded)
    rng = np.random.default_rng(0)
    gate_up = jnp.asarray(rng.standard_normal((4, 128, 2, 128)) / 11, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((4, 128, 128)) / 11, jnp.bfloat16)
    for tokens in (4, moe.TRITON_MAX_ROUTED_ROWS // 2 + 4):  # top-2: 8 and 2056 rows
        x = jnp.asarray(rng.standard_normal((tokens, 128)), jnp.bfloat16)
        chosen = np.stack([rng.permutation(4)[:2] for _ in range(tokens)]).astype(np.int32)
        routing = moe.Routing(jnp.full((tokens, 2), 0.5), jnp.asarray(chosen))
        got = moe.expert_outputs(x, routing, gate_up, down, impl=moe.GroupedMatmulImpl.GPU_BY_SIZE)
        want = moe.expert_outputs(x, routing, gate_up, down, impl=moe.GroupedMatmulImpl.RAGGED_DOT)
        chex.assert_trees_all_close(got.astype(jnp.float32), want.astype(jnp.float32), atol=5e-2)
    # 2056 rows over 4 experts: an even share of 514, buckets of 1.25 and 1.5 times it.
    # Two grouped matmuls per path: gate | up as one, then down.
    assert ran == ["triton"] * 2 + ["padded 704", "padded 832"] + ["hopper"] * 2


def test_pallas_experts_turn_the_varying_axes_check_off():
    """A sharded MoE model whose experts run Pallas kernels runs its shard_map with
    check_vma=False (Pallas kernels need it); with lax.ragged_dot the check stays on."""
    from flax import nnx

    from models.config import PRESETS
    from models.families import Qwen3MoeForCausalLM
    from models.serving.runtime import ShardedCausalLM

    topology = bj.Topology(attn_tp=2)
    mesh = bj.make_mesh(topology)
    config = PRESETS["tiny-qwen3-moe"]
    for impl, check_vma in (
        (moe.GroupedMatmulImpl.RAGGED_DOT, True),
        (moe.GroupedMatmulImpl.PALLAS_TRITON, False),
    ):
        model = Qwen3MoeForCausalLM(config, topology, grouped_matmul=impl, rngs=nnx.Rngs(0))
        assert ShardedCausalLM(model, mesh).check_vma is check_vma
