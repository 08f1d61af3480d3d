"""Residual designs with parameters and state: post-norm, and a read that hands state to its
stage's update, on every layout and through pipeline cuts; their gradients; what they keep out
of."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from boundary_jax import designs, residual_stream
from boundary_jax.plan import ResidualRows

from .hetero import HIDDEN, Hetero, HeteroStack, Kind, build, make_batch, reference
from .standin import ROWS, count_patterns, make_mesh, random_norm

K = Kind
V = bj.BatchVariant


class GatedRead(nnx.Module):
    """A read that normalizes and hands its update a per-row gate, sigmoid(residual @ w)."""

    reads_before_dp_gather = True
    reads_after_attn_tp_gather = False
    completing_fusions = ()
    gathering_reads = ()
    input_format = None

    def __init__(self, key):
        self.w = nnx.Param(jax.random.normal(key, (HIDDEN, 1), jnp.float64) / HIDDEN**0.5)

    def init_residual(self, x, norm):
        return self.read(x, norm)

    def read(self, residual, norm):
        return norm(residual), residual, jax.nn.sigmoid(residual @ self.w[...])

    def update_and_read(self, update, value, residual, norm, state):
        return self.read(update.apply(residual, value, state), norm)


class GatedUpdate(nnx.Module):
    """The nonlinear update `residual + gate * value`, with the gate its own stage's read made,
    and a trainable scale."""

    plain = False
    applied_at_exit = False

    def __init__(self, key):
        self.scale = nnx.Param(1.0 + 0.3 * jax.random.normal(key, (HIDDEN,), jnp.float64))

    def apply(self, residual, value, state):
        return residual + state * value * self.scale[...][None, :]


def gated(index: int) -> dict:
    key = jax.random.fold_in(jax.random.key(31), index)
    return {"read": GatedRead(key), "update": GatedUpdate(jax.random.fold_in(key, 1))}


def post_norm(index: int) -> dict:
    key = jax.random.fold_in(jax.random.key(32), index)
    update = designs.PostNormUpdate(HIDDEN, param_dtype=jnp.float64)
    update.weight[...] = random_norm(key, jnp.float64).weight[...]
    return {"update": update}


def mhc(index: int) -> dict:
    rngs = nnx.Rngs(jax.random.fold_in(jax.random.key(33), index))
    read = designs.MhcRead(HIDDEN, HC_MULT, param_dtype=jnp.float64, rngs=rngs)
    return {"read": read, "update": designs.MhcUpdate()}


def mhc_head(key, dtype):
    return designs.MhcHead(
        HIDDEN, HC_MULT, random_norm(key, dtype), param_dtype=dtype, rngs=nnx.Rngs(key)
    )


HC_MULT = 4
DESIGNS = {"post-norm": post_norm, "gated": gated, "mhc": mhc}
FINALS = {"mhc": mhc_head}
MESHES = [
    ((K.ATTN, K.FFN, K.MIXER, K.MOE), 2, 2, V.ORDINARY, 2),
    ((K.ATTN, K.FFN_DP, K.ATTN, K.FFN), 1, 4, V.ORDINARY, 2),
    ((K.ATTN, K.MOE, K.ATTN, K.FFN), 2, 2, V.INPUT_SCATTERED, 3),
]
KEY = jax.random.key(41)


def _program(model: Hetero, cut, variant):
    """`(f(leaves, x, counts), sharded module, stacks, place)` of the sharded model, cut before
    `cut`."""
    built = build(model, cut, skip_empty=False)

    def run(leaves, x, counts):
        return built.program(variant)(leaves, x, make_batch(model, variant, counts))

    return run, built.sharded, built.stacks, built.place


def _inputs(dp):
    x = jax.random.normal(jax.random.key(8), (dp * ROWS, HIDDEN), jnp.float64)
    return x, count_patterns(dp)["even"]


def _error(got, want):
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


SLOW = pytest.mark.slow
# Post-norm and the gated read run on every layout by default; MHC (4 streams, several times the
# compile) on every layout under -m slow.
DESIGN_CASES = [
    pytest.param(
        design,
        *mesh,
        id=f"kinds{index}-{mesh[1]}-{mesh[2]}-{mesh[3].name}-{mesh[4]}-{design}",
        marks=[SLOW] if design == "mhc" else [],
    )
    for index, mesh in enumerate(MESHES)
    for design in DESIGNS
]


@pytest.mark.parametrize("design,kinds,dp,tp,variant,cut", DESIGN_CASES)
def test_a_design_with_parameters_equals_one_device_uncut_and_cut(
    design, kinds, dp, tp, variant, cut
):
    """A parametric (and stateful) design on every layout equals the single-device reference,
    uncut and through a pipeline cut (where its update runs on the sending rank)."""
    model = Hetero(kinds, dp, tp, design=DESIGNS[design], final=FINALS.get(design))
    with jax.enable_x64(True):
        x, counts = _inputs(dp)
        run, sharded, stacks, place = _program(model, None, variant)
        want = reference(list(stacks), x, dp)
        assert _error(run(sharded.leaves, place(x), counts), want) < 1e-12
        run, sharded, _, place = _program(model, cut, variant)
        assert _error(run(sharded.leaves, place(x), counts), want) < 1e-12


# The gated design (a read and an update both with parameters) and the post-norm update cover a
# design's parameters on either side of the stage by default; MHC's (its stream of several
# residual copies costs the most to compile) runs under -m slow, as its forward parity does.
@pytest.mark.parametrize(
    "design", [pytest.param(d, marks=[SLOW] if d == "mhc" else []) for d in DESIGNS]
)
def test_gradients_of_the_design_parameters_equal_one_device(design):
    """jax.grad through a sharded stack equals the single-device gradient for every parameter,
    the design's own (the post-norm weights, the gate and scale) included."""
    model = Hetero(
        (K.ATTN, K.FFN, K.MIXER, K.MOE), 2, 2, design=DESIGNS[design], final=FINALS.get(design)
    )
    with jax.enable_x64(True):
        x, counts = _inputs(2)
        run, sharded, stacks, place = _program(model, None, V.ORDINARY)
        weights = jax.random.normal(jax.random.key(9), x.shape, jnp.float64)
        graphdef, plain = nnx.split(stacks)
        with jax.set_mesh(make_mesh(2, 2)):
            grads = jax.jit(jax.grad(lambda s: jnp.sum(run(s, place(x), counts) * weights)))(
                sharded.leaves
            )
        got = sharded.state_of(grads)
        want = jax.grad(lambda s: jnp.sum(reference(list(nnx.merge(graphdef, s)), x, 2) * weights))(
            plain
        )
    got_flat = dict(nnx.to_flat_state(got))
    want_flat = dict(nnx.to_flat_state(want))
    design_paths = [p for p in want_flat if "update" in p or "read" in p]
    assert design_paths, "the design's parameters are state of the stage"
    assert set(got_flat) == set(want_flat)
    for path, leaf in want_flat.items():
        value = np.asarray(jax.device_get(got_flat[path][...]))
        np.testing.assert_allclose(value, leaf[...], rtol=1e-9, atol=1e-12, err_msg=str(path))


def test_a_nonlinear_update_is_kept_out_of_fused_kernels_and_snapshots():
    """A post-norm update is not plain: no fused add + norm candidate takes it, and snapshot()
    raises the guide's message."""
    update = designs.PostNormUpdate(HIDDEN)
    assert not update.plain
    value = jnp.ones((8, HIDDEN))
    request = bj.fusions.FusionRequest(
        value, value, bj.RMSNorm(HIDDEN), update, designs.AddNormRead(), (), bj.Topology()
    )
    assert bj.fusions.AddRmsNorm("cpu", impl=None)(request) is None
    model = Hetero((K.ATTN, K.FFN), 1, 1, design=post_norm)
    stack = HeteroStack(model, range(2), KEY, jnp.float32)
    stream = residual_stream.start(bj.BatchFacts.ordinary(model.topology))
    out, stream = stack.run(jnp.ones((ROWS, HIDDEN)), stream)
    with pytest.raises(NotImplementedError, match="snapshot requires a plain residual update"):
        residual_stream.snapshot(out, stream)


def test_a_jitted_function_of_a_stream_does_not_retrace_per_stream():
    """Streams carry no counter in their static structure: a new stream reuses the trace."""
    topology = bj.Topology()
    traces = []

    @jax.jit
    def f(stream):
        traces.append(1)
        return stream.residual * 2

    for _ in range(3):
        _, stream = residual_stream.start(bj.BatchFacts.ordinary(topology)).written(
            jnp.ones((4, HIDDEN)), ResidualRows.attention(topology)
        )
        f(stream)
    assert len(traces) == 1


def test_another_streams_handle_is_still_rejected_in_one_trace():
    """Two streams in one trace keep distinct identities."""
    topology = bj.Topology()
    batch = bj.BatchFacts.ordinary(topology)
    first = residual_stream.start(batch).written(
        jnp.ones((4, HIDDEN)), ResidualRows.attention(topology)
    )
    second = residual_stream.start(batch).written(
        jnp.ones((4, HIDDEN)), ResidualRows.attention(topology)
    )
    with pytest.raises(ValueError, match="does not belong to this residual stream"):
        second[1].check_output(first[0])


GOLDEN = np.load(pathlib.Path(__file__).parents[1] / "golden" / "mhc" / "reference.npz")


def test_mhc_read_update_and_head_equal_transformers():
    """MhcRead, MhcUpdate and MhcHead equal transformers' DeepseekV4HyperConnection and
    DeepseekV4HyperHead on random weights (float32, 1e-6)."""
    g = {name: jnp.asarray(GOLDEN[name]) for name in GOLDEN.files}
    hidden, hc = g["output"].shape[1], g["streams"].shape[1]
    read = designs.MhcRead(hidden, hc, rngs=nnx.Rngs(0))
    read.projection[...], read.base[...], read.scale[...] = g["fn"], g["base"], g["scale"]
    collapsed, streams, (post, comb) = read.read(g["streams"], None)
    for got, name in ((post, "post"), (comb, "comb"), (collapsed, "collapsed")):
        np.testing.assert_allclose(got, g[name], rtol=1e-6, atol=1e-6, err_msg=name)
    updated = designs.MhcUpdate().apply(streams, g["output"], (post, comb))
    np.testing.assert_allclose(updated, g["updated"], rtol=1e-6, atol=1e-6)
    head = designs.MhcHead(hidden, hc, None, rngs=nnx.Rngs(0))
    head.projection[...], head.base[...], head.scale[...] = (
        g["head_fn"],
        g["head_base"],
        g["head_scale"],
    )
    np.testing.assert_allclose(head(g["streams"]), g["head_collapsed"], rtol=1e-6, atol=1e-6)


def test_an_mhc_stage_completes_its_sum_before_its_nonlinear_update():
    """No fused candidate takes an MHC input, and the sum an attention owes completes in one
    all-reduce per boundary before the next read, as for the plain design."""
    kinds = (K.ATTN, K.FFN, K.ATTN, K.FFN)
    with jax.enable_x64(True):
        x, counts = _inputs(1)
        plain = build(Hetero(kinds, 1, 4), None).report(x, counts, V.ORDINARY)
        expanded = build(Hetero(kinds, 1, 4, design=mhc, final=mhc_head), None).report(
            x, counts, V.ORDINARY
        )
    assert [expanded.sequence(i) for i in range(4)] == [plain.sequence(i) for i in range(4)]
    assert all(c.kind == "all-reduce" for c in expanded.collectives)
