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

Attention sinks (`AttentionSpec.sinks`: a learned logit per head in the softmax's denominator)
and sliding windows run on either: cuDNN has no sink term, so its path scales each row's output
by the share the sink leaves (from the row's log-sum-exp) and takes its gradient from the `jnp`
form (`models.layers.attention.cudnn`). A decode over a window shorter than the cache reads each
row's window only (`window_of_cache`).
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from boundary_jax import RMSNorm, SumGroup, Topology
from boundary_jax.declare import Replicated
from boundary_jax.designs import Quantized
from boundary_jax.initializers import Constant, Normal, param
from boundary_jax.ops import shard_index, sharded_rms_norms

from ...config import AttentionSpec, QkNorm, YarnRopeScaling
from ...inputs.rows import RowsPhase
from ..linear import DENSE_LINEARS, Linears
from ..lora import LoraSpec, LoraTarget, column_lora, row_lora
from .attend import attend, attend_packed
from .context_parallel import (
    CpAttentionMode,
    attend_context_parallel,
    attend_cp_cache,
    cp_decode_writes,
    cp_prefill_cache_index,
)
from .cudnn import decode_cache_cudnn, max_head_dim, prefill_attention_cudnn, window_of_cache
from .kv_cache import HeadSplit, KVCache
from .paged import PagedKVCache, paged_attention
from .rope import apply_rope, query_scale, rope_inv_freq

O_PROJ_BIAS = "o_proj bias"
"""The replicated part an attention with `AttentionSpec.o_bias` declares on its stage."""


def replicated_parts(o_bias: bool) -> tuple[Replicated, ...]:
    """What an attention stage declares replicated: with `o_bias` (`AttentionSpec.o_bias`) the
    o projection's bias, whole on every attention-TP rank and counted once in their sum."""
    return (Replicated(O_PROJ_BIAS),) if o_bias else ()


class AttentionImpl(enum.Enum):
    """Which kernel computes softmax(q k^T) v.

    XLA: plain `jnp` einsums with float32 scores (the reference; every platform, every dtype).
    CUDNN: cuDNN fused attention (GPU): packed variable-length causal prefill and decode over
    the cache with per-slot key lengths, sliding windows and sinks. Where cuDNN does not take
    the call (float32, head_dim not a multiple of 8 or over `cudnn.max_head_dim`) XLA does.
    EXTEND rows over a paged cache take the Pallas paged kernel instead (`paged_attention`).
    """

    XLA = "xla"
    CUDNN = "cudnn"

    @classmethod
    def for_platform(cls, platform: str) -> AttentionImpl:
        """The measured-fastest choice for a JAX platform name ("cpu", "gpu", "cuda", "tpu")."""
        return cls.CUDNN if platform in ("gpu", "cuda") else cls.XLA


class WholeProjectionNorm(nnx.Module):
    """The weight of an RMSNorm over a whole q or k projection (all heads), split over
    attention TP like the projection's columns (replicated where the kv heads are shared).

    Attributes:
      weight: [heads * head_dim] global (ones at first); this rank's columns inside
        `shard_map`.
      eps: Added to the mean square (over the whole projection).
    """

    def __init__(
        self, width: int, *, group: SumGroup | None, topology: Topology, eps: float, dtype
    ):
        entry = None if group is None else topology.shard_entry(group)
        self.weight = param(Constant(1.0), (width,), dtype, sharding=(entry,))
        self.eps = eps


class Attention(nnx.Module):
    """Self-attention with q/o split by heads over attention TP; returns the o_proj partial.

    Attributes:
      q_proj: [hidden, heads * head_dim] (with `spec.output_gate`, [hidden, heads * 2 *
        head_dim]: each head's query, then its gate), columns split over attention TP; with
        `spec.qkv_bias` a bias split with its heads.
      kv_proj: [hidden, 2, kv heads * head_dim]: the k and v projections stacked (one matmul),
        split over attention TP or replicated (`heads`); its bias [2, kv heads * head_dim] (if
        any) with it, a replicated one cut to this rank's kv head.
      o_proj: [heads * head_dim, hidden], rows split over attention TP; with `spec.o_bias` a
        bias [hidden], whole on every rank and added by the first attention-TP rank only.
      q_lora, kv_lora, o_lora: The adapter stacks of the projections (`layers.lora`: the
        kv stacks hold k and v as its parts), or None where no adapter targets them.
      sinks: [heads] sink logits (`spec.sinks`), split over attention TP with their heads;
        None without sinks.
      q_norm: RMSNorm of the queries before RoPE: per head (an `RMSNorm` [head_dim]), over the
        whole projection (a `WholeProjectionNorm`), or
        None.
      k_norm: As `q_norm`, for the keys.
      heads: How the heads divide over attention TP.
      spec: What this layer's attention uses: heads, window, RoPE, q/k norms, score scale
        (`DecoderConfig.attention_spec`).
      topology: The parallel topology.
      impl: The attention kernel (`AttentionImpl`).
      cp_mode: How a prefill attends across attention-CP ranks (all-gather of K/V or the
        ring); used where the topology has `attn_cp > 1`, whose rows are each CP rank's zigzag
        share of its DP rank's sequences (`pack_sequences`).

    The projections come from `linears` (dense by default; `fp8_linear.Fp8Linears` makes them
    FP8 block weights, [out, in] as Hugging Face stores them, that take FP8 input).
    """

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        topology: Topology,
        dtype: jnp.dtype = jnp.float32,
        impl: AttentionImpl = AttentionImpl.XLA,
        cp_mode: CpAttentionMode = CpAttentionMode.ALL_GATHER,
        linears: Linears = DENSE_LINEARS,
        lora: LoraSpec | None = None,
        rngs: nnx.Rngs,
    ):
        heads = HeadSplit.of(spec, topology)
        kv_group = SumGroup.ATTN_TP if heads.kv_sharded else None
        hidden, head_dim = spec.hidden_size, spec.head_dim
        q_width, kv_width = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
        if spec.output_gate and (spec.qk_norm is QkNorm.WHOLE_PROJECTION or topology.attn_cp > 1):
            raise NotImplementedError(
                "an attention output gate is built with per-head q/k norms (or none) and "
                f"without attention CP; got qk_norm={spec.qk_norm}, attn_cp={topology.attn_cp}"
            )
        self.q_proj = linears.column(
            hidden,
            2 * q_width if spec.output_gate else q_width,
            group=SumGroup.ATTN_TP,
            topology=topology,
            bias=spec.qkv_bias,
            dtype=dtype,
            init_std=spec.init_std,
            rngs=rngs,
        )
        self.kv_proj = linears.column(
            hidden,
            kv_width,
            group=kv_group,
            topology=topology,
            parts=2,
            bias=spec.qkv_bias,
            dtype=dtype,
            init_std=spec.init_std,
            rngs=rngs,
        )
        self.o_proj = linears.row(
            q_width,
            hidden,
            group=SumGroup.ATTN_TP,
            topology=topology,
            bias=spec.o_bias,
            dtype=dtype,
            init_std=spec.init_std,
            rngs=rngs,
        )
        lora_options = dict(topology=topology, dtype=dtype, rngs=rngs)
        self.q_lora = column_lora(
            lora, (LoraTarget.Q,), hidden, q_width, group=SumGroup.ATTN_TP, **lora_options
        )
        if self.q_lora is not None and spec.output_gate:
            raise NotImplementedError(
                "a LoRA adapter on the q projection of an attention with an output gate is not "
                "built (its columns interleave each head's query and gate); leave q out of the "
                "adapter's target_modules"
            )
        self.kv_lora = column_lora(
            lora, (LoraTarget.K, LoraTarget.V), hidden, kv_width, group=kv_group, **lora_options
        )
        self.o_lora = row_lora(
            lora, LoraTarget.OUT, q_width, hidden, group=SumGroup.ATTN_TP, **lora_options
        )
        if spec.sinks and topology.attn_cp > 1:
            raise NotImplementedError(
                "attention sinks are not built under attention CP (the CP ranks would each add "
                f"the sink to their share of the denominator); got attn_cp={topology.attn_cp}. "
                "Use a mesh with attn_cp=1"
            )
        # In the model's dtype, as transformers keeps them; they join the float32 scores.
        self.sinks = (
            param(
                Normal(spec.init_std),
                (spec.num_heads,),
                dtype,
                rngs=rngs,
                sharding=(topology.shard_entry(SumGroup.ATTN_TP),),
            )
            if spec.sinks
            else None
        )
        eps = spec.norm_eps
        if spec.qk_norm is QkNorm.WHOLE_PROJECTION:
            self.q_norm = WholeProjectionNorm(
                q_width, group=SumGroup.ATTN_TP, topology=topology, eps=eps, dtype=dtype
            )
            self.k_norm = WholeProjectionNorm(
                kv_width, group=kv_group, topology=topology, eps=eps, dtype=dtype
            )
        elif spec.qk_norm is QkNorm.PER_HEAD:
            self.q_norm = RMSNorm(
                head_dim, eps=eps, unit_offset=spec.unit_offset_norms, param_dtype=dtype
            )
            self.k_norm = RMSNorm(
                head_dim, eps=eps, unit_offset=spec.unit_offset_norms, param_dtype=dtype
            )
        else:
            self.q_norm = None
            self.k_norm = None
        self.heads = heads
        self.spec = spec
        self.topology = topology
        self.impl = impl
        self.cp_mode = cp_mode

    def __call__(
        self,
        h: jax.Array | Quantized,
        positions: jax.Array,
        segment_ids: jax.Array,
        cache: KVCache | None = None,
        *,
        phase: RowsPhase = RowsPhase.PREFILL,
        max_sequence_rows: int | None = None,
        window_rows: int | None = None,
        slots: int | None = None,
        adapters: jax.Array | None = None,
        counts_bias: bool | jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Attends each row to its sequence; with a cache, also stores this call's keys/values.

        Args:
          h: [T, hidden] normalized input rows, complete and alike on every attention-TP rank
            (or their FP8 `Quantized` form, for FP8 projections).
          positions: [T] int32 position of each row within its sequence.
          segment_ids: [T] int32 sequence (cache slot) of each row; -1 marks padding.
          cache: None to attend over these rows alone; else this rank's local cache (a
            `PagedKVCache` for EXTEND rows).
          phase: PREFILL: each sequence's rows are all in this call, contiguous, at positions
            0, 1, ... (as `pack_sequences` lays them out); they attend among themselves and,
            with a cache, are written into it in place. DECODE (needs a cache): row i is slot
            i's next token (segment id i, or -1 for an idle slot); it is written at its
            position and attends to cached positions 0..position. Positions >= max_len are
            not stored. Under attention CP a PREFILL's rows are this CP rank's zigzag share
            (`pack_sequences`), and a DECODE step's rows are alike on every CP rank, whose
            cache shards each hold some positions of every slot (`KVCache`). EXTEND (needs a
            `PagedKVCache`): any tokens of the slots' sequences, each written at its position
            and attending to its sequence's pages (in the form `paged_attention` picks).
          max_sequence_rows: Static: no PREFILL sequence has more rows (`TokenRows`). With it
            (or a sliding window) the `jnp` prefill attends block by block to the keys within
            reach instead of over all T x T row pairs.
          window_rows: Static: a PREFILL's rows are windows of this many rows, each one
            sequence's from its first row, or padding (`TokenRows.window_rows`); the cuDNN
            prefill then attends window by window.
          slots: Static: a PREFILL's segment ids (cache slots) are below this (`TokenRows.slots`),
            or None: below the rows; the cuDNN prefill's segment bound without a cache.
          adapters: [T] int32 LoRA adapter of each row (0: none; `layers.lora`), or None to
            run the base projections alone.
          counts_bias: With `spec.o_bias`, whether this rank adds the o projection's bias (the
            attention stage boundary's `counts(O_PROJ_BIAS, stream)`: the stage declares the
            bias replicated, `replicated_parts`); None without it.

        Returns:
          ([T, hidden] o_proj partial owing a sum over attention TP, with zero rows for
          padding, except idle DECODE rows on the cuDNN path, which hold finite values; the
          updated cache, or None without one).

        Raises:
          ValueError: Mismatched row shapes, a DECODE call without a cache or with other than
            one row per cache slot, an EXTEND call without a `PagedKVCache`.
          NotImplementedError: An EXTEND call under attention CP.
        """
        rows = h.shape[0]
        if positions.shape != (rows,) or segment_ids.shape != (rows,):
            raise ValueError(
                f"positions and segment_ids must be [T] for h [T, hidden]; got {h.shape=}, "
                f"{positions.shape=}, {segment_ids.shape=}"
            )
        if phase is RowsPhase.EXTEND and not isinstance(cache, PagedKVCache):
            raise ValueError(
                "an EXTEND call reads and writes a paged cache; got "
                f"{type(cache).__name__}. Run it through models.serving.paged.PagedRunner"
            )
        if phase is RowsPhase.EXTEND and self.topology.attn_cp > 1:
            raise NotImplementedError(
                "the paged cache is not built under attention CP; got "
                f"attn_cp={self.topology.attn_cp}. Serve on a mesh with attn_cp=1"
            )
        if phase is RowsPhase.DECODE and (cache is None or cache.k.shape[0] != rows):
            cache_slots = None if cache is None else cache.k.shape[0]
            raise ValueError(
                "a DECODE call needs a cache and one row per cache slot (row i is slot i); "
                f"got {rows} rows and cache slots {cache_slots}. Use `decode_rows` to lay them out."
            )
        head_dim = self.spec.head_dim
        q = self.q_proj(h)
        if adapters is not None and self.q_lora is not None:
            q = q + self.q_lora(h, adapters)
        q = q.reshape(rows, self.heads.local_heads, -1)
        # With an output gate, each head's q_proj columns are its query, then its gate.
        q, gate = q[..., :head_dim], q[..., head_dim:]
        # Outside decode, XLA's GPU dot merger would join the q and kv products (they share h)
        # by concatenating their weights on every call (GPT-OSS-20B's prefill: 22 us a layer,
        # benchmarks/RESULTS.md runs 44-45). Decode keeps the merge: one product of few rows.
        kv_input = h if phase is RowsPhase.DECODE else lax.optimization_barrier(h)
        k, v = self._project_kv(kv_input, adapters)
        if self.spec.qk_norm is QkNorm.WHOLE_PROJECTION:
            q, k = self._whole_qk_norm(q, k)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.spec.rope_theta is not None:
            scaling = self.spec.rope_scaling
            rotary = self.spec.rotary_dim or head_dim
            inv_freq = rope_inv_freq(rotary, self.spec.rope_theta, scaling)
            factor = scaling.attention_factor if isinstance(scaling, YarnRopeScaling) else 1.0
            q, k = (
                jnp.concatenate(
                    [apply_rope(x[..., :rotary], positions, inv_freq, attention_factor=factor)]
                    + [x[..., rotary:]] * (rotary < head_dim),
                    axis=-1,
                )
                for x in (q, k)
            )
        if self.spec.query_scaling is not None:
            q = q * query_scale(positions, self.spec.query_scaling).astype(q.dtype)[:, None, None]
        valid = segment_ids >= 0
        cudnn = self.takes_cudnn(q.dtype)
        sinks = self._local_sinks()
        if phase is RowsPhase.EXTEND:
            cache = cache.write(k, v, segment_ids, positions)
            attend_rows = paged_attention(self.impl is AttentionImpl.CUDNN, cache, q.dtype)
            out = attend_rows(
                self._grouped(q),
                cache,
                positions,
                segment_ids,
                scale=self.scale,
                sliding_window=self.spec.sliding_window,
                sinks=sinks,
            )
        elif self.topology.attn_cp > 1:
            out, cache = self._context_parallel(q, k, v, positions, segment_ids, cache, phase)
        elif phase is RowsPhase.PREFILL:
            if cache is not None:
                cache = self._write(cache, k, v, segment_ids, positions, window_rows=window_rows)
            if cudnn:
                out = prefill_attention_cudnn(
                    q,
                    k,
                    v,
                    segment_ids,
                    max_segments=(slots or rows) if cache is None else cache.k.shape[0],
                    scale=self.scale,
                    window_rows=window_rows,
                    sliding_window=self.spec.sliding_window,
                    sinks=None if sinks is None else sinks.reshape(-1),
                )
            else:
                out = attend_packed(
                    self._grouped(q),
                    k.astype(q.dtype),
                    v,
                    positions,
                    segment_ids,
                    scale=self.scale,
                    max_sequence_rows=max_sequence_rows,
                    sliding_window=self.spec.sliding_window,
                    sinks=sinks,
                )
        else:
            # Row i is slot i: write each row's key at its position, then read the cache as is.
            slot_of_row = jnp.arange(rows, dtype=segment_ids.dtype)
            cache = self._write(cache, k, v, jnp.where(valid, slot_of_row, -1), positions)
            if cudnn:
                out = decode_cache_cudnn(
                    q,
                    cache,
                    positions,
                    self.scale,
                    sliding_window=self.spec.sliding_window,
                    sinks=None if sinks is None else sinks.reshape(-1),
                )
            else:
                out = self._decode_jnp(q, cache, positions, valid, sinks)
        # Padding rows: zero weights on the jnp paths; on cuDNN's decode an idle slot's row reads
        # its first key (finite), which the token counts ignore (masking costs a kernel a layer).
        out = out.astype(q.dtype).reshape(rows, self.heads.local_heads * head_dim)
        if self.spec.output_gate:
            out = out * jax.nn.sigmoid(gate.reshape(out.shape))
        y = self.o_proj(out, counts_bias=counts_bias)
        if adapters is not None and self.o_lora is not None:
            y = y + self.o_lora(out, adapters)
        return y, cache

    def _context_parallel(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        cache: KVCache | None,
        phase: RowsPhase,
    ) -> tuple[jax.Array, KVCache | None]:
        """Attention under attention CP: a PREFILL's rows are this CP rank's zigzag share (they
        attend across the CP ranks as `cp_mode` says, and are written into this rank's cache
        shard); a DECODE step's rows are alike on every CP rank, each appended on the CP rank
        that owns its position, and attend to every rank's shard (`attend_cp_cache`)."""
        spec = self.spec
        if phase is RowsPhase.PREFILL:
            if cache is not None:
                slots = cache.k.shape[0]
                # A slot prefilled again forgets what it held: the shard's rows are not
                # indexed by position, so an old key could otherwise stay visible.
                prefilled = jnp.where(segment_ids >= 0, segment_ids, slots)
                fresh = jnp.zeros(slots, bool).at[prefilled].set(True, mode="drop")
                cleared = jnp.where(fresh[:, None], -1, cache.positions)
                cache = self._write(
                    KVCache(cache.k, cache.v, cleared),
                    k,
                    v,
                    segment_ids,
                    cp_prefill_cache_index(segment_ids, slots),
                    positions,
                )
            out = attend_context_parallel(
                self._grouped(q),
                k.astype(q.dtype),
                v,
                positions,
                segment_ids,
                topology=self.topology,
                mode=self.cp_mode,
                scale=self.scale,
                sliding_window=spec.sliding_window,
            )
            return out, cache
        slots, index = cp_decode_writes(positions, segment_ids, cache.positions, self.topology)
        cache = self._write(cache, k, v, slots, index, positions)
        out = attend_cp_cache(
            self._grouped(q),
            cache.k.astype(q.dtype),
            cache.v.astype(v.dtype),
            cache.positions,
            positions,
            segment_ids,
            topology=self.topology,
            scale=self.scale,
            sliding_window=spec.sliding_window,
        )
        return out, cache

    @property
    def scale(self) -> float:
        """The factor of the attention scores: `query_pre_attn_scalar ** -0.5` where given, else
        `head_dim ** -0.5`."""
        return self.spec.scale

    def _whole_qk_norm(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The q/k RMSNorms over all heads, their sums of squares in one small all-reduce
        over attention TP (the heads are split there)."""
        rows, head_dim = q.shape[0], self.spec.head_dim
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

    def _decode_jnp(
        self,
        q: jax.Array,
        cache: KVCache,
        positions: jax.Array,
        valid: jax.Array,
        sinks: jax.Array | None,
    ) -> jax.Array:
        """The `jnp` decode: row i's query over slot i's cached keys at positions <= its own
        (within the window: a window shorter than the cache is gathered per row first)."""
        keys, values = cache.k.astype(q.dtype), cache.v.astype(q.dtype)
        max_len, window = keys.shape[1], self.spec.sliding_window
        if window is not None and window < max_len:
            keys, values, start = window_of_cache(keys, values, positions, window)
            key_positions = start[:, None] + jnp.arange(window, dtype=positions.dtype)[None, :]
        else:
            key_positions = jnp.arange(max_len, dtype=positions.dtype)[None, :]
        distance = positions[:, None] - key_positions
        visible = (distance >= 0) & (key_positions < max_len) & valid[:, None]
        if window is not None:
            visible &= distance < window
        return attend(self._grouped(q), keys, values, visible, "tskd", self.scale, sinks=sinks)

    def _grouped(self, q: jax.Array) -> jax.Array:
        """[T, heads, D] -> [T, kv, group, D]: query head n uses kv head n // group."""
        return q.reshape(q.shape[0], self.heads.local_kv_heads, -1, q.shape[-1])

    def _local_sinks(self) -> jax.Array | None:
        """This rank's heads' sink logits as [local kv heads, group] (`_grouped`'s head
        order), or None without sinks."""
        if self.sinks is None:
            return None
        return self.sinks[...].reshape(self.heads.local_kv_heads, -1)

    def takes_cudnn(self, dtype: jnp.dtype) -> bool:
        """Whether cuDNN computes this layer's attention (else the `jnp` reference does).

        cuDNN takes half-precision inputs of a head width it supports; sliding windows and
        sinks included (a layer with sinks in training differentiates as the `jnp` form).
        """
        return (
            self.impl is AttentionImpl.CUDNN
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and self.spec.head_dim % 8 == 0
            and self.spec.head_dim <= max_head_dim()
        )

    def _project_kv(
        self, h: jax.Array | Quantized, adapters: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """k and v, [T, local kv heads, head_dim] each (with their adapters' deltas, given
        `adapters`); a shared kv head is cut from the replicated kernel (and bias, and B)."""
        head_dim = self.spec.head_dim
        lora = self.kv_lora if adapters is not None else None
        if self.heads.kv_sharded:
            kv = self.kv_proj(h)
            if lora is not None:
                kv = kv + lora(h, adapters)
        else:
            ranks_per_head = self.heads.attn_tp // self.heads.num_kv_heads
            head = shard_index(self.topology, SumGroup.ATTN_TP) // ranks_per_head
            kv = self.kv_proj.columns(h, head * head_dim, head_dim)
            if lora is not None:
                kv = kv + lora.columns(h, adapters, head * head_dim, head_dim)
        kv = kv.reshape(h.shape[0], 2, self.heads.local_kv_heads, head_dim)
        return kv[:, 0], kv[:, 1]

    def _write(
        self,
        cache: KVCache,
        k: jax.Array,
        v: jax.Array,
        segment_ids: jax.Array,
        index: jax.Array,
        positions: jax.Array | None = None,
        *,
        window_rows: int | None = None,
    ) -> KVCache:
        """Row i's key and value into cache slot `segment_ids[i]` (-1: not written), at row
        `index[i]` of the slot; under context parallelism its position goes with it
        (`KVCache.positions`). Rows past the cache's end are not stored. `window_rows`: the
        rows are a PREFILL's windows (`TokenRows.window_rows`), written window by window where
        they fit the cache."""
        expected = (self.heads.local_kv_heads, self.spec.head_dim)
        if cache.k.shape[2:] != expected or cache.v.shape != cache.k.shape:
            raise ValueError(
                "the local KV cache must be [slots, max_len, local kv heads, head_dim] with "
                f"(local kv heads, head_dim)={expected}; got k {cache.k.shape}, v "
                f"{cache.v.shape}. Pass KVCache.specs(topology) as the cache's shard_map spec."
            )
        if window_rows is not None and window_rows <= cache.k.shape[1] and positions is None:
            return cache.put_windows(k, v, segment_ids, window_rows)
        return cache.put_rows(k, v, segment_ids, index, positions)
