"""The Gated DeltaNet mixer (Qwen3-Next's and Qwen3.5's `linear_attention` layers) over packed
token rows, split by heads over attention TP; it returns the out_proj partial, unreduced.

Per row: the input projections give q and k (per key head), v and the output gate z (per value
head), and per value head the write strength's input b and the gate's input a; a causal
depthwise conv1d (restarting with each sequence) and SiLU run over [q, k, v]; the gated delta
rule (`models.layers.mixers.delta_rule`, q and k L2-normalized in it) maps them to o, with
beta = sigmoid(b) and the log gate g = -exp(A_log) softplus(a + dt_bias); each value head's o
is RMS-normalized over its channels, times the norm weight, times silu(z); `out_proj` maps it
back to the hidden size. A prefill runs the chunked form over packed rows; a decode step
advances each cache slot's conv state and [v_heads, k_dim, v_dim] float32 state by one row.

Heads split evenly over attention TP by key heads (each with its value heads), so a rank's
q, k, v, z, b and a are its own heads' and no collective runs inside the mixer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from boundary_jax import SumGroup, TokenAxis, Topology
from boundary_jax.initializers import param

from ...config.linear_attention import DeltaProjections, GatedDeltaNetSpec, KimiDeltaSpec
from ...inputs.rows import RowsPhase
from ..linear import ColumnParallelLinear, RowParallelLinear, group_size
from .delta_rule import default_scan, gated_delta_rule_chunked, gated_delta_rule_step
from .mamba2 import DepthwiseConvWeights, LogUniform, NormalAround, TimeStepBias
from .ssd import (
    accumulation_dtype,
    causal_conv1d,
    causal_conv1d_step,
    check_stepped_rows,
    extend_chunks,
    prefill_slot_states,
)


def delta_rule_prefill(
    rule: tuple[jax.Array, ...],
    conv_input: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    cache: DeltaCache | None,
    spec: GatedDeltaNetSpec | KimiDeltaSpec,
) -> tuple[jax.Array, DeltaCache | None]:
    """A delta-rule mixer's prefill: the chunked rule over `rule` (q, k, v, gate, beta; the state
    carried across chunks as `default_scan` picks; chunks and storage as `spec` says) from zero
    states, and with a cache each reached slot's last conv inputs (of `conv_input`) and final
    state. Returns (output [T, heads, v_dim], the cache or None)."""
    slots = 0 if cache is None else cache.state.shape[0]
    o, finals = gated_delta_rule_chunked(
        *rule,
        positions,
        segment_ids,
        chunk_size=spec.chunk_size,
        num_slots=slots,
        scan=default_scan(rule[3], rule[4]),
        storage=spec.chunk_storage,
    )
    if cache is not None:
        conv, state = prefill_slot_states(
            cache.conv, cache.state, conv_input, finals, positions, segment_ids
        )
        cache = DeltaCache(conv=conv, state=state)
    return o, cache


def delta_rule_extend(
    conv_input: jax.Array,
    weight: jax.Array,
    heads: Callable[[jax.Array], tuple[jax.Array, jax.Array, jax.Array]],
    g: jax.Array,
    beta: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    cache: DeltaCache,
) -> tuple[jax.Array, DeltaCache]:
    """A delta-rule mixer's EXTEND rows (a serving step: chunks of prompts and decode tokens of
    the cache's slots) through the recurrence, every chunk's rows side by side
    (`extend_chunks`): each chunk steps its slot's conv and recurrent state (from zero at
    position 0) and leaves them in the slot.

    Args:
      conv_input: [T, local conv channels] the conv's input rows; weight [K, channels].
      heads: Maps conv outputs [C, channels] to their (q, k, v) (the activation and the
        channel split).
      g, beta: The rows' gates and betas, as `gated_delta_rule_step` takes them.
      positions, segment_ids: [T]; segment id -1 marks padding.
      cache: This rank's `DeltaCache` of the step's slots.

    Returns:
      (o [T, v_heads, v_dim], zero on padding rows; the updated cache).
    """

    def step(states, row, valid):
        conv_state, rule_state = states
        x, g_row, beta_row = row
        conv, conv_state = causal_conv1d_step(conv_state, x, weight, None, valid)
        o, rule_state = gated_delta_rule_step(rule_state, *heads(conv), g_row, beta_row, valid)
        return o, (conv_state, rule_state)

    rows = (conv_input.astype(cache.conv.dtype), g, beta)
    o, (conv, state) = extend_chunks(step, rows, positions, segment_ids, (cache.conv, cache.state))
    return o, DeltaCache(conv=conv, state=state)


@dataclasses.dataclass(frozen=True)
class DeltaSplit:
    """How one mixer's heads divide over attention TP.

    Attributes:
      spec: The mixer's shapes.
      attn_tp: Attention-TP size.
    """

    spec: GatedDeltaNetSpec
    attn_tp: int

    def __post_init__(self):
        if self.spec.num_k_heads % self.attn_tp:
            raise ValueError(
                f"Gated DeltaNet num_k_heads ({self.spec.num_k_heads}) must be a multiple of the "
                f"attention-TP size ({self.attn_tp}): each rank holds whole key heads with their "
                "value heads; use an attention-TP size that divides the key heads"
            )

    @property
    def local_k_heads(self) -> int:
        return self.spec.num_k_heads // self.attn_tp

    @property
    def local_v_heads(self) -> int:
        return self.spec.num_v_heads // self.attn_tp

    @property
    def local_conv_channels(self) -> int:
        """This rank's conv channels: its q, k and v."""
        spec = self.spec
        return (2 * spec.key_size + spec.value_size) // self.attn_tp

    @classmethod
    def of(cls, spec: GatedDeltaNetSpec, topology: Topology) -> DeltaSplit:
        return cls(spec, group_size(topology, SumGroup.ATTN_TP))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["conv", "state"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DeltaCache:
    """Static-shape decode state of one Gated DeltaNet mixer: a registered pytree.

    Slots split over attention DP. Inside `shard_map` a rank holds its slots' conv state
    [slots / attn_dp, K - 1, local conv channels] (its q, k and v channels, in that order) and
    recurrent state [slots / attn_dp, local v heads, k_dim, v_dim]. Globally the conv channels
    are the attention-TP ranks' blocks one after another.

    Attributes:
      conv: The last K - 1 conv inputs of each slot, oldest first (activation dtype).
      state: Each slot's delta-rule state (float32).
    """

    conv: jax.Array
    state: jax.Array

    @classmethod
    def specs(cls, topology: Topology, *, stacked: bool = False) -> DeltaCache:
        """The `PartitionSpec` tree for `shard_map`: slots over attention DP, channels and heads
        over attention TP; `stacked` adds a leading, unsplit layer axis."""
        dp = topology.spec_entry((TokenAxis.ATTN_DP,))
        tp = topology.shard_entry(SumGroup.ATTN_TP)
        lead = (None,) if stacked else ()
        return cls(
            conv=PartitionSpec(*lead, dp, None, tp),
            state=PartitionSpec(*lead, dp, tp, None, None),
        )

    @classmethod
    def create(
        cls,
        spec: GatedDeltaNetSpec,
        topology: Topology,
        *,
        slots: int,
        dtype: jnp.dtype = jnp.float32,
        mesh: Mesh | None = None,
    ) -> DeltaCache:
        """A zero cache for `slots` sequences; on `mesh`, each device allocates its shard.

        Raises:
          ValueError: `slots` does not split evenly over attention DP.
        """
        if slots % topology.attn_dp:
            raise ValueError(
                f"Gated DeltaNet cache slots ({slots}) must split evenly over attention DP "
                f"({topology.attn_dp}); got {slots=}"
            )
        split = DeltaSplit.of(spec, topology)
        conv = (slots, spec.conv_kernel - 1, split.attn_tp * split.local_conv_channels)
        state = (slots, spec.num_v_heads, spec.k_dim, spec.v_dim)
        specs = cls.specs(topology)
        devices = jax.tree.map(lambda p: None if mesh is None else NamedSharding(mesh, p), specs)
        return cls(
            conv=jnp.zeros(conv, dtype, device=devices.conv),
            state=jnp.zeros(state, jnp.float32, device=devices.state),
        )

    @staticmethod
    def bytes_per_slot(spec: GatedDeltaNetSpec, topology: Topology, dtype: jnp.dtype) -> int:
        """Bytes one sequence slot's state takes on one device (its conv inputs in `dtype`,
        its recurrent state in float32)."""
        split = DeltaSplit.of(spec, topology)
        conv = (spec.conv_kernel - 1) * split.local_conv_channels * jnp.dtype(dtype).itemsize
        return conv + split.local_v_heads * spec.k_dim * spec.v_dim * 4


@functools.partial(jax.jit, static_argnames=("eps",))
def gated_head_norm(o: jax.Array, z: jax.Array, weight: jax.Array, *, eps: float) -> jax.Array:
    """Hugging Face's `Qwen3NextRMSNormGated`: each head's o [..., v_dim] RMS-normalized (in
    float32 or wider), times `weight` in o's dtype, times silu(z); in o's dtype."""
    acc = accumulation_dtype(o.dtype)
    wide = o.astype(acc)
    normed = wide * lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + eps)
    scaled = weight.reshape((1,) * (o.ndim - 1) + weight.shape) * normed.astype(o.dtype)
    return (scaled * jax.nn.silu(z.astype(acc))).astype(o.dtype)


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet over packed rows, heads split over attention TP; returns the out_proj
    partial.

    Attributes:
      in_proj_qkvz: PER_KEY_HEAD: [hidden, k_heads * (2 k_dim + 2 r v_dim)] in the checkpoint's
        blocks per key head, columns split over attention TP (whole key heads per rank).
      in_proj_ba: PER_KEY_HEAD: [hidden, k_heads * 2 r], split alike.
      in_proj_qk: SEPARATE: [hidden, 2, key_size] (q and k), columns split over attention TP.
      in_proj_v, in_proj_z: SEPARATE: [hidden, value_size], split alike.
      in_proj_ba: SEPARATE: [hidden, 2, v_heads] (b and a), split alike.
      conv_qk: The conv kernel [2, key_size, 1, K] of q's and k's channels, split over
        attention TP.
      conv_v: The conv kernel [value_size, 1, K] of v's channels, split alike.
      dt_bias: [v_heads] added to a before the softplus.
      a_log: [v_heads]: the gate's rate is exp(a_log) (`A_log`).
      norm_weight: [v_dim] weight of the gated output RMSNorm, replicated (`norm.weight`).
      out_proj: [value_size, hidden], rows split over attention TP: the output owes a sum.
      spec: The mixer's shapes and constants.
      split: How heads divide over attention TP.
    """

    def __init__(
        self,
        spec: GatedDeltaNetSpec,
        *,
        topology: Topology,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        if topology.attn_cp > 1:
            raise NotImplementedError(
                "a context-parallel Gated DeltaNet mixer is not implemented; got "
                f"attn_cp={topology.attn_cp}"
            )
        split = DeltaSplit.of(spec, topology)
        heads = SumGroup.ATTN_TP
        common = {"topology": topology, "dtype": dtype, "init_std": init_std, "rngs": rngs}
        hidden = spec.hidden_size
        if spec.projections is DeltaProjections.PER_KEY_HEAD:
            width = spec.num_k_heads * spec.key_head_width
            self.in_proj_qkvz = ColumnParallelLinear(hidden, width, group=heads, **common)
            ba_width = 2 * spec.num_v_heads
            self.in_proj_ba = ColumnParallelLinear(hidden, ba_width, group=heads, **common)
        else:
            self.in_proj_qk = ColumnParallelLinear(
                hidden, spec.key_size, group=heads, parts=2, **common
            )
            self.in_proj_v = ColumnParallelLinear(hidden, spec.value_size, group=heads, **common)
            self.in_proj_z = ColumnParallelLinear(hidden, spec.value_size, group=heads, **common)
            self.in_proj_ba = ColumnParallelLinear(
                hidden, spec.num_v_heads, group=heads, parts=2, **common
            )
        conv = {"group": heads, "topology": topology, "bias": False, "dtype": dtype, "rngs": rngs}
        self.conv_qk = DepthwiseConvWeights(spec.conv_kernel, spec.key_size, parts=2, **conv)
        self.conv_v = DepthwiseConvWeights(spec.conv_kernel, spec.value_size, **conv)
        # Drawn per head (the norm weight around 1), so a rank holding another's slice shows.
        sharded = {"rngs": rngs, "sharding": (topology.shard_entry(heads),)}
        self.dt_bias = param(TimeStepBias(1e-3, 1e-1), (spec.num_v_heads,), dtype, **sharded)
        self.a_log = param(LogUniform(0.5, 16.0), (spec.num_v_heads,), dtype, **sharded)
        self.norm_weight = param(
            NormalAround(1.0, 0.2), (spec.v_dim,), dtype, rngs=rngs, sharding=(None,)
        )
        self.out_proj = RowParallelLinear(spec.value_size, hidden, group=heads, **common)
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

        Args:
          h: [T, hidden] normalized input rows, complete and alike on every attention-TP rank.
          positions: [T] int32 position of each row within its sequence.
          segment_ids: [T] int32 sequence (cache slot) of each row; -1 marks padding.
          cache: None, or this rank's local `DeltaCache`.
          phase: PREFILL: whole sequences packed in rows, each starting from a zero state; with
            a cache, each slot with rows gets its sequence's final conv and recurrent state (the
            other slots keep theirs). DECODE (needs a cache): row i is slot i's next token
            (segment id i, or -1 for an idle slot, whose state is kept). EXTEND (a serving
            step, needs a cache of the step's slots): any tokens of the slots' sequences, each
            stepping its slot's state in row order, from zero at position 0
            (`delta_rule_extend`).

        Returns:
          ([T, hidden] out_proj partial owing a sum over attention TP, zero on padding rows;
          the updated cache, or None without one).

        Raises:
          ValueError: Mismatched row shapes, a DECODE call without a cache or with other than
            one row per slot, an EXTEND call without a cache, or a cache of another shape than
            this rank's.
        """
        rows = h.shape[0]
        slots = None if cache is None else cache.state.shape[0]
        check_stepped_rows(h, positions, segment_ids, phase, slots)
        if cache is not None:
            self._check_cache(cache)
        spec, split = self.spec, self.split
        qkv, z, b, a = self._project(h)
        weight = jnp.concatenate(
            [
                self.conv_qk.weight[...][:, :, 0].reshape(-1, spec.conv_kernel),
                self.conv_v.weight[...][:, 0],
            ]
        ).T  # [K, local q, k, v channels]
        acc = accumulation_dtype(h.dtype)
        beta = jax.nn.sigmoid(b.astype(acc))
        rate = jnp.exp(self.a_log[...].astype(acc))
        g = -rate[None] * jax.nn.softplus(a.astype(acc) + self.dt_bias[...].astype(acc)[None])

        def heads(conv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            return self._split_channels(jax.nn.silu(conv).astype(h.dtype))

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
        z = z.reshape(rows, split.local_v_heads, spec.v_dim)
        y = gated_head_norm(o.astype(h.dtype), z, self.norm_weight[...], eps=spec.eps)
        return self.out_proj(y.reshape(rows, -1)), cache

    def _project(self, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """This rank's conv input [T, local q, k, v channels], gate z [T, local value size],
        and b, a [T, local v heads]."""
        spec, split = self.spec, self.split
        rows, per_key = h.shape[0], spec.values_per_key
        if spec.projections is DeltaProjections.PER_KEY_HEAD:
            qkvz = self.in_proj_qkvz(h).reshape(rows, split.local_k_heads, spec.key_head_width)
            cuts = (spec.k_dim, 2 * spec.k_dim, 2 * spec.k_dim + per_key * spec.v_dim)
            q, k, v, z = jnp.split(qkvz, cuts, axis=-1)
            ba = self.in_proj_ba(h).reshape(rows, split.local_k_heads, 2, per_key)
            b, a = ba[:, :, 0].reshape(rows, -1), ba[:, :, 1].reshape(rows, -1)
            qkv = [x.reshape(rows, -1) for x in (q, k, v)]
            return jnp.concatenate(qkv, axis=-1), z.reshape(rows, -1), b, a
        qk, ba = self.in_proj_qk(h), self.in_proj_ba(h)
        qkv = jnp.concatenate([qk[:, 0], qk[:, 1], self.in_proj_v(h)], axis=-1)
        return qkv, self.in_proj_z(h), ba[:, 0], ba[:, 1]

    def _split_channels(self, conv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """[T, local conv channels] -> q, k [T, local k heads, k_dim], v [T, local v heads,
        v_dim]."""
        spec, split = self.spec, self.split
        rows, key = conv.shape[0], split.local_k_heads * spec.k_dim
        q = conv[:, :key].reshape(rows, split.local_k_heads, spec.k_dim)
        k = conv[:, key : 2 * key].reshape(rows, split.local_k_heads, spec.k_dim)
        v = conv[:, 2 * key :].reshape(rows, split.local_v_heads, spec.v_dim)
        return q, k, v

    def _check_cache(self, cache: DeltaCache) -> None:
        spec, split = self.spec, self.split
        slots = cache.state.shape[0]
        conv = (slots, spec.conv_kernel - 1, split.local_conv_channels)
        state = (slots, split.local_v_heads, spec.k_dim, spec.v_dim)
        if cache.conv.shape != conv or cache.state.shape != state:
            raise ValueError(
                f"this rank's Gated DeltaNet cache must be conv {conv} and state {state}; got "
                f"conv {cache.conv.shape} and state {cache.state.shape}. Pass "
                "DeltaCache.specs(topology) as the cache's shard_map spec."
            )
