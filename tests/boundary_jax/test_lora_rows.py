"""The LoRA adapter's per-row values land on each stage's compute rows, moved as its input was."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import boundary_jax as bj
from boundary_jax import residual_stream
from tests.boundary_jax.cases import build
from tests.boundary_jax.standin import ROWS, Setup, make_batch, sharded_forward


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
