"""Multi-head latent attention (DeepSeek-V2/V3), split by heads over attention TP, with a decode
cache that holds only the latent.

The math, as transformers 5 computes it (`DeepseekV2Attention`, `DeepseekV3Attention`):

    q = q_b(norm_q(q_a(h)))  with q LoRA, else q_proj(h)     # [T, H, nope + rope] per head
    c, k_rope = split(kv_a(h), [kv_lora_rank, rope])          # one latent row per token
    c = norm_kv(c)                                            # eps 1e-6, whatever the config
    q_rope, k_rope = rope(q_rope), rope(k_rope)               # k_rope: one head, shared
    k_nope, v = split(kv_b(c), [nope, v_head_dim])            # per head
    scores = (q_nope . k_nope + q_rope . k_rope) * scale
    out = o_proj(softmax(scores) @ v)

LongCat-Flash (`LongcatFlashMLA`, `MlaConfig.lora_scaled`) multiplies the queries (both parts)
by `sqrt(hidden / q_lora_rank)` and the normed kv latent by `sqrt(hidden / kv_lora_rank)`; the
scaled latent is what it caches.

DeepSeek lays each head's rope dimensions out in interleaved pairs (x0, x1), (x2, x3), ...:
transformers' V2 rotates them as complex numbers, V3 (`rope_interleave`, true by default)
rotates the even / odd halves; both equal the NeoX rotation of `cat(x[0::2], x[1::2])`, which
is what this module computes (the permutation applies alike to q and k, so scores are the
same; only the cached layout differs from transformers').

Prefill runs the expanded form above over packed rows. Decode runs the absorbed form over the
latent cache, [slots, max_len, kv_lora_rank + rope] per layer, shared by every head:
`q_nope . k_nope = (q_nope W_uk^T) . c`, so each head's query is moved into latent space once,
scored against the cached latents (and rope keys), and the weighted latent is moved out
through the value part of kv_b, `W_uv`. No per-head key or value is ever materialized.

Heads split over attention TP (q_proj / q_b, kv_b and o_proj by heads); q_a, kv_a and their
norms are replicated, so every rank computes (and caches) the same latent. The output is this
rank's o_proj partial, unreduced over attention TP.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from boundary_jax import RMSNorm, SumGroup, TokenAxis, Topology

from ...config import MlaConfig as MlaConfig
from ...inputs.rows import RowsPhase
from ..linear import ColumnParallelLinear, RowParallelLinear, group_size
from .attend import accumulation_dtype, attend_latent, attend_packed
from .cudnn import max_head_dim, prefill_attention_cudnn
from .paged import PagedLatentCache
from .rope import apply_rope, rope_inv_freq
from .self_attention import AttentionImpl

LATENT_NORM_EPS = 1e-6
"""Epsilon of q_a_layernorm and kv_a_layernorm: transformers (and DeepSeek's own code) build
them with the RMSNorm default, not `rms_norm_eps`."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=["latent"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LatentCache:
    """Static-shape decode cache of one MLA layer: the latent only, shared by all heads.

    Globally [slots, max_len, kv_lora_rank + qk_rope_head_dim], slots split over attention DP
    and replicated over attention TP (every TP rank computes the same latent). Slot s of a rank
    holds sequence `segment_ids == s` of that attention-DP rank, position p at [s, p]: the
    normed kv latent in the first `kv_lora_rank` entries, the rotated key after them.

    Attributes:
      latent: The cached latents.
    """

    latent: jax.Array

    @staticmethod
    def bytes_per_token(config: MlaConfig, dtype: jnp.dtype) -> int:
        """Cache bytes one token takes in one layer: `(kv_lora_rank + qk_rope_head_dim)`
        values, whatever the head count or the attention-TP size."""
        return config.latent_width * jnp.dtype(dtype).itemsize

    @staticmethod
    def global_shape(
        config: MlaConfig, topology: Topology, *, slots: int, max_len: int
    ) -> tuple[int, int, int]:
        """The [slots, max_len, latent width] shape outside shard_map.

        Raises:
          ValueError: `slots` is not a multiple of the attention-DP size.
        """
        if slots % topology.attn_dp:
            raise ValueError(
                f"latent cache slots ({slots}) must split evenly over attention DP "
                f"({topology.attn_dp}); got {slots=}"
            )
        return (slots, max_len, config.latent_width)

    @staticmethod
    def partition_spec(topology: Topology) -> PartitionSpec:
        """Slots over attention DP; replicated over attention TP."""
        return PartitionSpec(topology.spec_entry((TokenAxis.ATTN_DP,)), None, None)

    @classmethod
    def specs(cls, topology: Topology, *, stacked: bool = False) -> LatentCache:
        """The cache's `PartitionSpec` tree, for `shard_map` in/out specs; `stacked`: of the
        stacked caches of a scanned run of layers (a leading, unsplit layer axis)."""
        spec = cls.partition_spec(topology)
        return cls(latent=PartitionSpec(None, *spec) if stacked else spec)

    @classmethod
    def create(
        cls,
        config: MlaConfig,
        topology: Topology,
        *,
        slots: int,
        max_len: int,
        dtype: jnp.dtype = jnp.float32,
        mesh: Mesh | None = None,
        layers: int | None = None,
    ) -> LatentCache:
        """A zero cache of the global shape; on `mesh`, each device allocates only its shard.
        `layers`: the stacked caches of a scanned run of that many layers (None: one layer's)."""
        shape = cls.global_shape(config, topology, slots=slots, max_len=max_len)
        spec = cls.specs(topology, stacked=layers is not None).latent
        if layers is not None:
            shape = (layers, *shape)
        device = None if mesh is None else NamedSharding(mesh, spec)
        return cls(latent=jnp.zeros(shape, dtype, device=device))


class MultiHeadLatentAttention(nnx.Module):
    """DeepSeek's latent attention with heads split over attention TP; returns the o_proj
    partial. Parameter names and shapes follow transformers' (kernels transposed to [in, out]).

    Attributes:
      q_proj: [hidden, heads * qk_head_dim], columns split over attention TP; None with q LoRA.
      q_a_proj: [hidden, q_lora_rank], replicated; None without q LoRA.
      q_a_layernorm: RMSNorm [q_lora_rank]; None without q LoRA.
      q_b_proj: [q_lora_rank, heads * qk_head_dim], columns split; None without q LoRA.
      kv_a_proj_with_mqa: [hidden, kv_lora_rank + qk_rope_head_dim], replicated: the kv
        latent, then the shared rope key.
      kv_a_layernorm: RMSNorm [kv_lora_rank] of the kv latent.
      kv_b_proj: [kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim)], columns split by
        heads: per head, its key's nope part, then its value.
      o_proj: [heads * v_head_dim, hidden], rows split over attention TP.
      config: The layer's shapes and RoPE.
      local_heads: Heads this attention-TP rank computes.
      impl: The prefill attention kernel: CUDNN takes 16-bit prefills (value zero-padded to
        the key's width), XLA the rest and every decode (the absorbed query, kv_lora_rank +
        rope wide, is past cuDNN's 256).
    """

    def __init__(
        self,
        config: MlaConfig,
        *,
        topology: Topology,
        dtype: jnp.dtype = jnp.float32,
        impl: AttentionImpl = AttentionImpl.XLA,
        rngs: nnx.Rngs,
    ):
        if topology.attn_cp > 1:
            raise NotImplementedError(
                f"context-parallel attention is not implemented; got attn_cp={topology.attn_cp}"
            )
        ranks = group_size(topology, SumGroup.ATTN_TP)
        if config.num_heads % ranks:
            raise ValueError(
                f"num_heads ({config.num_heads}) must be a multiple of the attention-TP size "
                f"({ranks}); use an attention-TP size that divides the heads"
            )
        heads, hidden = config.num_heads, config.hidden_size
        common = {"topology": topology, "dtype": dtype, "rngs": rngs}
        split = {"group": SumGroup.ATTN_TP, **common}
        q_width = heads * config.qk_head_dim
        norm = {"eps": LATENT_NORM_EPS, "param_dtype": dtype}
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_width, **split)
            self.q_a_proj, self.q_a_layernorm, self.q_b_proj = None, None, None
        else:
            self.q_proj = None
            self.q_a_proj = ColumnParallelLinear(hidden, config.q_lora_rank, group=None, **common)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, **norm)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, q_width, **split)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            hidden, config.latent_width, group=None, **common
        )
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, **norm)
        kv_width = heads * (config.qk_nope_head_dim + config.v_head_dim)
        self.kv_b_proj = ColumnParallelLinear(config.kv_lora_rank, kv_width, **split)
        self.o_proj = RowParallelLinear(heads * config.v_head_dim, hidden, **split)
        self.config = config
        self.local_heads = heads // ranks
        self.impl = impl

    def __call__(
        self,
        h: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        cache: LatentCache | PagedLatentCache | None = None,
        *,
        phase: RowsPhase = RowsPhase.PREFILL,
        max_sequence_rows: int | None = None,
        window_rows: int | None = None,
        slots: int | None = None,
        counts_bias: None = None,
    ) -> tuple[jax.Array, LatentCache | PagedLatentCache | None]:
        """Attends each row to its sequence; with a cache, also stores this call's latents.

        Args:
          h: [T, hidden] normalized input rows, complete and alike on every attention-TP rank.
          positions: [T] int32 position of each row within its sequence.
          segment_ids: [T] int32 sequence (cache slot) of each row; -1 marks padding.
          cache: None to attend over these rows alone; else this rank's local `LatentCache`.
          phase: PREFILL: each sequence's rows are all in this call, contiguous, at positions
            0, 1, ...; they attend among themselves in the expanded form and, with a cache,
            their latents are written into it. DECODE (needs a cache): row i is slot i's next
            token (segment id i, or -1 for an idle slot); its latent is written at its
            position and it attends, absorbed, to cached positions 0..position. Positions
            >= max_len are not stored. EXTEND (needs a `PagedLatentCache`): any tokens of the
            slots' sequences, each written at its position and attending, absorbed, to its
            sequence's pages up to it.
          max_sequence_rows: Static: no PREFILL sequence has more rows; the prefill then
            attends block by block to the keys within reach instead of all T x T pairs.
          window_rows: Static: a PREFILL's rows are windows of this many rows, each one
            sequence's from its first row, or padding (`TokenRows.window_rows`); the cuDNN
            prefill then attends window by window.
          slots: Static: a PREFILL's segment ids (cache slots) are below this (`TokenRows.slots`),
            or None: below the rows; the cuDNN prefill's segment bound without a cache.
          counts_bias: None: the o projection has no bias (the argument is `Attention`'s, so a
            layer calls either alike).

        Returns:
          ([T, hidden] o_proj partial owing a sum over attention TP, zero on padding rows and
          idle slots; the updated cache, or None without one).

        Raises:
          ValueError: Mismatched row shapes, a DECODE call without a cache or with other than
            one row per cache slot, an EXTEND call without a `PagedLatentCache`, or a cache of
            another latent width.
        """
        rows = h.shape[0]
        if positions.shape != (rows,) or segment_ids.shape != (rows,):
            raise ValueError(
                f"positions and segment_ids must be [T] for h [T, hidden]; got {h.shape=}, "
                f"{positions.shape=}, {segment_ids.shape=}"
            )
        if phase is RowsPhase.EXTEND and not isinstance(cache, PagedLatentCache):
            raise ValueError(
                "an EXTEND call reads and writes a paged cache; got "
                f"{type(cache).__name__}. Run it through models.serving.paged.PagedRunner"
            )
        if phase is RowsPhase.DECODE and (cache is None or cache.latent.shape[0] != rows):
            cache_slots = None if cache is None else cache.latent.shape[0]
            raise ValueError(
                "a DECODE call needs a cache and one row per cache slot (row i is slot i); "
                f"got {rows} rows and cache slots {cache_slots}. Use `decode_rows` to lay them out."
            )
        if cache is not None and cache.latent.shape[2:] != (self.config.latent_width,):
            raise ValueError(
                "the local latent cache must be [slots, max_len, kv_lora_rank + "
                f"qk_rope_head_dim = {self.config.latent_width}]; got {cache.latent.shape}. "
                "Pass LatentCache.specs(topology) as the cache's shard_map spec."
            )
        q_nope, q_rope = self._queries(h, positions)
        # Outside decode, keep XLA's GPU dot merger from joining the q and kv_a products (they
        # share h) by concatenating their weights on every call (benchmarks/RESULTS.md run 46).
        latent = self._latent(
            h if phase is RowsPhase.DECODE else lax.optimization_barrier(h), positions
        )
        valid = segment_ids >= 0
        if phase is RowsPhase.PREFILL:
            if cache is not None:
                cache = _write(cache, latent, positions, segment_ids)
            bound = (slots or rows) if cache is None else cache.latent.shape[0]
            out = self._expanded(
                q_nope,
                q_rope,
                latent,
                segment_ids,
                positions=positions,
                max_sequence_rows=max_sequence_rows,
                max_segments=bound,
                window_rows=window_rows,
            )
        elif phase is RowsPhase.EXTEND:
            cache = cache.write(latent, segment_ids, positions)
            out = self._absorbed(q_nope, q_rope, cache.gather(segment_ids), positions, valid)
        else:
            slot_of_row = jnp.where(valid, jnp.arange(rows, dtype=segment_ids.dtype), -1)
            cache = _write(cache, latent, positions, slot_of_row)
            out = self._absorbed(q_nope, q_rope, cache.latent, positions, valid)
        out = out.astype(h.dtype).reshape(rows, self.local_heads * self.config.v_head_dim)
        return self.o_proj(out, counts_bias=counts_bias), cache

    def _queries(self, h: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """This rank's heads' queries: nope [T, heads, nope] and rotated rope [T, heads, rope]."""
        if self.q_proj is not None:
            q = self.q_proj(h)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        if self.config.lora_scaled:
            q = q * jnp.asarray(self.config.q_lora_scale, q.dtype)
        q = q.reshape(h.shape[0], self.local_heads, self.config.qk_head_dim)
        nope = self.config.qk_nope_head_dim
        return q[..., :nope], self._rope(q[..., nope:], positions)

    def _latent(self, h: jax.Array, positions: jax.Array) -> jax.Array:
        """[T, kv_lora_rank + rope]: the normed (and scaled) kv latent, then the rotated
        shared key."""
        compressed = self.kv_a_proj_with_mqa(h)
        rank = self.config.kv_lora_rank
        c = self.kv_a_layernorm(compressed[:, :rank])
        if self.config.lora_scaled:
            c = c * jnp.asarray(self.config.kv_lora_scale, c.dtype)
        k_rope = self._rope(compressed[:, None, rank:], positions)[:, 0]
        return jnp.concatenate([c, k_rope.astype(c.dtype)], axis=-1)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """[T, heads, rope] rotated (as they are without `config.rotary`); interleaved pairs
        are first gathered into NeoX halves."""
        if not self.config.rotary:
            return x
        config = self.config
        if config.rope_interleaved:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        inv_freq = rope_inv_freq(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)
        return apply_rope(x, positions, inv_freq, attention_factor=config.rope_attention_factor)

    def _kv_b(self) -> tuple[jax.Array, jax.Array]:
        """This rank's heads' kv_b as W_uk [kv_lora_rank, heads, nope] and W_uv [kv_lora_rank,
        heads, v]."""
        kernel = self.kv_b_proj.kernel[...]
        kernel = kernel.reshape(kernel.shape[0], self.local_heads, -1)
        nope = self.config.qk_nope_head_dim
        return kernel[..., :nope], kernel[..., nope:]

    def _expanded(
        self,
        q_nope,
        q_rope,
        latent,
        segment_ids,
        *,
        positions,
        max_sequence_rows,
        max_segments,
        window_rows,
    ):
        """Prefill among packed rows: every head's key and value expanded from the latents.
        Returns [T, heads, v]. `max_segments` (static) bounds the segment ids and
        `window_rows` says they fill windows (both cuDNN's)."""
        rows, heads = q_nope.shape[:2]
        rank = self.config.kv_lora_rank
        c, k_rope = latent[:, :rank], latent[:, rank:]
        kv = self.kv_b_proj(c).reshape(rows, heads, -1)
        nope = self.config.qk_nope_head_dim
        k_rope = jnp.broadcast_to(k_rope[:, None, :], (rows, heads, k_rope.shape[-1]))
        k = jnp.concatenate([kv[..., :nope], k_rope], axis=-1)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        if self._takes_cudnn(q.dtype):
            return prefill_attention_cudnn(
                q,
                k,
                kv[..., nope:],
                segment_ids,
                max_segments=max_segments,
                scale=self.config.softmax_scale,
                window_rows=window_rows,
            )
        out = attend_packed(
            q[:, :, None, :],
            k,
            kv[..., nope:],
            positions,
            segment_ids,
            scale=self.config.softmax_scale,
            max_sequence_rows=max_sequence_rows,
        )
        return out[:, :, 0]

    def _takes_cudnn(self, dtype: jnp.dtype) -> bool:
        """Whether cuDNN computes the prefill attention: 16-bit inputs, a query/key width a
        multiple of 8 up to `cudnn.max_head_dim`, and a value no wider."""
        width = self.config.qk_head_dim
        return (
            self.impl is AttentionImpl.CUDNN
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and width % 8 == 0
            and width <= max_head_dim()
            and self.config.v_head_dim <= width
        )

    def _absorbed(self, q_nope, q_rope, latents, positions, valid) -> jax.Array:
        """Attention over cached latents, one set per row ([T, S, latent width]: a decode's
        slots, or an EXTEND's gathered pages), to positions 0..position. Returns
        [T, heads, v]."""
        acc = accumulation_dtype(q_nope.dtype)
        w_uk, w_uv = self._kv_b()
        q_latent = jnp.einsum("thd,chd->thc", q_nope, w_uk, preferred_element_type=acc)
        q = jnp.concatenate([q_latent.astype(q_nope.dtype), q_rope], axis=-1)
        latents = latents.astype(q.dtype)
        key_positions = jnp.arange(latents.shape[1], dtype=positions.dtype)
        mask = (key_positions[None, :] <= positions[:, None]) & valid[:, None]
        rank = self.config.kv_lora_rank
        out = attend_latent(q, latents, mask, self.config.softmax_scale, rank)
        out = out.astype(q_nope.dtype)  # [T, heads, kv_lora_rank]
        return jnp.einsum("thc,chv->thv", out, w_uv, preferred_element_type=acc)


def _write(
    cache: LatentCache, latent: jax.Array, positions: jax.Array, slots: jax.Array
) -> LatentCache:
    """Stores row r's latent at [slots[r], positions[r]]; rows with slot -1 are dropped."""
    # Padding rows point past the last slot, each at its own row index, so every index is
    # distinct (XLA may then scatter without atomics) and the out-of-range ones drop.
    valid = slots >= 0
    slot = jnp.where(valid, slots, cache.latent.shape[0])
    position = jnp.where(valid, positions, jnp.arange(positions.shape[0], dtype=positions.dtype))
    latent = latent.astype(cache.latent.dtype)
    return LatentCache(
        latent=cache.latent.at[slot, position].set(latent, mode="drop", unique_indices=True)
    )
