"""The sharded runner: weights built into their shards, check_vma, buckets, on-device serving."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from boundary_jax.fusions import AddRmsNorm, FusionProvider
from models.build import build_model
from models.config import PRESETS
from models.families import Qwen3MoeForCausalLM
from models.layers.moe import GroupedMatmulImpl
from models.rows import pack_sequences
from models.serving.runtime import ShardedCausalLM, bucket, cache_length
from models.serving.sampling import Sampling

PROMPTS = [[5, 7, 9, 11, 2], [3], [8, 8, 1]]


@pytest.fixture(scope="module")
def runner() -> ShardedCausalLM:
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    mesh = bj.make_mesh(topology)
    return ShardedCausalLM(build_model(PRESETS["tiny-mistral"], topology, mesh=mesh), mesh)


def test_check_vma_stays_on_with_pallas_kernels_bound():
    """The varying-axes check stays on by default, also with fusion candidates bound and with
    Pallas expert kernels: each kernel declares how its outputs vary."""
    topology = bj.Topology(attn_tp=2)
    mesh = bj.make_mesh(topology)
    config = PRESETS["tiny-mistral"]
    assert ShardedCausalLM(build_model(config, topology), mesh).check_vma
    norm = AddRmsNorm("cpu", None)
    fused = FusionProvider(attn_input=(norm,), ffn_input=(norm,))
    assert ShardedCausalLM(build_model(config, topology, fusions=fused), mesh).check_vma
    pallas = Qwen3MoeForCausalLM(
        PRESETS["tiny-qwen3-moe"],
        topology,
        grouped_matmul=GroupedMatmulImpl.PALLAS_TRITON,
        rngs=nnx.Rngs(0),
    )
    assert ShardedCausalLM(pallas, mesh).check_vma


def test_buckets_are_fixed_sizes():
    """Sizes round up to powers of two (multiples of TP); cache lengths to a fixed list."""
    assert [bucket(n) for n in (1, 2, 3, 9, 64)] == [1, 2, 4, 16, 64]
    assert bucket(3, 2) == 4 and bucket(1, 4) == 4 and bucket(5, 6) == 12
    assert cache_length(20, 4096) == 128 and cache_length(129, 4096) == 256
    assert cache_length(3000, 2048) == 2048


def test_generate_shares_programs_across_nearby_request_shapes(runner):
    """Prompts of other lengths and counts within one bucket compile no new program."""
    runner.generate(PROMPTS, 3)
    sizes = runner.compiled_shapes()
    runner.generate([[4, 4, 4, 4], [1, 2]], 2)
    assert runner.compiled_shapes() == sizes


def test_placed_prefill_then_decode_equals_generate(runner):
    """The placed-input API (prefill, then two decode calls) gives generate()'s tokens."""
    want = runner.generate(PROMPTS, 5)
    packed = runner.pack(PROMPTS, bucketed=True)
    caches = runner.new_caches(packed.decode_rows_per_rank, 128)
    key = jax.random.key(0)
    last_rows = runner.place_array(packed.last_row_index())
    first, caches = runner.prefill(*runner.place(packed), caches, last_rows, key)
    from models.rows import RowsPhase, TokenRows, decode_rows

    lengths = np.asarray(packed.lengths, np.int32)
    rows, batch = runner.place(decode_rows(packed, np.zeros_like(lengths), lengths))
    rows = TokenRows(first, rows.positions, rows.segment_ids, RowsPhase.DECODE)
    out, caches = runner.decode(rows, batch, caches, key, 2, capacity=4)
    rows = TokenRows(out[1], rows.positions + 2, rows.segment_ids, RowsPhase.DECODE)
    rest, caches = runner.decode(rows, batch, caches, key, 2, capacity=4)
    tokens = np.concatenate([np.asarray(first)[None], np.asarray(out[:2]), np.asarray(rest[:2])])
    np.testing.assert_array_equal(tokens[:, packed.slot_order()].T, want)


def test_sampled_generation_is_reproducible_by_seed(runner):
    """Sampling on the device: one seed gives one continuation; token ids stay in the vocab."""
    sampling = Sampling(1.0, top_k=20, top_p=0.9)
    first = runner.generate(PROMPTS, 6, sampling=sampling, seed=1)
    again = runner.generate(PROMPTS, 6, sampling=sampling, seed=1)
    np.testing.assert_array_equal(first, again)
    assert first.shape == (3, 6) and first.dtype == np.int32
    assert (first >= 0).all() and (first < runner.config.vocab_size).all()
    others = [runner.generate(PROMPTS, 6, sampling=sampling, seed=s) for s in (2, 3, 4)]
    assert any(not np.array_equal(first, other) for other in others)


def test_runner_holds_no_unsharded_weights(runner):
    """Every parameter the runner keeps is split over the mesh as its spec says."""
    for _, variable in nnx.to_flat_state(runner.state):
        value = variable[...]
        assert isinstance(value, jax.Array)
        assert len(value.sharding.device_set) == 4
    assert not hasattr(runner, "_model")
    assert jnp.issubdtype(runner.dtype, jnp.floating)


def test_rows_with_a_sequence_bound_give_the_same_logits(runner):
    """Rows packed with `max_sequence_rows` (a static field of the rows) run through the
    runner's program, their attention blocked, with the unbounded logits."""
    sequences = PROMPTS * 4
    packed = [
        pack_sequences(sequences, runner.topology, rows_per_rank=64, max_sequence_rows=bound)
        for bound in (5, None)
    ]
    bounded, unbounded = (np.asarray(runner.forward_rows(p)) for p in packed)
    np.testing.assert_allclose(bounded, unbounded, rtol=1e-5, atol=1e-5)
