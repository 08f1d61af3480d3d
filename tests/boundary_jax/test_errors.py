"""Each applicable error of the guide's "Common errors" table, raised with its message."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from boundary_jax import residual_stream

from .standin import HIDDEN, ROWS, Setup, StandInDecoder, TanhUpdate


@pytest.fixture(scope="module")
def single():
    """A two-layer stand-in stack on one device: no collectives, so it runs eagerly."""
    setup = Setup(dp=1, tp=1, layers=2, input_sum=None)
    return setup, StandInDecoder(setup, jax.random.key(0), jnp.float32)


def _x():
    return jax.random.normal(jax.random.key(1), (ROWS, HIDDEN))


def _batch(setup, scattered=False):
    make = bj.BatchFacts.input_scattered if scattered else bj.BatchFacts.ordinary
    return make(setup.topology)


def test_entering_a_stage_without_start(single):
    """prepare() without a started stream: 'start the layer stack before entering a stage'."""
    _, model = single
    with pytest.raises(RuntimeError, match="start the layer stack before entering a stage"):
        model.layers[0].attn_boundary.prepare(_x(), None)


def test_a_rebound_layer_output_is_rejected(single):
    """Passing anything but the stream's own output handle fails the identity check."""
    setup, model = single
    message = "output does not belong to this residual stream; change layer outputs through"
    stream = residual_stream.start(_batch(setup))
    out, stream = model.layers[0](_x(), stream)
    with pytest.raises(ValueError, match=message):
        model.layers[1](_x(), stream)
    other_out, _ = model.layers[0](_x(), residual_stream.start(_batch(setup)))
    with pytest.raises(ValueError, match=message):
        model.layers[1](other_out, stream)
    with pytest.raises(ValueError, match=message):
        residual_stream.final_norm(other_out, stream, model.final_norm)


def test_taking_the_output_while_an_update_is_pending(single):
    """take_output() on a pending contribution: 'write the residual update before ...'."""
    setup, model = single
    out, stream = model.layers[0](_x(), residual_stream.start(_batch(setup)))
    with pytest.raises(RuntimeError, match="write the residual update before taking the final"):
        residual_stream.take_output(out, stream)
    out, stream = residual_stream.fold(out, stream)
    assert residual_stream.take_output(out, stream).shape == (ROWS, HIDDEN)


def test_a_batch_variant_without_a_bound_path(single):
    """An input-scattered batch on a stack without attention TP has no path, and says so."""
    setup, model = single
    stream = residual_stream.start(_batch(setup, scattered=True))
    with pytest.raises(
        NotImplementedError, match="no stage boundary path for the active INPUT_SCATTERED batch"
    ):
        model.layers[0](_x(), stream)


def test_appending_outside_a_layer_stack():
    """append_stages() outside layer_stack(): 'append_stages needs an open layer stack'."""
    with pytest.raises(RuntimeError, match="append_stages needs an open layer stack"):
        bj.append_stages((bj.declare_attn(), None))


def test_a_snapshot_of_a_nonlinear_update():
    """snapshot() on a non-plain update: 'snapshot requires a plain residual update'."""
    setup = Setup(dp=1, tp=1, layers=1, input_sum=None, update=TanhUpdate)
    model = StandInDecoder(setup, jax.random.key(0), jnp.float32)
    out, stream = model.layers[0](_x(), residual_stream.start(_batch(setup)))
    with pytest.raises(NotImplementedError, match="snapshot requires a plain residual update"):
        residual_stream.snapshot(out, stream)


def test_a_reduction_contract_for_the_wrong_stage_kind():
    """An FFN cannot be ALWAYS_PARTIAL; an attention stage cannot be output_complete."""
    with pytest.raises(ValueError, match="ALWAYS_PARTIAL is not supported for ffn stages"):
        bj.declare_ffn(reduction=bj.ProducerReduction.ALWAYS_PARTIAL)
    with pytest.raises(ValueError, match="output_complete is an FFN fact"):
        dataclasses.replace(bj.declare_attn(), output_complete=True)


def test_an_owed_output_has_no_array_behaviour(single):
    """OwedOutput refuses arithmetic, conversion and indexing with a pointer to the accessors."""
    setup, model = single
    out, _ = model.layers[0](_x(), residual_stream.start(_batch(setup)))
    for misuse in (
        lambda: out + 1,
        lambda: jnp.asarray(out),
        lambda: out[0],
        lambda: np.array(out),
    ):
        with pytest.raises(TypeError, match="an OwedOutput is not a tensor"):
            misuse()
    assert not hasattr(out, "shape")


def test_a_stage_run_twice_or_out_of_order(single):
    """finish() needs a prepared stage; a stage cannot take another stage's handoff."""
    setup, model = single
    layer = model.layers[0]
    stream = residual_stream.start(_batch(setup))
    h, stream = layer.attn_boundary.prepare(_x(), stream)
    out, stream = layer.attn_boundary.finish(h, stream)
    with pytest.raises(RuntimeError, match="call prepare\\(\\) before"):
        layer.attn_boundary.exit(stream)
    with pytest.raises(RuntimeError, match="not the stack entry"):
        model.layers[1].attn_boundary.prepare(_x(), residual_stream.start(_batch(setup)))


def test_a_batch_laid_out_on_another_topology(single):
    """Batch facts for another mesh are rejected before any path runs."""
    _, model = single
    stream = residual_stream.start(bj.BatchFacts.ordinary(bj.Topology(attn_tp=2)))
    with pytest.raises(ValueError, match="was bound on"):
        model.layers[0](_x(), stream)


def test_compute_output_of_the_wrong_shape(single):
    """finish() checks the compute output is [rows, hidden] on the stage's compute rows."""
    setup, model = single
    stream = residual_stream.start(_batch(setup))
    _, stream = model.layers[0].attn_boundary.prepare(_x(), stream)
    with pytest.raises(ValueError, match="must return \\[rows, hidden\\]"):
        model.layers[0].attn_boundary.finish(jnp.ones((ROWS + 1, HIDDEN)), stream)


def test_a_stage_prepared_twice_or_finished_unprepared(single):
    """prepare() on a stream the stage has prepared but not finished, and finish() without a
    prepare(), each name the stage and the order the stages run in."""
    setup, model = single
    layer = model.layers[0]
    h, stream = layer.attn_boundary.prepare(_x(), residual_stream.start(_batch(setup)))
    with pytest.raises(RuntimeError, match="prepared and has not finished"):
        layer.attn_boundary.prepare(_x(), stream)
    out, stream = layer.attn_boundary.finish(h, stream)
    h, written = layer.ffn_boundary.prepare(out, stream)
    _, written = residual_stream.fold(*layer.ffn_boundary.finish(h, written))
    with pytest.raises(RuntimeError, match="on a stream no stage prepared"):
        layer.ffn_boundary.finish(h, written)


def test_final_norm_before_the_last_layer_names_the_fix(single):
    """final_norm() after a stage that is not the stack's last says so (not a pipeline send)."""
    setup, model = single
    out, stream = model.layers[0](_x(), residual_stream.start(_batch(setup)))
    with pytest.raises(RuntimeError, match="final_norm\\(\\) after a stage that is not the stack"):
        residual_stream.final_norm(out, stream, model.final_norm)


def test_a_nested_layer_stack_is_rejected():
    """A layer stack opened inside another is rejected when it opens."""
    outer, inner = bj.layer_stack(bj.Topology()), bj.layer_stack(bj.Topology())
    with pytest.raises(RuntimeError, match="inside an open layer stack"), outer, inner:
        pass


def test_token_counts_are_checked_against_their_rows():
    """Counts outside [0, rows], or without rows, are rejected when the facts are made."""
    topology = bj.Topology(attn_dp=2)
    for counts in ([9, 1], [-1, 2], [1.5, 2]):
        with pytest.raises(ValueError, match="whole numbers of real tokens in \\[0, 8\\]"):
            bj.BatchFacts.ordinary(topology, token_counts=counts, rows_per_block=8)
    with pytest.raises(ValueError, match="pass rows_per_block="):
        bj.BatchFacts.ordinary(topology, token_counts=[1, 2])
    counts = bj.BatchFacts.ordinary(topology, token_counts=[8, 0], rows_per_block=8).token_counts
    np.testing.assert_array_equal(counts, [8, 0])


def test_wrong_widths_name_the_stage(single):
    """A compute output of another width than the residual fails at its finish(), and a stack
    input of another width at its norm, each naming both widths."""
    setup, model = single
    layer = model.layers[0]
    h, stream = layer.attn_boundary.prepare(_x(), residual_stream.start(_batch(setup)))
    with pytest.raises(
        ValueError, match=f"outputs of width 3, but the residual stream is {HIDDEN}"
    ):
        layer.attn_boundary.finish(h[:, :3], stream)
    with pytest.raises(ValueError, match=f"RMSNorm of width {HIDDEN} normalizes rows of width 3"):
        layer.attn_boundary.prepare(_x()[:, :3], residual_stream.start(_batch(setup)))


def test_a_program_returning_an_owed_output_is_rejected(single):
    """A sharded program whose result holds an OwedOutput (its sums and update would be
    dropped) is rejected while tracing."""
    setup, model = single
    batch = _batch(setup)
    mesh = bj.make_mesh(setup.topology)
    sharded = bj.ShardedModule(model, mesh)
    spec = jax.sharding.PartitionSpec()

    def forgets_the_final_norm(model, x, batch):
        stream = residual_stream.start(batch)
        for layer in model.layers:
            x, stream = layer(x, stream)
        return x

    program = sharded.program(forgets_the_final_norm, in_specs=(spec, batch.spec()), out_specs=spec)
    with pytest.raises(TypeError, match="returned an OwedOutput"):
        program(sharded.leaves, _x(), batch)


def test_a_program_takes_the_flat_leaves_and_refuses_an_nnx_state(single):
    """A program takes `ShardedModule.leaves`, the same arrays its `state` and `module` views
    hold (and `state_of` maps a tuple of them back), and computes with the leaves it is given:
    the model's own output on them, another on other leaves; handed the `nnx.State` instead,
    it says what it takes."""
    setup, model = single
    batch = _batch(setup)
    sharded = bj.ShardedModule(model, bj.make_mesh(setup.topology))
    spec = jax.sharding.PartitionSpec()
    assert isinstance(sharded.leaves, tuple) and len(sharded.leaves) > 4
    views = (jax.tree.leaves(sharded.state), jax.tree.leaves(nnx.state(sharded.module)))
    for view in views:
        assert all(a is b for a, b in zip(view, sharded.leaves, strict=True))
    doubled = sharded.state_of(tuple(2 * leaf for leaf in sharded.leaves))
    state = dict(nnx.to_flat_state(sharded.state))
    for path, leaf in nnx.to_flat_state(doubled):
        np.testing.assert_array_equal(np.asarray(leaf[...]), 2 * np.asarray(state[path][...]))
    program = sharded.program(
        lambda model, x, batch: model(x, batch), in_specs=(spec, batch.spec()), out_specs=spec
    )
    got = np.asarray(program(sharded.leaves, _x(), batch))
    np.testing.assert_allclose(got, np.asarray(model(_x(), batch)), rtol=1e-5, atol=1e-5)
    compiled = program.lower(sharded.leaves, _x(), batch).compile()
    np.testing.assert_array_equal(got, np.asarray(compiled(sharded.leaves, _x(), batch)))
    scaled = tuple(leaf * 1.5 for leaf in sharded.leaves)
    assert not np.allclose(np.asarray(program(scaled, _x(), batch)), got, atol=1e-3)
    with pytest.raises(TypeError, match=r"takes the module's state as ShardedModule.leaves"):
        program(sharded.state, _x(), batch)
