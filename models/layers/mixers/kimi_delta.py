"""Kimi Delta Attention (Kimi-Linear's `linear_attention` layers) over packed token rows, split by
heads over attention TP; it returns the o_proj partial, unreduced.

Per row: q, k and v projections (one head width each), a causal depthwise conv1d (restarting
with each sequence) and SiLU over [q, k, v]; a forget gate per key channel from a low-rank
projection, g = -exp(A_log) softplus(f_b(f_a(h)) + dt_bias); beta = sigmoid(b_proj(h)); the
gated delta rule with that per-channel gate (`models.layers.mixers.delta_rule`, q and k
L2-normalized in it); each head's output RMS-normalized, times the norm weight, times the
sigmoid of a low-rank output gate g_b(g_a(h)); `o_proj` back to the hidden size. The decode
state is Gated DeltaNet's (`DeltaCache`): the last K - 1 conv inputs and a float32
[heads, head_dim, head_dim] state per slot.

Heads split evenly over attention TP: a rank holds its heads' columns of q, k, v, f_b, b and
g_b, their conv channels and `dt_bias` / `A_log`, and their rows of o_proj; the low-rank
f_a and g_a projections and the norm weight are replicated (every rank computes them whole),
so no collective runs inside the mixer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from boundary_jax import SumGroup, Topology
from boundary_jax.initializers import param

from ...config.linear_attention import KimiDeltaSpec
from ...inputs.rows import RowsPhase
from ..linear import ColumnParallelLinear, RowParallelLinear, group_size
from .delta_rule import gated_delta_rule_step
from .gated_deltanet import (
    DeltaCache,
    DeltaSplit,
    delta_rule_extend,
    delta_rule_prefill,
)
from .mamba2 import DepthwiseConvWeights, LogUniform, NormalAround, TimeStepBias
from .ssd import accumulation_dtype, causal_conv1d, causal_conv1d_step, check_stepped_rows


def gated_sigmoid_norm(o: jax.Array, gate: jax.Array, weight: jax.Array, *, eps: float):
    """Hugging Face's `KimiLinearRMSNormGated`: each head's o [..., head_dim] RMS-normalized and
    times `weight`, in float32 (or wider), times sigmoid(gate); in o's dtype."""
    acc = accumulation_dtype(o.dtype)
    wide = o.astype(acc)
    normed = wide * lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + eps)
    scaled = weight.astype(acc).reshape((1,) * (o.ndim - 1) + weight.shape) * normed
    return (scaled * jax.nn.sigmoid(gate.astype(acc))).astype(o.dtype)


class KimiDeltaAttention(nnx.Module):
    """Kimi Delta Attention over packed rows, heads split over attention TP; returns the o_proj
    partial.

    Attributes:
      qkv_proj: [hidden, 3, width]: q, k and v (HF `q_proj`, `k_proj`, `v_proj`), columns
        split over attention TP.
      conv: The conv kernel [3, width, 1, K] of q's, k's and v's channels (HF `conv1d`, cut by
        channels), split alike.
      f_a_proj: [hidden, head_dim], replicated: the forget gate's low-rank input.
      f_b_proj: [head_dim, width], split over attention TP.
      dt_bias: [width] added before the softplus, split alike.
      a_log: [1, 1, heads, 1] (HF `A_log`'s layout): the gate's rate exp(a_log) per head.
      b_proj: [hidden, heads] (beta's input), split over attention TP.
      g_a_proj: [hidden, head_dim], replicated: the output gate's low-rank input.
      g_b_proj: [head_dim, width], split over attention TP.
      norm_weight: [head_dim] weight of the gated output RMSNorm (`o_norm.weight`), replicated.
      o_proj: [width, hidden], rows split over attention TP: the output owes a sum.
      spec: The mixer's shapes and constants.
      split: How heads divide over attention TP (as a `GatedDeltaNetSpec`'s).
    """

    def __init__(
        self,
        spec: KimiDeltaSpec,
        *,
        topology: Topology,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        if topology.attn_cp > 1:
            raise NotImplementedError(
                "a context-parallel Kimi Delta Attention mixer is not implemented; got "
                f"attn_cp={topology.attn_cp}"
            )
        tp = group_size(topology, SumGroup.ATTN_TP)
        if spec.num_heads % tp:
            raise ValueError(
                f"Kimi Delta Attention num_heads ({spec.num_heads}) must be a multiple of the "
                f"attention-TP size ({tp}); use an attention-TP size that divides the heads"
            )
        split = DeltaSplit.of(spec.cache_spec(), topology)
        heads = SumGroup.ATTN_TP
        common = {"topology": topology, "dtype": dtype, "init_std": init_std, "rngs": rngs}
        hidden, width, low = spec.hidden_size, spec.width, spec.head_dim
        self.qkv_proj = ColumnParallelLinear(hidden, width, group=heads, parts=3, **common)
        self.conv = DepthwiseConvWeights(
            spec.conv_kernel,
            width,
            group=heads,
            topology=topology,
            parts=3,
            bias=False,
            dtype=dtype,
            rngs=rngs,
        )
        self.f_a_proj = ColumnParallelLinear(hidden, low, group=None, **common)
        self.f_b_proj = ColumnParallelLinear(low, width, group=heads, **common)
        self.b_proj = ColumnParallelLinear(hidden, spec.num_heads, group=heads, **common)
        self.g_a_proj = ColumnParallelLinear(hidden, low, group=None, **common)
        self.g_b_proj = ColumnParallelLinear(low, width, group=heads, **common)
        entry = topology.shard_entry(heads)
        # Drawn per channel and head (the norm weight around 1), so that a rank holding
        # another's slice shows.
        self.dt_bias = param(
            TimeStepBias(1e-3, 1e-1), (width,), dtype, rngs=rngs, sharding=(entry,)
        )
        self.a_log = param(
            LogUniform(0.5, 16.0),
            (1, 1, spec.num_heads, 1),
            dtype,
            rngs=rngs,
            sharding=(None, None, entry, None),
        )
        self.norm_weight = param(
            NormalAround(1.0, 0.2), (spec.head_dim,), dtype, rngs=rngs, sharding=(None,)
        )
        self.o_proj = RowParallelLinear(width, hidden, group=heads, **common)
        self.spec = spec
        self.split = split

    def __call__(
        self,
        h: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        cache: DeltaCache | None = None,
        *,
        phase: RowsPhase = RowsPhase.PREFILL,
    ) -> tuple[jax.Array, DeltaCache | None]:
        """Runs the mixer over this rank's rows; with a cache, also updates its slots.

        Args, returns and raises as `GatedDeltaNet.__call__` (the cache a `DeltaCache` of
        `spec.cache_spec()`): [T, hidden] o_proj partial owing a sum over attention TP, zero on
        padding rows, and the updated cache or None.
        """
        rows = h.shape[0]
        slots = None if cache is None else cache.state.shape[0]
        check_stepped_rows(h, positions, segment_ids, phase, slots)
        if cache is not None:
            self._check_cache(cache)
        spec, split = self.spec, self.split
        local_heads, head_dim = split.local_v_heads, spec.head_dim
        qkv = self.qkv_proj(h).reshape(rows, -1)  # [T, local q, k, v channels]
        weight = self.conv.weight[...][:, :, 0].reshape(-1, spec.conv_kernel).T
        acc = accumulation_dtype(h.dtype)
        gate_in = self.f_b_proj(self.f_a_proj(h)).astype(acc) + self.dt_bias[...].astype(acc)[None]
        rate = jnp.exp(self.a_log[...].astype(acc)).reshape(1, local_heads, 1)
        g = -rate * jax.nn.softplus(gate_in.reshape(rows, local_heads, head_dim))
        beta = jax.nn.sigmoid(self.b_proj(h).astype(acc))

        def heads(conv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            qkv_heads = jax.nn.silu(conv).astype(h.dtype).reshape(-1, 3, local_heads, head_dim)
            return qkv_heads[:, 0], qkv_heads[:, 1], qkv_heads[:, 2]

        if phase is RowsPhase.EXTEND:
            o, cache = delta_rule_extend(qkv, weight, heads, g, beta, positions, segment_ids, cache)
        elif phase is RowsPhase.PREFILL:
            conv = causal_conv1d(qkv, weight, None, positions, segment_ids)
            rule = (*heads(conv), g, beta)
            o, cache = delta_rule_prefill(rule, qkv, positions, segment_ids, cache, spec)
        else:
            valid = segment_ids >= 0
            conv, conv_state = causal_conv1d_step(cache.conv, qkv, weight, None, valid)
            o, state = gated_delta_rule_step(cache.state, *heads(conv), g, beta, valid)
            cache = DeltaCache(conv=conv_state, state=state)
        gate = self.g_b_proj(self.g_a_proj(h)).reshape(rows, local_heads, head_dim)
        y = gated_sigmoid_norm(o.astype(h.dtype), gate, self.norm_weight[...], eps=spec.eps)
        return self.o_proj(y.reshape(rows, -1)), cache

    def _check_cache(self, cache: DeltaCache) -> None:
        split = self.split
        slots = cache.state.shape[0]
        conv = (slots, self.spec.conv_kernel - 1, split.local_conv_channels)
        state = (slots, split.local_v_heads, self.spec.head_dim, self.spec.head_dim)
        if cache.conv.shape != conv or cache.state.shape != state:
            raise ValueError(
                f"this rank's Kimi Delta Attention cache must be conv {conv} and state {state}; "
                f"got conv {cache.conv.shape} and state {cache.state.shape}. Pass "
                "DeltaCache.specs(topology) as the cache's shard_map spec."
            )
