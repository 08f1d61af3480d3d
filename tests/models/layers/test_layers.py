"""Parallel linear layers, vocab-parallel embedding and LM head: shards recombine exactly."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
from models.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tests.models import MESHES, make_mesh, row_spec, run_sharded, sum_over

ROWS = 6
VOCAB = 250
HIDDEN = 16
GROUPS = [bj.SumGroup.ATTN_TP, bj.SumGroup.FULL_TP, None]
# Attention TP 4 and DP 2 x TP 2 by default (TP alone, and the full TP group spanning DP); one
# device, TP 2 and TP 8 under -m slow.
LAYER_MESHES = [
    pytest.param(*mesh, marks=() if mesh in ((1, 4), (2, 2)) else pytest.mark.slow)
    for mesh in MESHES
]


def inputs(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.name if g else "replicated")
@pytest.mark.parametrize("dp,tp", LAYER_MESHES)
def test_column_parallel_columns_concatenate(dp, tp, group):
    """Each rank's output columns, concatenated over the group, equal x @ kernel."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    layer = ColumnParallelLinear(HIDDEN, 32, group=group, topology=topology, rngs=nnx.Rngs(1))
    x = inputs((ROWS, HIDDEN))
    entry = None if group is None else topology.shard_entry(group)
    got = run_sharded(layer, make_mesh(dp, tp), lambda m, x: m(x), (x,), (P(),), P(None, entry))
    chex.assert_trees_all_close(got, x @ layer.kernel[...], atol=1e-5)


@pytest.mark.parametrize("group", GROUPS[:2], ids=lambda g: g.name)
@pytest.mark.parametrize("dp,tp", LAYER_MESHES)
def test_row_parallel_partials_sum_to_full(dp, tp, group):
    """The rank partials, summed over the group by the caller, equal x @ kernel."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    layer = RowParallelLinear(32, HIDDEN, group=group, topology=topology, rngs=nnx.Rngs(2))
    x = inputs((ROWS, 32))

    def body(module, x):
        return sum_over(module(x), topology, group)

    got = run_sharded(
        layer, make_mesh(dp, tp), body, (x,), (P(None, topology.shard_entry(group)),), P()
    )
    chex.assert_trees_all_close(got, x @ layer.kernel[...], atol=1e-5)


def token_ids(dp):
    """Per DP rank: real ids (first, last), ids in the padding range and -1 (padding rows)."""
    rng = np.random.default_rng(dp)
    ids = rng.integers(0, VOCAB, size=(dp, ROWS + 4))
    ids[:, :4] = [0, VOCAB - 1, VOCAB + 3, -1]
    return jnp.asarray(ids.reshape(-1), jnp.int32)


@pytest.mark.parametrize("dp,tp", LAYER_MESHES)
def test_embedding_partials_sum_to_lookup(dp, tp):
    """Summed over attention TP the partials are the table rows; out-of-vocab ids give zeros."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, topology=topology, rngs=nnx.Rngs(3))
    table = embed.embedding[...]
    assert table.shape == (-(-VOCAB // tp) * tp, HIDDEN)
    chex.assert_trees_all_equal(table[VOCAB:], jnp.zeros_like(table[VOCAB:]))
    ids = token_ids(dp)
    spec = row_spec(topology)

    def body(module, ids):
        return sum_over(module(ids), topology, bj.SumGroup.ATTN_TP)

    got = run_sharded(embed, make_mesh(dp, tp), body, (ids,), (spec,), row_spec(topology, None))
    real = (ids >= 0) & (ids < VOCAB)
    want = jnp.where(real[:, None], table[jnp.clip(ids, 0, VOCAB - 1)], 0)
    chex.assert_trees_all_close(got, want, atol=0)


def test_vocab_250_over_8_shards():
    """Vocab 250 over 8 attention-TP ranks: 32 rows a rank, the last rank holds 6 padding rows."""
    topology = bj.Topology(attn_tp=8)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, topology=topology, rngs=nnx.Rngs(4))
    ids = jnp.array([224, 249, 250, 255], jnp.int32)
    mesh = make_mesh(1, 8)
    per_rank = run_sharded(embed, mesh, lambda m, ids: m(ids)[None], (ids,), (P(),), P("attn_tp"))
    assert per_rank.shape == (8, 4, HIDDEN)
    nonzero = np.asarray(jnp.any(per_rank != 0, axis=-1))
    np.testing.assert_array_equal(nonzero[7], [True, True, False, False])
    assert not nonzero[:7].any()


@pytest.mark.parametrize("tied", [False, True], ids=["own-kernel", "tied"])
@pytest.mark.parametrize("dp,tp", LAYER_MESHES)
def test_lm_head_gathers_real_vocab(dp, tp, tied):
    """Logits are x @ W over the real vocab; values in padding columns never reach the output."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    rngs = nnx.Rngs(5)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, topology=topology, rngs=rngs)
    head = ParallelLMHead(
        HIDDEN, VOCAB, topology=topology, rngs=rngs, tied_embedding=embed if tied else None
    )
    if tied:
        assert head.kernel is None
        embed.embedding[...] = embed.embedding[...].at[VOCAB:].set(1e3)
        weight = embed.embedding[...].T
    else:
        head.kernel[...] = head.kernel[...].at[:, VOCAB:].set(1e3)
        weight = head.kernel[...]
    x = inputs((dp * ROWS, HIDDEN), seed=6)
    spec = row_spec(topology, None)
    got = run_sharded(head, make_mesh(dp, tp), lambda m, x: m(x), (x,), (spec,), spec)
    chex.assert_shape(got, (dp * ROWS, VOCAB))
    chex.assert_trees_all_close(got, x @ weight[:, :VOCAB], atol=1e-5)


def test_tied_head_shares_the_table():
    """A tied head adds no parameter: the state holds the embedding table once."""
    topology = bj.Topology(attn_tp=2)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, topology=topology, rngs=nnx.Rngs(0))
    head = ParallelLMHead(HIDDEN, VOCAB, topology=topology, rngs=nnx.Rngs(0), tied_embedding=embed)
    params = jax.tree.leaves(nnx.state(nnx.List([embed, head]), nnx.Param))
    assert len(params) == 1


def test_rejects_uneven_split_and_mismatched_tie():
    """Features that do not divide over the group, or a tie to another shape, fail at build."""
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    with pytest.raises(ValueError, match="out_features .* must divide evenly"):
        ColumnParallelLinear(8, 10, group=bj.SumGroup.FULL_TP, topology=topology, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features .* must divide evenly"):
        RowParallelLinear(6, 8, group=bj.SumGroup.FULL_TP, topology=topology, rngs=nnx.Rngs(0))
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, topology=topology, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="tied LM head"):
        ParallelLMHead(2 * HIDDEN, VOCAB, topology=topology, rngs=nnx.Rngs(0), tied_embedding=embed)


# TP 2 and 4 by default; one device under -m slow.
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2, 4])
def test_lm_head_greedy_equals_argmax_of_gathered_logits(tp):
    """The sharded greedy head picks argmax of the full logits, never a padding column."""
    from models.layers.linear import ParallelLMHead

    topology = bj.Topology(attn_tp=tp)
    mesh = make_mesh(1, tp)
    head = ParallelLMHead(16, 37, topology=topology, rngs=nnx.Rngs(0))  # 37: padded columns
    # All logits negative: a zero padding column would win a naive argmax.
    head.kernel[...] = -jnp.abs(head.kernel[...])
    x = jnp.abs(jax.random.normal(jax.random.key(1), (6, 16), jnp.float32))
    x = x.at[3].set(0.0)  # all-equal logits: the tie goes to token 0
    spec = P()
    got, logits = run_sharded(
        head, mesh, lambda m, x: (m.greedy(x), m(x)), (x,), (spec,), (spec, spec)
    )
    np.testing.assert_array_equal(np.asarray(got), np.argmax(np.asarray(logits), axis=-1))
    assert np.asarray(got)[3] == 0
