"""A small decoder with stand-in compute, built only from boundaries, and its one-device reference.

Attention is replaced by a column/row-parallel pair with causal row mixing (each row averages the
rows before it in its DP rank's block, as attention mixes a sequence); the FFN by a SwiGLU
column/row-parallel pair over the full TP group. Every weight is random, so every rank's shard
differs: a sum taken twice, skipped, or mixed across ranks changes the output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

import boundary_jax as bj
from boundary_jax import residual_stream
from boundary_jax.layout import Layout
from tests.meshes import make_mesh  # noqa: F401 (the tests import it from here)

HIDDEN = 16
ATTN_WIDTH = 16
FFN_WIDTH = 32
ROWS = 8  # padded rows per attention-DP rank, unless a Setup says otherwise

POLICIES = tuple(bj.ReductionPolicy)


def _param(key, shape, spec, dtype):
    value = jax.random.normal(key, shape, dtype) / np.sqrt(shape[0])
    return nnx.Param(value, out_sharding=spec, eager_sharding=False)


class StandInAttention(nnx.Module):
    def __init__(self, topology: bj.Topology, key, dtype):
        k1, k2 = jax.random.split(key)
        heads = topology.shard_entry(bj.SumGroup.ATTN_TP)
        self.w_in = _param(k1, (HIDDEN, ATTN_WIDTH), (None, heads), dtype)
        self.w_out = _param(k2, (ATTN_WIDTH, HIDDEN), (heads, None), dtype)

    def __call__(self, h: jax.Array) -> jax.Array:
        return mix_rows(jnp.tanh(h @ self.w_in[...])) @ self.w_out[...]


class StandInFfn(nnx.Module):
    def __init__(self, topology: bj.Topology, key, dtype):
        k1, k2, k3 = jax.random.split(key, 3)
        cols = topology.shard_entry(bj.SumGroup.FULL_TP)
        self.w_gate = _param(k1, (HIDDEN, FFN_WIDTH), (None, cols), dtype)
        self.w_up = _param(k2, (HIDDEN, FFN_WIDTH), (None, cols), dtype)
        self.w_down = _param(k3, (FFN_WIDTH, HIDDEN), (cols, None), dtype)

    def __call__(self, h: jax.Array) -> jax.Array:
        return (jax.nn.silu(h @ self.w_gate[...]) * (h @ self.w_up[...])) @ self.w_down[...]


class ScaleThenTanh(nnx.Module):
    """A parametric, nonlinear output transform: tanh(scale * value)."""

    def __init__(self, key, dtype):
        self.scale = nnx.Param(1.0 + 0.5 * jax.random.normal(key, (HIDDEN,), dtype))

    def __call__(self, value: jax.Array) -> jax.Array:
        return jnp.tanh(value * self.scale[...][None, :])


@dataclasses.dataclass(frozen=True)
class TanhUpdate:
    """A nonlinear residual update: residual + tanh(value)."""

    plain: bool = dataclasses.field(default=False, init=False)
    applied_at_exit: bool = False

    def apply(self, residual: jax.Array, value: jax.Array, state=None) -> jax.Array:
        return residual + jnp.tanh(value)


def halve(value: jax.Array) -> jax.Array:
    """A linear output transform, which commutes with the sum."""
    return 0.5 * value


def mix_rows(x: jax.Array) -> jax.Array:
    """Causal mean over rows: row i becomes the mean of rows 0..i."""
    counts = jnp.arange(1, x.shape[0] + 1, dtype=x.dtype)[:, None]
    return jnp.cumsum(x, axis=0) / counts


def random_norm(key, dtype) -> bj.RMSNorm:
    """An RMSNorm over HIDDEN with random weights around 1 (a skipped norm shows)."""
    norm = bj.RMSNorm(HIDDEN, eps=1e-6, param_dtype=dtype)
    norm.weight[...] = 1.0 + 0.3 * jax.random.normal(key, (HIDDEN,), dtype)
    return norm


@dataclasses.dataclass(frozen=True)
class Setup:
    """One stand-in stack: topology, depth, policy and the FFN's declaration options."""

    dp: int
    tp: int
    layers: int = 2
    policy: bj.ReductionPolicy = bj.ReductionPolicy.AR
    input_sum: bj.SumGroup | None = bj.SumGroup.ATTN_TP
    transform: str | None = None  # None, "tanh", "halve" (functions) or "module" (ScaleThenTanh)
    transform_before_reduce_scatter: bool = False
    update: Callable | None = None  # a ResidualUpdate class for the FFN; None: plain add
    reads_before_dp_gather: bool = True
    rows: int = ROWS
    fusions: bj.fusions.FusionProvider = bj.fusions.NO_FUSIONS
    ffn_fusions: bj.fusions.FusionProvider | None = None  # the FFN stages' own `fusions` option

    @property
    def topology(self) -> bj.Topology:
        return bj.Topology(attn_dp=self.dp, attn_tp=self.tp)


class StandInLayer(nnx.Module):
    def __init__(self, setup: Setup, key, dtype):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        self.input_norm = random_norm(k1, dtype)
        self.post_attn_norm = random_norm(k2, dtype)
        self.attn = StandInAttention(setup.topology, k3, dtype)
        self.ffn = StandInFfn(setup.topology, k4, dtype)
        transforms = {None: None, "tanh": jnp.tanh, "halve": halve}
        if setup.transform == "module":
            transforms["module"] = ScaleThenTanh(k5, dtype)
        self.transform = transforms[setup.transform]
        ffn_options = {
            "read": bj.designs.AddNormRead(reads_before_dp_gather=setup.reads_before_dp_gather),
            "output_transform": self.transform,
            "transform_before_reduce_scatter": setup.transform_before_reduce_scatter,
        }
        if setup.update is not None:
            ffn_options["update"] = setup.update()
        ffn_stage = (bj.declare_ffn(**ffn_options), self.post_attn_norm)
        if setup.ffn_fusions is not None:
            ffn_stage += ({"fusions": setup.ffn_fusions},)
        self.attn_boundary, self.ffn_boundary = bj.append_stages(
            (bj.declare_attn(), self.input_norm), ffn_stage, owner=self
        )

    def __call__(self, x, stream):
        h, stream = self.attn_boundary.prepare(x, stream)
        x, stream = self.attn_boundary.finish(self.attn(h), stream)
        h, stream = self.ffn_boundary.prepare(x, stream)
        return self.ffn_boundary.finish(self.ffn(h), stream)

    def reference(self, rows: jax.Array, update) -> jax.Array:
        rows = rows + self.attn(self.input_norm(rows))
        out = self.ffn(self.post_attn_norm(rows))
        if self.transform is not None:
            out = self.transform(out)
        return rows + out if update is None else update.apply(rows, out, None)


class StandInDecoder(nnx.Module):
    def __init__(self, setup: Setup, key, dtype=jnp.float64):
        keys = jax.random.split(key, setup.layers + 1)
        with bj.layer_stack(
            setup.topology,
            reduction=setup.policy,
            input_sum=setup.input_sum,
            fusions=setup.fusions,
        ):
            self.layers = nnx.List(
                [StandInLayer(setup, keys[i], dtype) for i in range(setup.layers)]
            )
        self.final_norm = random_norm(keys[-1], dtype)
        self.scan_middle = False

    def __call__(self, x: jax.Array, batch: bj.BatchFacts) -> jax.Array:
        stream = residual_stream.start(batch)
        if self.scan_middle:
            x, stream = self.layers[0](x, stream)
            run = bj.StackedLayers(list(self.layers)[1:-1], start=1)
            (x, stream), _ = run.scan(lambda layer, carry, _: (layer(*carry), None), (x, stream))
            x, stream = self.layers[-1](x, stream)
        else:
            for index, layer in enumerate(self.layers):
                with jax.named_scope(f"layer_{index}"):
                    x, stream = layer(x, stream)
        return residual_stream.final_norm(x, stream, self.final_norm, skip_empty=True)


def stack_input(setup: Setup, x: jax.Array) -> jax.Array:
    """What the stack input owes: with `input_sum`, each attention-TP rank holds a share of x.

    Returns [dp*ROWS, tp*HIDDEN]: rank t's share is column block t (the shares sum to x).
    """
    if setup.input_sum is None:
        return x
    return input_shares(x, setup.tp)


def input_shares(x: jax.Array, tp: int) -> jax.Array:
    """`tp` shares of x as column blocks, differing per row and column, so that no rank's share
    is a scalar multiple of another's (a sum that mixes ranks' shares cannot pass as a scaling)."""
    noise = jax.random.normal(jax.random.key(99), (tp - 1, *x.shape), x.dtype)
    shares = [noise[i] for i in range(tp - 1)]
    return jnp.concatenate([x - sum(shares, jnp.zeros_like(x)), *shares], axis=1)


def sharded_forward(
    model: StandInDecoder,
    setup: Setup,
    batch: bj.BatchFacts,
    *,
    check_vma: bool = True,
    body: Callable | None = None,
    out_layout: Layout | None = None,
):
    """A jitted sharded forward `f(leaves, x, batch)`, the state placed on the mesh (as the
    `ShardedModule`'s leaves), and a function that places a stack input `x` [dp*rows, HIDDEN].

    `body(model, x, batch)` replaces the model's own forward; its output rows follow
    `out_layout` (default: the attention's rows).
    """
    mesh = make_mesh(setup.dp, setup.tp)
    topology = setup.topology
    dp = topology.spec_entry((bj.TokenAxis.ATTN_DP,))
    owed = topology.spec_entry((bj.TokenAxis.ATTN_TP,)) if setup.input_sum else None
    in_rows = jax.sharding.PartitionSpec(dp, owed)
    out_rows = topology.row_spec(out_layout or topology.attention_rows(), None)
    sharded = bj.ShardedModule(model, mesh)
    fn = sharded.program(
        body or (lambda model, x, batch: model(x, batch)),
        in_specs=(in_rows, batch.spec()),
        out_specs=out_rows,
        check_vma=check_vma,
    )

    def place(x):
        return jax.device_put(stack_input(setup, x), NamedSharding(mesh, in_rows))

    return fn, sharded.leaves, place


def reference(model: StandInDecoder, x: jax.Array, setup: Setup, counts) -> jax.Array:
    """The same decoder on one device: each DP rank's block is its own token set."""
    update = None if setup.update is None else setup.update()
    blocks = x.reshape(setup.dp, -1, x.shape[-1])
    valid = jnp.arange(blocks.shape[1])[None, :] < jnp.asarray(counts)[:, None]

    def block_output(block, keep):
        rows = jnp.where(keep[:, None], block, 0)
        for layer in model.layers:
            rows = layer.reference(rows, update)
        return jnp.where(keep[:, None], model.final_norm(rows), 0)

    return jax.vmap(block_output)(blocks, valid).reshape(x.shape)


def count_patterns(dp: int, rows: int = ROWS) -> dict[str, np.ndarray]:
    """Even, ragged and idle-rank token counts per DP rank (padded blocks of `rows` rows)."""
    return {
        "even": np.full(dp, rows),
        "ragged": np.array([(5 * r + 3) % rows + 1 for r in range(dp)]),
        "idle": np.array([0 if r % 2 else max(rows - 1 - r % 3, 1) for r in range(dp)]),
    }


def make_batch(setup: Setup, scattered: bool, counts) -> bj.BatchFacts:
    make = bj.BatchFacts.input_scattered if scattered else bj.BatchFacts.ordinary
    return make(setup.topology, counts, rows_per_block=setup.rows)
