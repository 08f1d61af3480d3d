"""Quantized reads: a stage's input arrives as FP8 rows with per-group scales, on every layout,
fused or not, and a read that cannot quantize says so."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj
import pallas_kernels as pk
from boundary_jax import designs, residual_stream
from boundary_jax.fusions import AddRmsNorm, AddRmsNormQuantize, FusionProvider

from .standin import input_shares, make_mesh, mix_rows

HIDDEN, WIDTH, ROWS = 256, 512, 8
FORM = designs.Fp8TokenGroups(128)
READ = designs.AddNormRead(quantize=FORM)


def _param(key, shape, spec):
    value = jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[0])
    return nnx.Param(value, out_sharding=spec, eager_sharding=False)


def _norm(key) -> bj.RMSNorm:
    norm = bj.RMSNorm(HIDDEN)
    norm.weight[...] = 1.0 + 0.3 * jax.random.normal(key, (HIDDEN,))
    return norm


class QuantizedLayer(nnx.Module):
    """Stand-in attention and FFN that take their input quantized (and dequantize it)."""

    def __init__(self, topology: bj.Topology, key):
        keys = jax.random.split(key, 6)
        heads = topology.shard_entry(bj.SumGroup.ATTN_TP)
        cols = topology.shard_entry(bj.SumGroup.FULL_TP)
        self.input_norm, self.post_attn_norm = _norm(keys[0]), _norm(keys[1])
        self.w_in = _param(keys[2], (HIDDEN, WIDTH), (None, heads))
        self.w_out = _param(keys[3], (WIDTH, HIDDEN), (heads, None))
        self.w_up = _param(keys[4], (HIDDEN, WIDTH), (None, cols))
        self.w_down = _param(keys[5], (WIDTH, HIDDEN), (cols, None))
        self.attn_boundary, self.ffn_boundary = bj.append_stages(
            (bj.declare_attn(read=READ), self.input_norm),
            (bj.declare_ffn(read=READ), self.post_attn_norm),
            owner=self,
        )

    def attn(self, h: jax.Array) -> jax.Array:
        return mix_rows(jnp.tanh(h @ self.w_in[...])) @ self.w_out[...]

    def ffn(self, h: jax.Array) -> jax.Array:
        return jax.nn.silu(h @ self.w_up[...]) @ self.w_down[...]

    def __call__(self, x, stream):
        h, stream = self.attn_boundary.prepare(x, stream)
        assert isinstance(h, designs.Quantized) and h.values.dtype == jnp.float8_e4m3fn
        x, stream = self.attn_boundary.finish(self.attn(h.dequantize()), stream)
        h, stream = self.ffn_boundary.prepare(x, stream)
        return self.ffn_boundary.finish(self.ffn(h.dequantize()), stream)

    def reference(self, rows: jax.Array, quantize=True) -> jax.Array:
        """One DP rank's rows through the layer, quantizing each normalized input (or not)."""

        def read(norm, rows):
            return FORM.quantize(norm(rows)).dequantize() if quantize else norm(rows)

        rows = rows + self.attn(read(self.input_norm, rows))
        return rows + self.ffn(read(self.post_attn_norm, rows))


class QuantizedStack(nnx.Module):
    def __init__(self, topology: bj.Topology, fusions: FusionProvider, policy):
        keys = jax.random.split(jax.random.key(5), 3)
        with bj.layer_stack(
            topology, reduction=policy, input_sum=bj.SumGroup.ATTN_TP, fusions=fusions
        ):
            self.layers = nnx.List([QuantizedLayer(topology, keys[i]) for i in range(2)])
        self.final_norm = _norm(keys[2])

    def __call__(self, x, batch):
        stream = residual_stream.start(batch)
        for layer in self.layers:
            x, stream = layer(x, stream)
        return residual_stream.final_norm(x, stream, self.final_norm, skip_empty=True)


CALLS: list[tuple[str, bool]] = []


@dataclasses.dataclass(frozen=True)
class Counting:
    inner: object

    def __call__(self, request):
        result = self.inner(request)
        CALLS.append((type(self.inner).__name__, result is not None))
        return result


INTERPRETED = (
    Counting(AddRmsNorm("cpu", pk.Impl.PALLAS_INTERPRET)),
    Counting(AddRmsNormQuantize("cpu", pk.Impl.PALLAS_INTERPRET)),
)
LAYOUTS = {
    "DP 2 x TP 2, ar": (2, 2, bj.ReductionPolicy.AR, bj.fusions.NO_FUSIONS),
    "TP 4, rs+rsv, fused kernel": (
        1,
        4,
        bj.ReductionPolicy.RS_RSV,
        FusionProvider(attn_input=INTERPRETED, ffn_input=INTERPRETED),
    ),
}


@functools.cache
def _outputs(layout: str) -> tuple[np.ndarray, np.ndarray]:
    dp, tp, policy, fusions = LAYOUTS[layout]
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    model = QuantizedStack(topology, fusions, policy)
    counts = np.array([ROWS, ROWS - 3][:dp])
    batch = bj.BatchFacts.ordinary(topology, counts, rows_per_block=ROWS)
    x = jax.random.normal(jax.random.key(2), (dp * ROWS, HIDDEN))
    mesh = make_mesh(dp, tp)
    rows = PartitionSpec(topology.spec_entry((bj.TokenAxis.ATTN_DP,)), None)
    shares = PartitionSpec(rows[0], topology.spec_entry((bj.TokenAxis.ATTN_TP,)))
    sharded = bj.ShardedModule(model, mesh)
    forward = sharded.program(
        lambda model, x, batch: model(x, batch), in_specs=(shares, batch.spec()), out_specs=rows
    )
    placed = jax.device_put(input_shares(x, tp), NamedSharding(mesh, shares))
    got = np.asarray(forward(sharded.leaves, placed, batch))
    want = []
    for block, count in zip(x.reshape(dp, ROWS, HIDDEN), counts, strict=True):
        block = jnp.where(jnp.arange(ROWS)[:, None] < count, block, 0)
        for layer in model.layers:
            block = layer.reference(block)
        normed = model.final_norm(block)
        want.append(jnp.where(jnp.arange(ROWS)[:, None] < count, normed, 0))
    return got, np.asarray(jnp.concatenate(want))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantized_reads_match_the_unsharded_stack(layout):
    """Every stage's compute gets its input as FP8 rows and scales, gathered over attention DP
    or attention TP as both leaves, fused or not: the stack equals one device quantizing each
    normalized input."""
    CALLS.clear()
    got, want = _outputs(layout)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    if "fused" in layout:
        assert ("AddRmsNormQuantize", True) in CALLS
        assert ("AddRmsNorm", True) not in CALLS  # it declines a quantized read


def test_quantizing_matters():
    """The check above can fail: the stack without its inputs quantized differs by far more
    than its tolerance."""
    _, want = _outputs("DP 2 x TP 2, ar")
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    model = QuantizedStack(topology, bj.fusions.NO_FUSIONS, bj.ReductionPolicy.AR)
    block = jax.random.normal(jax.random.key(2), (ROWS, HIDDEN))  # DP rank 0's rows, all valid
    for layer in model.layers:
        block = layer.reference(block, quantize=False)
    error = np.abs(np.asarray(model.final_norm(block)) - want[:ROWS]).max()
    assert error > 1e-3 * np.abs(want).max()


def test_plans_report_the_input_format():
    """Binding sees the read's format: the plan report names it for both stages."""
    model = QuantizedStack(bj.Topology(attn_tp=2), bj.fusions.NO_FUSIONS, bj.ReductionPolicy.AR)
    stages = [
        (i, name, boundary.plan)
        for i, layer in enumerate(model.layers)
        for name, boundary in (("attention", layer.attn_boundary), ("ffn", layer.ffn_boundary))
    ]
    described = bj.report.describe_stages(stages, bj.BatchVariant.ORDINARY)
    assert {stage["input_format"] for stage in described} == {FORM.name}
    assert model.layers[0].attn_boundary.plan.declaration.read.input_format == FORM


def test_the_fused_quantized_read_equals_the_unfused_one():
    """The candidate's kernel gives what the read computes unfused (bit for bit in bf16)."""
    keys = jax.random.split(jax.random.key(3), 3)
    value = jax.random.normal(keys[0], (ROWS, HIDDEN)).astype(jnp.bfloat16)
    stream = (4 * jax.random.normal(keys[1], (ROWS, HIDDEN))).astype(jnp.bfloat16)
    norm = _norm(keys[2])
    request = bj.fusions.FusionRequest(value, stream, norm, designs.PlainAdd(), READ, (), 1)
    fused, fused_residual = AddRmsNormQuantize("cpu", pk.Impl.PALLAS_INTERPRET)(request)
    unfused, unfused_residual, _ = READ.update_and_read(designs.PlainAdd(), value, stream, norm)
    chex.assert_trees_all_equal((fused, fused_residual), (unfused, unfused_residual))


def test_candidates_decline_what_they_cannot_fuse():
    """The quantizing candidate declines an unquantized read and a nonlinear update (the read
    then applies the update and quantizes unfused); the plain add + norm one declines a
    quantized read."""
    rows = jnp.ones((ROWS, HIDDEN))
    norm = _norm(jax.random.key(0))

    def request(update, read):
        return bj.fusions.FusionRequest(rows, rows, norm, update, read, (), 1)

    quantize = AddRmsNormQuantize("cpu", pk.Impl.PALLAS_INTERPRET)
    plain = AddRmsNorm("cpu", pk.Impl.PALLAS_INTERPRET)
    assert quantize(request(designs.PlainAdd(), designs.AddNormRead())) is None
    nonlinear = designs.PostNormUpdate(HIDDEN)
    assert quantize(request(nonlinear, READ)) is None
    assert plain(request(designs.PlainAdd(), READ)) is None
    h, _, _ = READ.update_and_read(nonlinear, rows, rows, norm)
    assert isinstance(h, designs.Quantized)
