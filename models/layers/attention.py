"""Grouped-query self-attention over packed token rows, split by heads over attention TP.

Rows are one attention-DP rank's tokens: `positions` [T] is each row's position within its
sequence and `segment_ids` [T] its sequence (0..S-1, -1 for padding). A row attends to the rows
(or cached positions) of its own sequence at positions <= its own (and within the sliding
window). The output is this rank's o_proj partial, unreduced over attention TP.

Two kinds of call (`RowsPhase`): a prefill attends within its packed rows (and writes them into
the cache, if one is given, in place); a decode step has one row per cache slot, row i being
slot i's next token, and attends over the cache directly (no per-row copy of the cache).
The attention itself runs through an `AttentionImpl`: plain `jnp` (the reference, and the CPU
path) or cuDNN's fused attention (GPU; packed variable-length prefill and length-masked decode).
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from boundary_jax import RMSNorm, SumGroup, TokenAxis, Topology, shard_index, sharded_rms_norms
from boundary_jax.designs import Quantized

from ..config import DecoderConfig
from ..rows import RowsPhase
from .linear import DENSE_LINEARS, Linears, group_size, sharded_param
from .rope import apply_rope, rope_inv_freq

PREFILL_KEY_BLOCK = 64
"""Query rows per block of the `jnp` prefill when a static reach bounds its keys."""


class AttentionImpl(enum.Enum):
    """Which kernel computes softmax(q k^T) v.

    XLA: plain `jnp` einsums with float32 scores (the reference; every platform, every dtype).
    CUDNN: cuDNN fused attention (GPU): packed variable-length causal prefill and decode over
    the cache with per-slot key lengths. Where cuDNN does not take the call (float32, a
    sliding window, head_dim not a multiple of 8 or over 128) the layer uses XLA instead.
    """

    XLA = "xla"
    CUDNN = "cudnn"

    @classmethod
    def for_platform(cls, platform: str) -> AttentionImpl:
        """The measured-fastest choice for a JAX platform name ("cpu", "gpu", "cuda", "tpu")."""
        return cls.CUDNN if platform in ("gpu", "cuda") else cls.XLA


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """How the query and kv heads of one attention layer divide over attention TP.

    Query heads split evenly. Kv heads split too when their number is a multiple of the
    attention-TP size; otherwise (fewer kv heads than ranks, each shared by
    `attn_tp // num_kv_heads` ranks) the k/v projections stay replicated and each rank computes
    only the one kv head its query heads use.

    Attributes:
      num_heads: Query heads of the layer.
      num_kv_heads: Key/value heads of the layer.
      attn_tp: Attention-TP size.
    """

    num_heads: int
    num_kv_heads: int
    attn_tp: int

    def __post_init__(self):
        if self.num_heads % self.attn_tp:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of the attention-TP size "
                f"({self.attn_tp}); use an attention-TP size that divides the query heads"
            )
        if self.num_kv_heads % self.attn_tp and self.attn_tp % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) and the attention-TP size ({self.attn_tp}) "
                "must divide one another: kv heads are either split over the ranks or each "
                "shared by a whole number of ranks"
            )

    @property
    def kv_sharded(self) -> bool:
        """Whether the k/v projections (and kv heads) are split over attention TP."""
        return self.num_kv_heads % self.attn_tp == 0

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.attn_tp

    @property
    def local_kv_heads(self) -> int:
        return self.num_kv_heads // self.attn_tp if self.kv_sharded else 1

    @property
    def cache_heads(self) -> int:
        """Kv-head extent of the global cache: the kv heads, or one per rank when shared."""
        return self.local_kv_heads * self.attn_tp

    @classmethod
    def of(cls, config: DecoderConfig, topology: Topology) -> HeadSplit:
        return cls(config.num_heads, config.num_kv_heads, group_size(topology, SumGroup.ATTN_TP))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Static-shape key/value cache of one attention layer: a registered pytree.

    Globally [slots, max_len, cache heads, head_dim], with slots split over attention DP and
    heads over attention TP (`partition_spec`). Inside `shard_map` a rank holds
    [slots / attn_dp, max_len, local kv heads, head_dim]; slot s holds sequence
    `segment_ids == s` of that attention-DP rank, at index [s, position]. Where kv heads are
    shared by several ranks (`HeadSplit.kv_sharded` is False) the global cache has one head per
    attention-TP rank, each a copy of the kv head that rank uses.

    Attributes:
      k: Keys after q/k norm and RoPE.
      v: Values.
    """

    k: jax.Array
    v: jax.Array

    @staticmethod
    def global_shape(
        config: DecoderConfig, topology: Topology, *, slots: int, max_len: int
    ) -> tuple[int, int, int, int]:
        """The [slots, max_len, cache heads, head_dim] shape of `k` and `v` outside shard_map.

        Raises:
          ValueError: `slots` is not a multiple of the attention-DP size.
        """
        if slots % topology.attn_dp:
            raise ValueError(
                f"KV cache slots ({slots}) must split evenly over attention DP "
                f"({topology.attn_dp}); got {slots=}"
            )
        heads = HeadSplit.of(config, topology)
        return (slots, max_len, heads.cache_heads, config.head_dim)

    @staticmethod
    def partition_spec(topology: Topology) -> PartitionSpec:
        """Slots over attention DP, heads over attention TP."""
        dp = topology.spec_entry((TokenAxis.ATTN_DP,))
        return PartitionSpec(dp, None, topology.shard_entry(SumGroup.ATTN_TP), None)

    @classmethod
    def specs(cls, topology: Topology, *, stacked: bool = False) -> KVCache:
        """The cache's `PartitionSpec` tree, for `shard_map` in/out specs; `stacked`: of the
        stacked caches of a scanned run of layers (a leading, unsplit layer axis)."""
        spec = cls.partition_spec(topology)
        if stacked:
            spec = PartitionSpec(None, *spec)
        return cls(k=spec, v=spec)

    @classmethod
    def create(
        cls,
        config: DecoderConfig,
        topology: Topology,
        *,
        slots: int,
        max_len: int,
        dtype: jnp.dtype = jnp.float32,
        mesh: Mesh | None = None,
        layers: int | None = None,
    ) -> KVCache:
        """A zero cache of the global shape; on `mesh`, each device allocates only its shard.
        `layers`: the stacked caches of a scanned run of that many layers, on a leading axis
        (None: one layer's)."""
        shape = cls.global_shape(config, topology, slots=slots, max_len=max_len)
        spec = cls.specs(topology, stacked=layers is not None).k
        if layers is not None:
            shape = (layers, *shape)
        device = None if mesh is None else NamedSharding(mesh, spec)
        return cls(
            k=jnp.zeros(shape, dtype, device=device), v=jnp.zeros(shape, dtype, device=device)
        )


class WholeProjectionNorm(nnx.Module):
    """The weight of an RMSNorm over a whole q or k projection (all heads; OLMo 2), split over
    attention TP like the projection's columns (replicated where the kv heads are shared).

    Attributes:
      weight: [heads * head_dim] global; this rank's columns inside `shard_map`.
      eps: Added to the mean square (over the whole projection).
    """

    def __init__(
        self, width: int, *, group: SumGroup | None, topology: Topology, eps: float, dtype
    ):
        entry = None if group is None else topology.shard_entry(group)
        self.weight = sharded_param(jnp.ones((width,), dtype), (entry,))
        self.eps = eps


class Attention(nnx.Module):
    """Self-attention with q/o split by heads over attention TP; returns the o_proj partial.

    Attributes:
      q_proj: [hidden, heads * head_dim], columns split over attention TP; with
        `config.qkv_bias` (Qwen2) a bias split with its heads.
      kv_proj: [hidden, 2, kv heads * head_dim]: the k and v projections stacked (one matmul),
        split over attention TP or replicated (`heads`); its bias [2, kv heads * head_dim] (if
        any) with it, a replicated one cut to this rank's kv head.
      o_proj: [heads * head_dim, hidden], rows split over attention TP.
      q_norm: RMSNorm of the queries before RoPE: per head (Qwen3, EXAONE 4.0, Gemma 3: an
        `RMSNorm` [head_dim]), over the whole projection (OLMo 2: a `WholeProjectionNorm`), or
        None.
      k_norm: As `q_norm`, for the keys.
      heads: How the heads divide over attention TP.
      config: The decoder configuration (head_dim, q/k norm, query scale).
      layer: This layer's window and RoPE (`DecoderConfig.layer_attention`).
      topology: The parallel topology.
      impl: The attention kernel (`AttentionImpl`).

    The projections come from `linears` (dense by default; `fp8_linear.Fp8Linears` makes them
    FP8 block weights, [out, in] as Hugging Face stores them, that take FP8 input).
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        topology: Topology,
        dtype: jnp.dtype = jnp.float32,
        impl: AttentionImpl = AttentionImpl.XLA,
        layer_index: int = 0,
        linears: Linears = DENSE_LINEARS,
        rngs: nnx.Rngs,
    ):
        if topology.attn_cp > 1:
            raise NotImplementedError(
                f"context-parallel attention is not implemented; got attn_cp={topology.attn_cp}"
            )
        heads = HeadSplit.of(config, topology)
        kv_group = SumGroup.ATTN_TP if heads.kv_sharded else None
        hidden, head_dim = config.hidden_size, config.head_dim
        common = {"topology": topology, "dtype": dtype, "rngs": rngs}
        q_width, kv_width = config.num_heads * head_dim, config.num_kv_heads * head_dim
        bias = config.qkv_bias
        self.q_proj = linears.column(hidden, q_width, group=SumGroup.ATTN_TP, bias=bias, **common)
        self.kv_proj = linears.column(
            hidden, kv_width, group=kv_group, parts=2, bias=bias, **common
        )
        self.o_proj = linears.row(q_width, hidden, group=SumGroup.ATTN_TP, **common)
        eps = config.rms_norm_eps
        if config.qk_norm_whole:
            norm = {"topology": topology, "eps": eps, "dtype": dtype}
            self.q_norm = WholeProjectionNorm(q_width, group=SumGroup.ATTN_TP, **norm)
            self.k_norm = WholeProjectionNorm(kv_width, group=kv_group, **norm)
        elif config.qk_norm:
            norm = {"eps": eps, "gemma": config.gemma_norms, "param_dtype": dtype}
            self.q_norm = RMSNorm(head_dim, **norm)
            self.k_norm = RMSNorm(head_dim, **norm)
        else:
            self.q_norm = None
            self.k_norm = None
        self.heads = heads
        self.config = config
        self.layer = config.layer_attention(layer_index)
        self.topology = topology
        self.impl = impl

    def __call__(
        self,
        h: jax.Array | Quantized,
        positions: jax.Array,
        segment_ids: jax.Array,
        cache: KVCache | None = None,
        *,
        phase: RowsPhase = RowsPhase.PREFILL,
        max_sequence_rows: int | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Attends each row to its sequence; with a cache, also stores this call's keys/values.

        Args:
          h: [T, hidden] normalized input rows, complete and alike on every attention-TP rank
            (or their FP8 `Quantized` form, for FP8 projections).
          positions: [T] int32 position of each row within its sequence.
          segment_ids: [T] int32 sequence (cache slot) of each row; -1 marks padding.
          cache: None to attend over these rows alone; else this rank's local cache.
          phase: PREFILL: each sequence's rows are all in this call, contiguous, at positions
            0, 1, ... (as `pack_sequences` lays them out); they attend among themselves and,
            with a cache, are written into it in place. DECODE (needs a cache): row i is slot
            i's next token (segment id i, or -1 for an idle slot); it is written at its
            position and attends to cached positions 0..position. Positions >= max_len are
            not stored.
          max_sequence_rows: Static: no PREFILL sequence has more rows (`TokenRows`). With it
            (or a sliding window) the `jnp` prefill attends block by block to the keys within
            reach instead of over all T x T row pairs.

        Returns:
          ([T, hidden] o_proj partial owing a sum over attention TP, with zero rows for
          padding, except idle DECODE rows on the cuDNN path, which hold finite values; the
          updated cache, or None without one).

        Raises:
          ValueError: Mismatched row shapes, a DECODE call without a cache or with other than
            one row per cache slot.
        """
        rows = h.shape[0]
        if positions.shape != (rows,) or segment_ids.shape != (rows,):
            raise ValueError(
                f"positions and segment_ids must be [T] for h [T, hidden]; got {h.shape=}, "
                f"{positions.shape=}, {segment_ids.shape=}"
            )
        if phase is RowsPhase.DECODE and (cache is None or cache.k.shape[0] != rows):
            slots = None if cache is None else cache.k.shape[0]
            raise ValueError(
                "a DECODE call needs a cache and one row per cache slot (row i is slot i); "
                f"got {rows} rows and cache slots {slots}. Use `decode_rows` to lay them out."
            )
        head_dim = self.config.head_dim
        q = self.q_proj(h).reshape(rows, self.heads.local_heads, head_dim)
        k, v = self._project_kv(h)
        if self.config.qk_norm_whole:
            q, k = self._whole_qk_norm(q, k)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.layer.rope_theta is not None:
            inv_freq = rope_inv_freq(head_dim, self.layer.rope_theta, self.layer.rope_scaling)
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        valid = segment_ids >= 0
        cudnn = self._takes_cudnn(q.dtype)
        if phase is RowsPhase.PREFILL:
            if cache is not None:
                cache = self._write(cache, k, v, positions, segment_ids)
            if cudnn:
                # Segment ids are cache slots, so the slots bound the segments per call.
                bound = rows if cache is None else cache.k.shape[0]
                out = _packed_cudnn(q, k, v, segment_ids, max_segments=bound, scale=self.scale)
                # cuDNN leaves rows outside every segment unwritten.
                out = jnp.where(valid[:, None, None], out, 0)
            else:
                out = self._attend_packed(
                    self._grouped(q),
                    k.astype(q.dtype),
                    v,
                    positions,
                    segment_ids,
                    max_sequence_rows,
                )
        else:
            # Row i is slot i: write each row's key at its position, then read the cache as is.
            slot_of_row = jnp.arange(rows, dtype=segment_ids.dtype)
            cache = self._write(cache, k, v, positions, jnp.where(valid, slot_of_row, -1))
            if cudnn:
                out = _decode_cudnn(q, cache, positions, self.scale)
            else:
                key_positions = jnp.arange(cache.k.shape[1], dtype=positions.dtype)
                mask = self._visible(positions, key_positions) & valid[:, None]
                keys, values = cache.k.astype(q.dtype), cache.v.astype(v.dtype)
                out = _attend(self._grouped(q), keys, values, mask, "tskd", self.scale)
        # The jnp paths give padding rows zero weights. A cuDNN decode row of an idle slot
        # reads its slot's first key (finite values): masking it would cost a kernel per layer
        # and step, and the batch's token counts (or the caller) ignore that row.
        out = out.astype(q.dtype).reshape(rows, self.heads.local_heads * head_dim)
        return self.o_proj(out), cache

    @property
    def scale(self) -> float:
        """The factor of the attention scores: `query_pre_attn_scalar ** -0.5` (Gemma 3), else
        `head_dim ** -0.5`."""
        scalar = self.config.query_pre_attn_scalar
        return (self.config.head_dim if scalar is None else scalar) ** -0.5

    def _whole_qk_norm(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """OLMo 2's q/k RMSNorms over all heads, their sums of squares in one small all-reduce
        over attention TP (the heads are split there)."""
        rows, head_dim = q.shape[0], self.config.head_dim
        k_weight = self.k_norm.weight[...]
        if not self.heads.kv_sharded:
            # The rank computes one shared kv head: the norm weight's columns of that head.
            ranks_per_head = self.heads.attn_tp // self.heads.num_kv_heads
            head = shard_index(self.topology, SumGroup.ATTN_TP) // ranks_per_head
            k_weight = lax.dynamic_slice_in_dim(k_weight, head * head_dim, head_dim)
        q_flat, k_flat = sharded_rms_norms(
            (q.reshape(rows, -1), k.reshape(rows, -1)),
            (self.q_norm.weight[...], k_weight),
            self.topology,
            SumGroup.ATTN_TP,
            eps=self.q_norm.eps,
        )
        return q_flat.reshape(q.shape), k_flat.reshape(k.shape)

    def _grouped(self, q: jax.Array) -> jax.Array:
        """[T, heads, D] -> [T, kv, group, D]: query head n uses kv head n // group."""
        return q.reshape(q.shape[0], self.heads.local_kv_heads, -1, q.shape[-1])

    def _takes_cudnn(self, dtype: jnp.dtype) -> bool:
        """Whether cuDNN computes this layer's attention (else the `jnp` reference does)."""
        return (
            self.impl is AttentionImpl.CUDNN
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and self.layer.sliding_window is None
            and self.config.head_dim % 8 == 0
            and self.config.head_dim <= 128
        )

    def _project_kv(self, h: jax.Array | Quantized) -> tuple[jax.Array, jax.Array]:
        """k and v, [T, local kv heads, head_dim] each; a shared kv head is cut from the
        replicated kernel (and bias)."""
        head_dim = self.config.head_dim
        if self.heads.kv_sharded:
            kv = self.kv_proj(h)
        else:
            ranks_per_head = self.heads.attn_tp // self.heads.num_kv_heads
            head = shard_index(self.topology, SumGroup.ATTN_TP) // ranks_per_head
            kv = self.kv_proj.columns(h, head * head_dim, head_dim)
        kv = kv.reshape(h.shape[0], 2, self.heads.local_kv_heads, head_dim)
        return kv[:, 0], kv[:, 1]

    def _attend_packed(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        max_sequence_rows: int | None,
    ) -> jax.Array:
        """Prefill attention among packed rows, [T, kv, group, D].

        Rows of a sequence are contiguous, so a row's keys lie at most `reach - 1` rows back,
        where `reach` is the longer bound of the sequence length and the sliding window. When
        that reach is static and well short of T, queries go in blocks of `block` rows and each
        block attends to the `width` key blocks ending at its own, so scores cost
        T x width * block instead of T x T (forward and backward).
        """
        rows = q.shape[0]
        bounds = [b for b in (max_sequence_rows, self.layer.sliding_window) if b is not None]
        reach = min(bounds) if bounds else rows
        block = min(PREFILL_KEY_BLOCK, 1 << max(reach - 1, 1).bit_length())
        width = -(-(reach - 1) // block) + 1
        if width * block >= rows:
            mask = segment_ids[:, None] == segment_ids[None, :]
            mask &= self._visible(positions, positions) & (segment_ids >= 0)[:, None]
            return _attend(q, k, v, mask, "skd", self.scale)
        blocks = -(-rows // block)
        pad = blocks * block - rows

        def blocked(x: jax.Array, fill: int) -> jax.Array:
            x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
            return x.reshape(blocks, block, *x.shape[1:])

        def windows(x: jax.Array, fill: int) -> jax.Array:
            """[blocks, block, ...] -> [blocks, width * block, ...]: key blocks i-width+1..i."""
            before = jnp.full((width - 1, *x.shape[1:]), fill, x.dtype)
            x = jnp.concatenate([before, x])
            stacked = jnp.stack([x[j : j + blocks] for j in range(width)], axis=1)
            return stacked.reshape(blocks, width * block, *x.shape[2:])

        segments, where = blocked(segment_ids, -1), blocked(positions, 0)
        mask = segments[:, :, None] == windows(segments, -1)[:, None, :]
        mask &= self._visible(where, windows(where, 0)) & (segments >= 0)[:, :, None]
        out = _attend_blocks(
            blocked(q, 0), windows(blocked(k, 0), 0), windows(blocked(v, 0), 0), mask, self.scale
        )
        return out.reshape(blocks * block, *q.shape[1:])[:rows]

    def _visible(self, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
        """[..., T, S] causal (and sliding-window) visibility of key positions [..., S] from
        query positions [..., T]."""
        distance = query_positions[..., :, None] - key_positions[..., None, :]
        visible = distance >= 0
        if self.layer.sliding_window is not None:
            visible &= distance < self.layer.sliding_window
        return visible

    def _write(
        self,
        cache: KVCache,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
    ) -> KVCache:
        expected = (self.heads.local_kv_heads, self.config.head_dim)
        if cache.k.shape[2:] != expected or cache.v.shape != cache.k.shape:
            raise ValueError(
                "the local KV cache must be [slots, max_len, local kv heads, head_dim] with "
                f"(local kv heads, head_dim)={expected}; got k {cache.k.shape}, v "
                f"{cache.v.shape}. Pass KVCache.specs(topology) as the cache's shard_map spec."
            )
        # Padding rows point past the last slot, each at its own row index, so every index is
        # distinct (XLA may then scatter without atomics) and the out-of-range ones drop.
        valid = segment_ids >= 0
        slot = jnp.where(valid, segment_ids, cache.k.shape[0])
        position = jnp.where(
            valid, positions, jnp.arange(positions.shape[0], dtype=positions.dtype)
        )
        write = {"mode": "drop", "unique_indices": True}
        return KVCache(
            k=cache.k.at[slot, position].set(k.astype(cache.k.dtype), **write),
            v=cache.v.at[slot, position].set(v.astype(cache.v.dtype), **write),
        )


def _packed_cudnn(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    max_segments: int,
    scale: float,
) -> jax.Array:
    """Causal attention within each segment of packed rows, through cuDNN's ragged layout.

    q is [T, heads, D], k/v [T, kv, D]. Each segment must be contiguous with positions 0, 1,
    ... (causality is by row order); padding rows (-1) get unspecified values the caller masks.
    Segment ids must be < `max_segments` (static): cuDNN schedules work for every segment
    entry, so a tight bound (the cache slots) keeps empty entries cheap. cuDNN skips the score
    blocks between segments, so packing costs no T x T work.
    """
    # Private but stable since JAX 0.4.3x: the public wrapper takes no segment offsets.
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    rows = segment_ids.shape[0]
    segments = max_segments
    index = jnp.arange(rows, dtype=jnp.int32)
    seg = jnp.where(segment_ids >= 0, segment_ids, segments)
    lengths = jax.ops.segment_sum(jnp.ones(rows, jnp.int32), seg, segments + 1)[:segments]
    first = jax.ops.segment_min(index, seg, segments + 1)[:segments]
    # cuDNN wants the segments in row order, the real ones first, the rest -1.
    first = jnp.where(lengths > 0, first, rows)
    order = jnp.argsort(first)
    first, lengths = first[order], lengths[order]
    offsets = jnp.where(lengths > 0, first, -1)
    offsets = jnp.concatenate([offsets, jnp.full((1,), -1, jnp.int32)])[None]
    seqlen = jnp.where(lengths > 0, lengths, -1)[None]
    out = cudnn.dot_product_attention(
        q[None],
        k[None].astype(q.dtype),
        v[None].astype(q.dtype),
        q_seqlen=seqlen,
        kv_seqlen=seqlen,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=scale,
        mask_type=cudnn.MaskType.PADDING_CAUSAL,
    )
    return out[0]


def _decode_cudnn(q: jax.Array, cache: KVCache, positions: jax.Array, scale: float) -> jax.Array:
    """Row i's query [heads, D] over slot i's cached keys 0..positions[i], through cuDNN.

    The cache is read in place ([slots, max_len, kv, D] is cuDNN's BSNH layout); an idle row
    reads its slot's first key.
    """
    lengths = jnp.clip(positions + 1, 1, cache.k.shape[1]).astype(jnp.int32)
    return decode_attention_cudnn(
        q, cache.k.astype(q.dtype), cache.v.astype(q.dtype), lengths, scale=scale
    )


def decode_attention_cudnn(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    grouped: bool = False,
    scale: float | None = None,
) -> jax.Array:
    """One query row per slot over its cache: [B, heads, D] x [B, S, kv, D] -> [B, heads, D].

    Slot b attends to keys 0..lengths[b]-1 (lengths >= 1); scores are scaled by `scale` (None:
    `D ** -0.5`). With `grouped` (the default), the
    query heads that share a kv head become that many query rows of one kv head: cuDNN then
    reads each slot's keys once per kv head, instead of once per query head.
    """
    batch, heads, head_dim = q.shape
    kv = k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    if not grouped:
        out = jax.nn.dot_product_attention(
            q[:, None],
            k_cache,
            v_cache,
            scale=scale,
            query_seq_lengths=jnp.ones_like(lengths),
            key_value_seq_lengths=lengths,
            implementation="cudnn",
        )
        return out[:, 0]
    group = heads // kv
    rows = q.reshape(batch, kv, group, head_dim).transpose(0, 2, 1, 3)  # [B, group, kv, D]
    out = jax.nn.dot_product_attention(
        rows,
        k_cache,
        v_cache,
        scale=scale,
        query_seq_lengths=jnp.full_like(lengths, group),
        key_value_seq_lengths=lengths,
        implementation="cudnn",
    )
    return out.transpose(0, 2, 1, 3).reshape(batch, heads, head_dim)


def _acc(dtype: jnp.dtype) -> jnp.dtype:
    """FP32 accumulation, or the input's dtype where that is wider."""
    return jnp.promote_types(dtype, jnp.float32)


def _attend(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    key_axes: str,
    scale: float,
) -> jax.Array:
    """Softmax(q k^T * scale) v with FP32 scores and weights.

    q is [T, kv, group, D]; keys/values are [S, kv, D] (`key_axes` "skd") or one set per row,
    [T, S, kv, D] ("tskd"); mask is [T, S]. Returns [T, kv, group, D].
    """
    acc = _acc(q.dtype)
    scores = jnp.einsum(f"tkgd,{key_axes}->tkgs", q, keys, preferred_element_type=acc)
    probs = _masked_softmax(scores * scale, mask)
    return jnp.einsum(
        f"tkgs,{key_axes}->tkgd", probs.astype(values.dtype), values, preferred_element_type=acc
    )


def _attend_blocks(
    q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, scale: float
) -> jax.Array:
    """`_attend` per query block: q [N, B, kv, group, D] against that block's keys and values
    [N, S, kv, D] under mask [N, B, S]. Returns [N, B, kv, group, D]."""
    acc = _acc(q.dtype)
    scores = jnp.einsum("nbkgd,nskd->nbkgs", q, keys, preferred_element_type=acc)
    probs = _masked_softmax(scores * scale, mask)
    return jnp.einsum(
        "nbkgs,nskd->nbkgd", probs.astype(values.dtype), values, preferred_element_type=acc
    )


def _masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax of [..., T, kv, group, S] scores over S where `mask` [..., T, S] allows;
    all-masked rows (padding) get all-zero weights, with no NaN in the value or its gradient."""
    allowed = mask[..., :, None, None, :]
    scores = jnp.where(allowed, scores, -jnp.inf)
    peak = lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(scores - peak)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.where(total > 0, total, 1.0)
