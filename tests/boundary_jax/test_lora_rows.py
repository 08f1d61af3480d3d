"""The LoRA adapter's per-row values land on each stage's compute rows, moved as its input was."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import boundary_jax as bj
from boundary_jax import residual_stream
from tests.boundary_jax.cases import build
from tests.boundary_jax.standin import (
    ROWS,
    Setup,
    StandInAttention,
    make_batch,
    make_mesh,
    random_norm,
    sharded_forward,
)


def _row_ids(topology: bj.Topology) -> jax.Array:
    """The global index of each of this rank's attention rows (inside shard_map)."""
    dp = jax.lax.axis_index(topology.mesh_names((bj.TokenAxis.ATTN_DP,)))
    return dp * ROWS + jnp.arange(ROWS)


@pytest.mark.parametrize("scattered", [False, True], ids=["ordinary", "input-scattered"])
def test_lora_rows_follow_the_ffn_input_onto_every_dp_ranks_rows(scattered):
    """Under attention DP 2 x TP 2 the FFN over the full TP group computes on both DP ranks' rows:
    the attention's row values arrive gathered in that order, in ordinary and input-scattered
    batches."""
    setup = Setup(dp=2, tp=2, layers=1)
    topology = setup.topology
    model = build(setup)

    def body(model, x, batch):
        layer, stream = model.layers[0], residual_stream.start(batch)
        ids = _row_ids(topology)
        h, stream = layer.attn_boundary.prepare(x, stream)
        x, stream = layer.attn_boundary.finish(layer.attn(h), stream)
        h, stream = layer.ffn_boundary.prepare(x, stream)
        moved = bj.adapters.lora_rows(layer.ffn_boundary, stream, ids)
        assert moved.shape[0] == h.shape[0]
        return moved[:, None].astype(jnp.float32)

    batch = make_batch(setup, scattered, np.full(setup.dp, ROWS))
    fn, leaves, place = sharded_forward(
        model, setup, batch, body=body, out_layout=topology.layout()
    )
    x = jax.random.normal(jax.random.key(0), (setup.dp * ROWS, 16), jnp.float32)
    got = np.asarray(fn(leaves, place(x), batch))[:, 0]
    np.testing.assert_array_equal(got, np.arange(setup.dp * ROWS))


def test_lora_rows_needs_a_prepared_stream():
    """Asking a stage's rows on a stream no prepare wrote fails while tracing."""
    setup = Setup(dp=2, tp=2, layers=1)
    model = build(setup)

    def body(model, x, batch):
        layer, stream = model.layers[0], residual_stream.start(batch)
        return bj.adapters.lora_rows(layer.attn_boundary, stream, _row_ids(setup.topology))

    batch = make_batch(setup, False, np.full(setup.dp, ROWS))
    fn, leaves, place = sharded_forward(model, setup, batch, body=body)
    x = jnp.zeros((setup.dp * ROWS, 16), jnp.float32)
    with pytest.raises(RuntimeError, match="between that stage's prepare"):
        fn(leaves, place(x), batch)


class _OwnRowsLayer(nnx.Module):
    """Attention, then an FFN fully data-parallel on each rank's own rows (dense_tp_size=1)."""

    def __init__(self, topology: bj.Topology):
        keys = jax.random.split(jax.random.key(3), 3)
        self.attn_norm = random_norm(keys[0], jnp.float32)
        self.ffn_norm = random_norm(keys[1], jnp.float32)
        self.attn = StandInAttention(topology, keys[2], jnp.float32)
        with bj.layer_stack(topology, input_sum=None):
            self.attn_boundary, self.ffn_boundary = bj.append_stages(
                (bj.declare_attn(), self.attn_norm),
                (bj.declare_ffn(dense_tp_size=1), self.ffn_norm),
                owner=self,
            )

    def __call__(self, x, batch):
        stream, ids = residual_stream.start(batch), jnp.arange(x.shape[0])
        h, stream = self.attn_boundary.prepare(x, stream)
        y, stream = self.attn_boundary.finish(self.attn(h), stream)
        h, stream = self.ffn_boundary.prepare(y, stream)
        moved = bj.adapters.lora_rows(self.ffn_boundary, stream, ids)
        assert moved.shape[0] == h.shape[0]
        return moved[:, None].astype(jnp.float32)


@pytest.mark.parametrize("variant", [bj.BatchVariant.ORDINARY, bj.BatchVariant.UNPADDED])
def test_lora_rows_of_an_ffn_on_its_own_rows(variant):
    """An FFN on its own rows gets this rank's attention-TP slice of the row values in an
    ordinary batch, and every row in an unpadded one (whose rows need not divide over TP)."""
    topology = bj.Topology(attn_tp=2)
    rows = ROWS if variant is bj.BatchVariant.ORDINARY else ROWS - 1
    make = bj.BatchFacts.ordinary if variant is bj.BatchVariant.ORDINARY else bj.BatchFacts.unpadded
    batch = make(topology, [rows], rows_per_block=rows)
    own = variant is bj.BatchVariant.ORDINARY
    layout = bj.rows.own_rows(topology) if own else topology.attention_rows()
    sharded = bj.ShardedModule(_OwnRowsLayer(topology), make_mesh(1, 2))
    program = sharded.program(
        lambda layer, x, batch: layer(x, batch),
        in_specs=(P(), batch.spec()),
        out_specs=topology.row_spec(layout, None),
    )
    x = jax.random.normal(jax.random.key(0), (rows, 16), jnp.float32)
    got = np.asarray(program(sharded.leaves, x, batch))[:, 0]
    np.testing.assert_array_equal(got, np.arange(rows))
