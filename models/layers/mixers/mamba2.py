"""The Mamba2 mixer (Nemotron-H's `linear_attention` layers) over packed token rows, split by
heads over attention TP; it returns the out_proj partial, unreduced.

Per row: `in_proj` gives the gate z, the SSM input x, the state projections B and C and the
time step dt; a causal depthwise conv1d (restarting with each sequence) and SiLU run over
[x, B, C]; the SSD recurrence (`models.ssd`) maps x to y; y * silu(z) is RMS-normalized over
each group's channels; `out_proj` maps it back to the hidden size. A prefill runs the chunked
scan over packed rows; a decode step advances each cache slot's conv and SSM state by one row.

Heads split evenly over attention TP. The B/C groups split with them when the attention-TP
size divides the groups; with fewer groups than ranks, each group is shared by
`attn_tp // n_groups` ranks (as a kv head is), whose B/C projections and conv weights stay
replicated and each rank computes its own group's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from boundary_jax import SumGroup, TokenAxis, Topology, ops
from boundary_jax.initializers import Normal, param
from boundary_jax.ops import shard_index

from ...config import Mamba2Spec
from ...inputs.rows import RowsPhase
from ..linear import ColumnParallelLinear, RowParallelLinear, group_size, project
from .ssd import (
    accumulation_dtype,
    causal_conv1d,
    causal_conv1d_step,
    check_stepped_rows,
    extend_chunks,
    gated_rms_norm,
    prefill_slot_states,
    ssd_chunked_scan,
    ssd_step,
    time_step,
)


@dataclasses.dataclass(frozen=True)
class Mamba2Split:
    """How one mixer's heads and B/C groups divide over attention TP.

    Attributes:
      num_heads: SSM heads.
      n_groups: B/C groups.
      attn_tp: Attention-TP size.
    """

    num_heads: int
    n_groups: int
    attn_tp: int

    def __post_init__(self):
        if self.num_heads % self.attn_tp:
            raise ValueError(
                f"Mamba2 num_heads ({self.num_heads}) must be a multiple of the attention-TP "
                f"size ({self.attn_tp}); use an attention-TP size that divides the heads"
            )
        if self.n_groups % self.attn_tp and self.attn_tp % self.n_groups:
            raise ValueError(
                f"Mamba2 n_groups ({self.n_groups}) and the attention-TP size ({self.attn_tp}) "
                "must divide one another: groups are either split over the ranks or each "
                "shared by a whole number of ranks"
            )

    @property
    def groups_sharded(self) -> bool:
        """Whether the B/C projections (and groups) are split over attention TP."""
        return self.n_groups % self.attn_tp == 0

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.attn_tp

    @property
    def local_groups(self) -> int:
        return self.n_groups // self.attn_tp if self.groups_sharded else 1

    @property
    def ranks_per_group(self) -> int:
        """Ranks sharing one group (1 when groups are split)."""
        return 1 if self.groups_sharded else self.attn_tp // self.n_groups

    @classmethod
    def of(cls, spec: Mamba2Spec, topology: Topology) -> Mamba2Split:
        return cls(spec.num_heads, spec.n_groups, group_size(topology, SumGroup.ATTN_TP))


def hf_mixer_params(tensors: Mapping[str, np.ndarray], spec: Mamba2Spec) -> dict[str, np.ndarray]:
    """The global parameter values of a `Mamba2Mixer`, by dotted path, from one Hugging Face
    `NemotronHMamba2Mixer`'s tensors (named relative to the mixer: "in_proj.weight", ...).

    `in_proj.weight` rows are z, x, B, C, dt (`Mamba2Spec.in_proj_rows`) and `conv1d` channels
    x, B, C (`Mamba2Spec.conv_rows`); linear weights [out, in] become [in, out], the conv
    kernel keeps its [channels, 1, K] layout. (A checkpoint is read by `models.weights`,
    each device reading its rows; this is the whole-tensor form, for tests.)

    Raises:
      ValueError: A tensor is missing or has another shape than `spec` gives.
    """
    inner, width, kernel = spec.intermediate_size, spec.bc_width, spec.conv_kernel
    hidden, heads = spec.hidden_size, spec.num_heads
    expected = {
        "in_proj.weight": (2 * inner + 2 * width + heads, hidden),
        "conv1d.weight": (inner + 2 * width, 1, kernel),
        "dt_bias": (heads,),
        "A_log": (heads,),
        "D": (heads,),
        "norm.weight": (inner,),
        "out_proj.weight": (hidden, inner),
    } | ({"conv1d.bias": (inner + 2 * width,)} if spec.conv_bias else {})
    got = {name: tuple(np.shape(tensors[name])) if name in tensors else None for name in expected}
    if got != expected:
        raise ValueError(f"Mamba2 mixer tensors must have shapes {expected}; got {got}")
    in_proj, conv = np.asarray(tensors["in_proj.weight"]), np.asarray(tensors["conv1d.weight"])

    def rows(value: np.ndarray, ranges: dict, *names: str) -> np.ndarray:
        return np.stack([value[slice(*ranges[name])] for name in names])

    params = {
        "in_proj_zx.kernel": rows(in_proj, spec.in_proj_rows, "z", "x").transpose(2, 0, 1),
        "in_proj_bc.kernel": rows(in_proj, spec.in_proj_rows, "B", "C").transpose(2, 0, 1),
        "in_proj_dt.kernel": in_proj[slice(*spec.in_proj_rows["dt"])].T,
        "conv_x.weight": conv[slice(*spec.conv_rows["x"])],
        "conv_bc.weight": rows(conv, spec.conv_rows, "B", "C"),
        "dt_bias": np.asarray(tensors["dt_bias"]),
        "a_log": np.asarray(tensors["A_log"]),
        "d": np.asarray(tensors["D"]),
        "norm_weight": np.asarray(tensors["norm.weight"]),
        "out_proj.kernel": np.asarray(tensors["out_proj.weight"]).T,
    }
    if spec.conv_bias:
        bias = np.asarray(tensors["conv1d.bias"])
        params |= {
            "conv_x.bias": bias[slice(*spec.conv_rows["x"])],
            "conv_bc.bias": rows(bias, spec.conv_rows, "B", "C"),
        }
    return params


@functools.partial(jax.tree_util.register_dataclass, data_fields=["conv", "ssm"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Mamba2Cache:
    """Static-shape decode state of one Mamba2 mixer: a registered pytree.

    Slots split over attention DP. Inside `shard_map` a rank holds its slots' conv state
    [slots / attn_dp, K - 1, local conv channels] (its channels of [x, B, C], in that order)
    and SSM state [slots / attn_dp, local heads, head_dim, state_size]. Globally the conv
    channels are the attention-TP ranks' blocks one after another (with groups shared by
    ranks, each rank's block holds its own copy of its group's B and C).

    Attributes:
      conv: The last K - 1 conv inputs of each slot, oldest first (activation dtype).
      ssm: Each slot's SSM state (float32).
    """

    conv: jax.Array
    ssm: jax.Array

    @staticmethod
    def local_conv_channels(spec: Mamba2Spec, split: Mamba2Split) -> int:
        return split.local_heads * spec.head_dim + 2 * split.local_groups * spec.state_size

    @classmethod
    def bytes_per_slot(cls, spec: Mamba2Spec, topology: Topology, dtype: jnp.dtype) -> int:
        """Bytes one sequence slot's state takes on one device: its conv inputs in `dtype`, its
        heads' SSM state in float32."""
        split = Mamba2Split.of(spec, topology)
        conv = (spec.conv_kernel - 1) * cls.local_conv_channels(spec, split)
        ssm = split.local_heads * spec.head_dim * spec.state_size
        return conv * jnp.dtype(dtype).itemsize + ssm * 4

    @classmethod
    def specs(cls, topology: Topology, *, stacked: bool = False) -> Mamba2Cache:
        """The `PartitionSpec` tree for `shard_map`: slots over attention DP, channels and heads
        over attention TP; `stacked` adds a leading, unsplit layer axis."""
        dp = topology.spec_entry((TokenAxis.ATTN_DP,))
        tp = topology.shard_entry(SumGroup.ATTN_TP)
        lead = (None,) if stacked else ()
        return cls(
            conv=PartitionSpec(*lead, dp, None, tp), ssm=PartitionSpec(*lead, dp, tp, None, None)
        )

    @classmethod
    def create(
        cls,
        spec: Mamba2Spec,
        topology: Topology,
        *,
        slots: int,
        dtype: jnp.dtype = jnp.float32,
        mesh: Mesh | None = None,
        layers: int | None = None,
    ) -> Mamba2Cache:
        """A zero cache for `slots` sequences; on `mesh`, each device allocates its shard.
        `layers`: the stacked caches of that many layers, on a leading axis.

        Raises:
          ValueError: `slots` does not split evenly over attention DP.
        """
        if slots % topology.attn_dp:
            raise ValueError(
                f"Mamba2 cache slots ({slots}) must split evenly over attention DP "
                f"({topology.attn_dp}); got {slots=}"
            )
        split = Mamba2Split.of(spec, topology)
        lead = () if layers is None else (layers,)
        conv = (
            *lead,
            slots,
            spec.conv_kernel - 1,
            split.attn_tp * cls.local_conv_channels(spec, split),
        )
        ssm = (*lead, slots, spec.num_heads, spec.head_dim, spec.state_size)
        specs = cls.specs(topology, stacked=layers is not None)
        devices = jax.tree.map(lambda p: None if mesh is None else NamedSharding(mesh, p), specs)
        return cls(
            conv=jnp.zeros(conv, dtype, device=devices.conv),
            ssm=jnp.zeros(ssm, jnp.float32, device=devices.ssm),
        )


@dataclasses.dataclass(frozen=True)
class NormalAround:
    """N(mean, std^2) values (a norm weight or skip scale near its Hugging Face value)."""

    mean: float
    std: float

    def __call__(self, key: jax.Array | None, shape: tuple[int, ...], dtype) -> jax.Array:
        return (self.mean + Normal(self.std)(key, shape, jnp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class LogUniform:
    """log(u), u uniform in [low, high): Mamba2's `A_log`."""

    low: float
    high: float

    def __call__(self, key: jax.Array | None, shape: tuple[int, ...], dtype) -> jax.Array:
        rate = jax.random.uniform(key, shape, jnp.float32, minval=self.low, maxval=self.high)
        return jnp.log(rate).astype(dtype)


@dataclasses.dataclass(frozen=True)
class TimeStepBias:
    """Mamba2's `dt_bias`: the inverse softplus of a time step drawn log-uniform in [low, high)."""

    low: float
    high: float

    def __call__(self, key: jax.Array | None, shape: tuple[int, ...], dtype) -> jax.Array:
        bounds = {"minval": math.log(self.low), "maxval": math.log(self.high)}
        step = jnp.exp(jax.random.uniform(key, shape, jnp.float32, **bounds))
        return (step + jnp.log(-jnp.expm1(-step))).astype(dtype)


class DepthwiseConvWeights(nnx.Module):
    """The kernel and bias of a depthwise conv, in PyTorch's `Conv1d` layout, over channels split
    like a column projection.

    Attributes:
      weight: [channels, 1, K] (with parts, [parts, channels, 1, K]), channels split over
        `group` (replicated for None). N(0, 1/K).
      bias: [channels] (with parts, [parts, channels]) split alike, N(0, 1/4); or None.
    """

    def __init__(
        self,
        kernel: int,
        channels: int,
        *,
        group: SumGroup | None,
        topology: Topology,
        parts: int | None = None,
        bias: bool,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        entry = None if group is None else topology.shard_entry(group)
        stacked = () if parts is None else (parts,)
        lead = tuple(None for _ in stacked)
        shape = (*stacked, channels)
        self.weight = param(
            Normal(kernel**-0.5),
            (*shape, 1, kernel),
            dtype,
            rngs=rngs,
            sharding=(*lead, entry, None, None),
        )
        self.bias = (
            param(Normal(0.5), shape, dtype, rngs=rngs, sharding=(*lead, entry)) if bias else None
        )


class Mamba2Mixer(nnx.Module):
    """Mamba2 over packed rows, heads (and groups) split over attention TP; returns the
    out_proj partial.

    Hugging Face's `in_proj.weight` [2I + 2GN + H, hidden] (I = intermediate size, G groups,
    N state size, H heads) is, by rows: z [0, I), x [I, 2I), B [2I, 2I + GN), C [2I + GN,
    2I + 2GN), dt [2I + 2GN, ...); its `conv1d.weight` [I + 2GN, 1, K] (and bias) covers x, B,
    C. Here they are split by what divides over the ranks (a checkpoint loads each from its row
    ranges, `Mamba2Spec.in_proj_rows` and `conv_rows`), projections transposed to [in, out]:

    Attributes:
      in_proj_zx: [hidden, 2, I]: z and x; columns (channels) split over attention TP.
      in_proj_bc: [hidden, 2, G * N]: B and C; split over attention TP, or replicated where
        groups are shared by ranks (each rank then uses its group's columns).
      in_proj_dt: [hidden, H], split over attention TP.
      conv_x: The conv kernel [I, 1, K] (and bias [I]) of x's channels, split like in_proj_zx.
      conv_bc: The conv kernel [2, G * N, 1, K] (and bias [2, G * N]) of B's and C's channels,
        split or replicated like in_proj_bc.
      dt_bias: [H] added to dt before the softplus.
      a_log: [H]: the state decay rate is -exp(a_log) (Hugging Face's `A_log`).
      d: [H] skip weight (`D`).
      norm_weight: [I] weight of the gated group RMSNorm (`norm.weight`).
      out_proj: [I, hidden], rows split over attention TP: the output owes a sum over it.
      spec: The mixer's shapes and constants.
      split: How heads and groups divide over attention TP.
      topology: The parallel topology.
    """

    def __init__(
        self,
        spec: Mamba2Spec,
        *,
        topology: Topology,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if topology.attn_cp > 1:
            raise NotImplementedError(
                "a context-parallel Mamba2 mixer is not implemented; got "
                f"attn_cp={topology.attn_cp}"
            )
        split = Mamba2Split.of(spec, topology)
        heads = SumGroup.ATTN_TP
        groups = SumGroup.ATTN_TP if split.groups_sharded else None
        common = {"topology": topology, "dtype": dtype, "rngs": rngs}
        hidden, inner, bc = (
            spec.hidden_size,
            spec.intermediate_size,
            spec.n_groups * spec.state_size,
        )
        self.in_proj_zx = ColumnParallelLinear(hidden, inner, group=heads, parts=2, **common)
        self.in_proj_bc = ColumnParallelLinear(hidden, bc, group=groups, parts=2, **common)
        self.in_proj_dt = ColumnParallelLinear(hidden, spec.num_heads, group=heads, **common)
        conv = {"bias": spec.conv_bias, **common}
        self.conv_x = DepthwiseConvWeights(spec.conv_kernel, inner, group=heads, **conv)
        self.conv_bc = DepthwiseConvWeights(spec.conv_kernel, bc, group=groups, parts=2, **conv)
        entry = (topology.shard_entry(heads),)
        # Hugging Face's initialization, drawn per head (and norm weights around 1), so that a
        # rank holding another rank's slice changes the output.
        heads_shape = (spec.num_heads,)
        sharded = {"rngs": rngs, "sharding": entry}
        self.dt_bias = param(TimeStepBias(1e-3, 1e-1), heads_shape, dtype, **sharded)
        self.a_log = param(LogUniform(1.0, 16.0), heads_shape, dtype, **sharded)
        self.d = param(NormalAround(1.0, 0.5), heads_shape, dtype, **sharded)
        self.norm_weight = param(NormalAround(1.0, 0.2), (inner,), dtype, **sharded)
        self.out_proj = RowParallelLinear(inner, hidden, group=heads, **common)
        self.spec = spec
        self.split = split
        self.topology = topology

    def __call__(
        self,
        h: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        cache: Mamba2Cache | None = None,
        *,
        phase: RowsPhase = RowsPhase.PREFILL,
    ) -> tuple[jax.Array, Mamba2Cache | None]:
        """Runs the mixer over this rank's rows; with a cache, also updates its slots.

        Args:
          h: [T, hidden] normalized input rows, complete and alike on every attention-TP rank.
          positions: [T] int32 position of each row within its sequence.
          segment_ids: [T] int32 sequence (cache slot) of each row; -1 marks padding.
          cache: None, or this rank's local `Mamba2Cache`.
          phase: PREFILL: whole sequences packed in rows (`pack_sequences`), each starting
            from a zero state; with a cache, each slot with rows gets its sequence's final
            conv and SSM state (the other slots keep theirs). DECODE (needs a cache): row i is
            slot i's next token (segment id i, or -1 for an idle slot, whose state is kept).
            EXTEND (a serving step, needs a cache of the step's slots): any tokens of the
            slots' sequences (chunks of prompts, decode tokens), each stepping its slot's state
            in row order, from zero at position 0.

        Returns:
          ([T, hidden] out_proj partial owing a sum over attention TP, zero on padding rows;
          the updated cache, or None without one).

        Raises:
          ValueError: Mismatched row shapes, a DECODE call without a cache or with other than
            one row per slot, or a cache of another shape than this rank's.
        """
        rows = h.shape[0]
        slots = None if cache is None else cache.ssm.shape[0]
        check_stepped_rows(h, positions, segment_ids, phase, slots)
        if cache is not None:
            self._check_cache(cache)
        spec, split = self.spec, self.split
        zx = self.in_proj_zx(h)  # [T, 2, local I]
        z, x = zx[:, 0], zx[:, 1]
        bc = project(h, self._group_columns(self.in_proj_bc.kernel[...], axis=2), None)
        xbc = jnp.concatenate([x, bc.reshape(rows, -1)], axis=-1)  # [T, local conv channels]
        weight, bias = self._conv_weights()
        dt = time_step(self.in_proj_dt(h), self.dt_bias[...], spec.time_step_limit)
        a = -jnp.exp(self.a_log[...].astype(dt.dtype))
        if phase is RowsPhase.EXTEND:
            y, cache = self._extend(xbc, dt, a, weight, bias, positions, segment_ids, cache)
            y = self._gated_norm(y.reshape(rows, split.local_heads * spec.head_dim), z)
            return self.out_proj(y.astype(h.dtype)), cache
        if phase is RowsPhase.PREFILL:
            conv = causal_conv1d(xbc, weight, bias, positions, segment_ids)
        else:
            valid = segment_ids >= 0
            conv, conv_state = causal_conv1d_step(cache.conv, xbc, weight, bias, valid)
        x, b, c = self._split_channels(jax.nn.silu(conv).astype(h.dtype))
        if phase is RowsPhase.PREFILL:
            slots = 0 if cache is None else cache.ssm.shape[0]
            y, finals = ssd_chunked_scan(
                *(x, dt, a, b, c, self.d[...], positions, segment_ids),
                chunk_size=spec.chunk_size,
                num_slots=slots,
            )
            if cache is not None:
                cache = Mamba2Cache(
                    *prefill_slot_states(cache.conv, cache.ssm, xbc, finals, positions, segment_ids)
                )
        else:
            y, ssm = ssd_step(cache.ssm, x, dt, a, b, c, self.d[...], valid)
            cache = Mamba2Cache(conv=conv_state, ssm=ssm)
        y = self._gated_norm(y.reshape(rows, split.local_heads * spec.head_dim), z)
        return self.out_proj(y.astype(h.dtype)), cache

    def _group_index(self) -> jax.Array | int:
        """The group this rank's heads use, where groups are shared by ranks."""
        return shard_index(self.topology, SumGroup.ATTN_TP) // self.split.ranks_per_group

    def _group_columns(self, value: jax.Array, *, axis: int) -> jax.Array:
        """This rank's B/C columns: all local ones, or its group's of a replicated array."""
        if self.split.groups_sharded:
            return value
        size = self.spec.state_size
        return lax.dynamic_slice_in_dim(value, self._group_index() * size, size, axis=axis)

    def _conv_weights(self) -> tuple[jax.Array, jax.Array | None]:
        """This rank's [K, local conv channels] kernel and bias, channels ordered x, B, C."""
        x_weight = self.conv_x.weight[...][:, 0].T  # [K, local I]
        bc_weight = self._group_columns(self.conv_bc.weight[...], axis=1)[:, :, 0]
        bc_weight = bc_weight.reshape(-1, self.spec.conv_kernel).T  # [K, B's then C's]
        weight = jnp.concatenate([x_weight, bc_weight], axis=-1)
        if self.conv_x.bias is None:
            return weight, None
        bc_bias = self._group_columns(self.conv_bc.bias[...], axis=1).reshape(-1)
        return weight, jnp.concatenate([self.conv_x.bias[...], bc_bias])

    def _extend(
        self,
        xbc: jax.Array,
        dt: jax.Array,
        a: jax.Array,
        weight: jax.Array,
        bias: jax.Array | None,
        positions: jax.Array,
        segment_ids: jax.Array,
        cache: Mamba2Cache,
    ) -> tuple[jax.Array, Mamba2Cache]:
        """EXTEND rows through the recurrence, every chunk's rows side by side
        (`extend_chunks`): each chunk steps its slot's conv and SSM state (from zero at
        position 0) and leaves them in the slot. Returns ([T, heads, P] outputs, zero on
        padding rows; the updated cache)."""

        def step(states, row, valid):
            conv_state, ssm_state = states
            xbc_row, dt_row = row
            conv, conv_state = causal_conv1d_step(conv_state, xbc_row, weight, bias, valid)
            x, b, c = self._split_channels(jax.nn.silu(conv).astype(xbc.dtype))
            y, ssm_state = ssd_step(ssm_state, x, dt_row, a, b, c, self.d[...], valid)
            return y, (conv_state, ssm_state)

        rows = (xbc.astype(cache.conv.dtype), dt)
        y, (conv, ssm) = extend_chunks(step, rows, positions, segment_ids, (cache.conv, cache.ssm))
        return y, Mamba2Cache(conv=conv, ssm=ssm)

    def _split_channels(self, conv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """[T, local conv channels] -> x [T, local heads, P], B and C [T, local groups, N]."""
        spec, split = self.spec, self.split
        rows, inner = conv.shape[0], split.local_heads * spec.head_dim
        bc = conv[:, inner:].reshape(rows, 2, split.local_groups, spec.state_size)
        x = conv[:, :inner].reshape(rows, split.local_heads, spec.head_dim)
        return x, bc[:, 0], bc[:, 1]

    def _gated_norm(self, y: jax.Array, z: jax.Array) -> jax.Array:
        """The gated group RMSNorm of this rank's channels. Where a group is shared by ranks,
        its mean square spans theirs: each rank's [T, groups] sums of squares cross attention
        TP in one small all-reduce."""
        spec, split = self.spec, self.split
        group_width = spec.intermediate_size // spec.n_groups
        weight = self.norm_weight[...]
        if split.groups_sharded:
            return gated_rms_norm(y, z, weight, group_size=group_width, eps=spec.eps)
        acc = accumulation_dtype(y.dtype)
        gated = y.astype(acc) * jax.nn.silu(z.astype(acc))
        mine = jnp.arange(spec.n_groups) == self._group_index()  # [G]
        squares = jnp.where(mine[None], jnp.sum(gated * gated, axis=-1, keepdims=True), 0)
        over_tp = ops.all_reduce(self.topology.sum_axes(SumGroup.ATTN_TP), self.topology)
        squares = ops.run(over_tp, squares)[:, self._group_index()]  # [T]
        normed = gated * lax.rsqrt(squares / group_width + spec.eps)[:, None]
        return weight[None] * normed.astype(y.dtype)

    def _check_cache(self, cache: Mamba2Cache) -> None:
        spec, split = self.spec, self.split
        slots = cache.ssm.shape[0]
        conv = (slots, spec.conv_kernel - 1, Mamba2Cache.local_conv_channels(spec, split))
        ssm = (slots, split.local_heads, spec.head_dim, spec.state_size)
        if cache.conv.shape != conv or cache.ssm.shape != ssm:
            raise ValueError(
                f"this rank's Mamba2 cache must be conv {conv} and ssm {ssm}; got conv "
                f"{cache.conv.shape} and ssm {cache.ssm.shape}. Pass Mamba2Cache.specs(topology) "
                "as the cache's shard_map spec."
            )
