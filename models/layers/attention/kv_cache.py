"""The static-shape KV cache of an attention layer, and how its heads divide over attention TP."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from boundary_jax import SumGroup, TokenAxis, Topology

from ...config import AttentionSpec, DecoderConfig
from ..linear import group_size


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
    def of(cls, heads: DecoderConfig | AttentionSpec, topology: Topology) -> HeadSplit:
        """The split of `heads`' query and kv heads over `topology`'s attention TP."""
        return cls(heads.num_heads, heads.num_kv_heads, group_size(topology, SumGroup.ATTN_TP))


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["k", "v", "positions"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Static-shape key/value cache of one attention layer: a registered pytree.

    Globally [slots, max_len, cache heads, head_dim], with slots split over attention DP and
    heads over attention TP (`partition_spec`). Inside `shard_map` a rank holds
    [slots / attn_dp, max_len, local kv heads, head_dim]; slot s holds sequence
    `segment_ids == s` of that attention-DP rank, at index [s, position]. Where kv heads are
    shared by several ranks (`HeadSplit.kv_sharded` is False) the global cache has one head per
    attention-TP rank, each a copy of the kv head that rank uses.

    Under context parallelism (`attn_cp = C > 1`) the second axis is split over attention CP
    too: each CP rank holds `rows_per_cp_rank(max_len, C)` rows of every slot, the keys of the
    positions it owns in any order, with each row's position in `positions` (-1: empty). A
    prefill writes each CP rank's zigzag rows into that rank's rows; a decode token is appended
    on CP rank `position % C` (`models.layers.attention.context_parallel`).

    Attributes:
      k: Keys after q/k norm and RoPE.
      v: Values.
      positions: Under context parallelism, int32 [slots, rows]: the position of the key in
        each row, -1 for an empty row; None without (a row's index is its position).
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array | None = None

    def put_rows(
        self,
        k: jax.Array,
        v: jax.Array,
        slots: jax.Array,
        index: jax.Array,
        positions: jax.Array | None = None,
    ) -> KVCache:
        """Row i's key and value into slot `slots[i]` (-1: not written) at row `index[i]` of the
        slot, and under context parallelism its position with them; rows past the end drop."""
        # Padding rows point past the last slot, each at its own row index, so every index is
        # distinct (XLA may then scatter without atomics) and the out-of-range ones drop.
        valid = slots >= 0
        slot = jnp.where(valid, slots, self.k.shape[0])
        index = jnp.where(valid, index, jnp.arange(index.shape[0], dtype=index.dtype))

        def put(values: jax.Array, new: jax.Array) -> jax.Array:
            return values.at[slot, index].set(
                new.astype(values.dtype), mode="drop", unique_indices=True
            )

        return KVCache(
            k=put(self.k, k),
            v=put(self.v, v),
            positions=None if self.positions is None else put(self.positions, positions),
        )

    def put_windows(
        self, k: jax.Array, v: jax.Array, segment_ids: jax.Array, window_rows: int
    ) -> KVCache:
        """A PREFILL's keys and values whose rows are windows of `window_rows` rows, each one
        sequence's from its first row or padding (`TokenRows.window_rows`): each sequence's
        window goes whole into its slot from row 0, one block per window where `put_rows`
        moves row by row. Needs `window_rows` <= the cache's rows, and no CP positions."""
        if window_rows > self.k.shape[1] or self.positions is not None:
            raise ValueError(
                f"window writes need windows ({window_rows} rows) within the cache's "
                f"{self.k.shape[1]} rows and a cache without CP positions"
            )
        windows = segment_ids.shape[0] // window_rows
        first = segment_ids[: windows * window_rows : window_rows]
        # A padding window points past the last slot, each at its own slot, and drops.
        beyond = self.k.shape[0] + jnp.arange(windows, dtype=first.dtype)
        slot = jnp.where(first >= 0, first, beyond)

        def put(values: jax.Array, new: jax.Array) -> jax.Array:
            blocks = new[: windows * window_rows].reshape(windows, window_rows, *new.shape[1:])
            return values.at[slot, :window_rows].set(
                blocks.astype(values.dtype), mode="drop", unique_indices=True
            )

        return KVCache(k=put(self.k, k), v=put(self.v, v))

    @staticmethod
    def rows_per_cp_rank(max_len: int, cp: int) -> int:
        """Rows of each slot that one of `cp` CP ranks holds for `max_len` positions: its
        zigzag share of a prompt (at most two rows over an even share) and every `cp`-th
        position after it (at most one over), so `ceil(max_len / cp) + 2`."""
        return -(-max_len // cp) + 2 if cp > 1 else max_len

    @staticmethod
    def global_shape(
        config: DecoderConfig, topology: Topology, *, slots: int, max_len: int
    ) -> tuple[int, int, int, int]:
        """The [slots, rows, cache heads, head_dim] shape of `k` and `v` outside shard_map:
        `rows` is `max_len`, or under context parallelism each CP rank's
        `rows_per_cp_rank(max_len, attn_cp)` rows, CP rank by CP rank.

        Raises:
          ValueError: `slots` is not a multiple of the attention-DP size.
        """
        if slots % topology.attn_dp:
            raise ValueError(
                f"KV cache slots ({slots}) must split evenly over attention DP "
                f"({topology.attn_dp}); got {slots=}"
            )
        heads = HeadSplit.of(config, topology)
        cp = topology.attn_cp
        rows = cp * KVCache.rows_per_cp_rank(max_len, cp) if cp > 1 else max_len
        return (slots, rows, heads.cache_heads, config.head_dim)

    @staticmethod
    def partition_spec(topology: Topology) -> PartitionSpec:
        """Slots over attention DP, rows over attention CP, heads over attention TP."""
        dp = topology.spec_entry((TokenAxis.ATTN_DP,))
        cp = topology.spec_entry((TokenAxis.ATTN_CP,))
        return PartitionSpec(dp, cp, topology.shard_entry(SumGroup.ATTN_TP), None)

    @classmethod
    def specs(cls, topology: Topology, *, stacked: bool = False) -> KVCache:
        """The cache's `PartitionSpec` tree, for `shard_map` in/out specs; `stacked`: of the
        stacked caches of a scanned run of layers (a leading, unsplit layer axis)."""
        spec = cls.partition_spec(topology)
        positions = PartitionSpec(*spec[:2]) if topology.attn_cp > 1 else None
        if stacked:
            spec = PartitionSpec(None, *spec)
            positions = None if positions is None else PartitionSpec(None, *positions)
        return cls(k=spec, v=spec, positions=positions)

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
        """A zero cache of the global shape (under context parallelism with every row empty);
        on `mesh`, each device allocates only its shard. `layers`: the stacked caches of a
        scanned run of that many layers, on a leading axis (None: one layer's)."""
        shape = cls.global_shape(config, topology, slots=slots, max_len=max_len)
        specs = cls.specs(topology, stacked=layers is not None)
        if layers is not None:
            shape = (layers, *shape)

        def placed(spec: PartitionSpec) -> NamedSharding | None:
            return None if mesh is None else NamedSharding(mesh, spec)

        positions = None
        if specs.positions is not None:
            positions = jnp.full(shape[:-2], -1, jnp.int32, device=placed(specs.positions))
        device = placed(specs.k)
        return cls(
            k=jnp.zeros(shape, dtype, device=device),
            v=jnp.zeros(shape, dtype, device=device),
            positions=positions,
        )
