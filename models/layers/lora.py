"""Multi-LoRA projections: several low-rank adapters over one base projection, one per row.

A batch serves several adapters at once (as Punica and S-LoRA batch them): the adapters of a
projection are stacked on a leading axis, and each token row names its adapter by index, 0 for
none (adapter k >= 1 is stack entry k - 1). Row t's delta is `(x[t] @ A[k]) @ B[k]`, the
adapter's scaling (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA) folded into B when it is loaded;
an adapter being trained keeps PEFT's B and its scaling apart (`LoraSpec.scaling`).
Each row selects its adapter by a one-hot mask over the stack: every adapter's A shrinks every
row ([T, adapters, r], as cheap as one projection of adapters x r columns), the mask keeps each
row's own, and one matmul over the stacked B expands it; so each adapter's weights are read once
per step, not once per row as a per-row gather of weights would read them. Adapters of smaller
rank are zero-padded to the largest (exactly the same products).

Tensor parallelism follows the base projection. A column-parallel projection (q, k, v, gate, up)
reads complete input rows: A is whole on every rank and B's output columns are split like the
base kernel's, so the delta is this rank's columns. A row-parallel projection (o, down) reads this
rank's slice of the input features: A's input rows are split like the base kernel's and B is
whole, so `(x_local @ A_local) @ B` is this rank's share of the delta, and the one sum the stage
owes for its partial output counts the LoRA product once.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from boundary_jax import SumGroup, Topology
from boundary_jax.initializers import Normal, param


class LoraTarget(enum.Enum):
    """A projection an adapter may target, by its Hugging Face module name."""

    Q = "q_proj"
    K = "k_proj"
    V = "v_proj"
    OUT = "o_proj"
    GATE = "gate_proj"
    UP = "up_proj"
    DOWN = "down_proj"


ATTENTION_TARGETS = (LoraTarget.Q, LoraTarget.K, LoraTarget.V, LoraTarget.OUT)
MLP_TARGETS = (LoraTarget.GATE, LoraTarget.UP, LoraTarget.DOWN)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The adapters a model serves and the shape of their stacks: static, decided when the
    model is built.

    Attributes:
      names: The adapters' names, in stack order: `names[k - 1]` is row index k (0: none).
      rank: The stacks' rank: the largest adapter's `r` (smaller ones are zero-padded).
      targets: The projections that carry adapter stacks (every adapter's targets together).
      scaling: A factor on every delta: 1 where each loaded adapter's scaling is folded into
        its B; an adapter being trained keeps B in PEFT's units and its `lora_alpha / r` here,
        so the optimizer steps the B that PEFT steps.
    """

    names: tuple[str, ...]
    rank: int
    targets: frozenset[LoraTarget]
    scaling: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "names", tuple(self.names))
        if (
            not self.names
            or len(set(self.names)) != len(self.names)
            or self.rank < 1
            or not self.scaling > 0
        ):
            raise ValueError(
                f"a LoRA spec stacks at least one adapter, each named once, of rank >= 1, "
                f"scaled by a positive factor; got {self.names=}, {self.rank=}, {self.scaling=}"
            )
        if not self.targets or not all(isinstance(t, LoraTarget) for t in self.targets):
            raise TypeError(
                f"LoraSpec.targets is a non-empty frozenset of LoraTarget; got {self.targets!r}"
            )
        object.__setattr__(self, "targets", frozenset(self.targets))

    @property
    def adapters(self) -> int:
        """How many adapters are stacked."""
        return len(self.names)

    def index(self, name: str | int | None) -> int:
        """The row index of adapter `name` (None: 0, no adapter; an int is checked as is).

        Raises:
          ValueError: No adapter of that name (or index) is loaded.
        """
        if name is None:
            return 0
        if isinstance(name, numbers.Integral) and not isinstance(name, bool):
            if 0 <= name <= self.adapters:
                return int(name)
        elif name in self.names:
            return self.names.index(name) + 1
        raise ValueError(
            f"no LoRA adapter {name!r} is loaded; the loaded adapters are {list(self.names)} "
            f"(or indices 1..{self.adapters}, 0 for none). Load it with --lora NAME=DIR"
        )

    def targeted(self, *targets: LoraTarget) -> tuple[bool, ...]:
        """Whether each of `targets` carries a stack."""
        return tuple(t in self.targets for t in targets)


def selection(adapters: jax.Array, count: int, dtype: jnp.dtype) -> jax.Array:
    """[T] int adapter indices (0: none) -> [T, count] one-hot rows in `dtype` (zeros for 0)."""
    return jax.nn.one_hot(adapters - 1, count, dtype=dtype)


class LoraColumn(nnx.Module):
    """The adapter stacks of a column-parallel projection (with `parts`, of several stacked ones,
    as k and v or gate and up): its delta has the base output's shape on this rank.

    Attributes:
      a: [in, parts, adapters, rank] (parts 1 without `parts`), whole on every rank.
      b: [parts, adapters, rank, out], the out columns split over `group` like the base kernel.
      parts: The base projection's parts, or None.

    The stacks are laid out so that both products read them as they lie: the shrink is one
    matmul of the rows with A as [in, parts x adapters x rank], the expand one matmul batched
    over the parts with B as [parts, adapters x rank, out] (no transposed copy of a stack per
    step).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        spec: LoraSpec,
        *,
        group: SumGroup | None,
        topology: Topology,
        parts: int | None = None,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        stacked = 1 if parts is None else parts
        entry = None if group is None else topology.shard_entry(group)
        # Random, not zeros as PEFT initializes B: a dropped or mis-sharded adapter shows.
        self.a = param(
            Normal(in_features**-0.5),
            (in_features, stacked, spec.adapters, spec.rank),
            dtype,
            rngs=rngs,
            sharding=(None, None, None, None),
        )
        self.b = param(
            Normal(spec.rank**-0.5),
            (stacked, spec.adapters, spec.rank, out_features),
            dtype,
            rngs=rngs,
            sharding=(None, None, None, entry),
        )
        self.parts = parts
        self.scaling = spec.scaling

    def __call__(self, x: jax.Array, adapters: jax.Array) -> jax.Array:
        """[T, in] complete rows and [T] adapter indices -> this rank's [T, local out] delta
        ([T, parts, local out] with parts)."""
        return self._delta(x, adapters, self.b[...])

    def columns(self, x: jax.Array, adapters: jax.Array, start: jax.Array, size: int) -> jax.Array:
        """Only output columns [start, start + size) of each part, as the base's `columns`."""
        return self._delta(x, adapters, lax.dynamic_slice_in_dim(self.b[...], start, size, -1))

    def _delta(self, x: jax.Array, adapters: jax.Array, b: jax.Array) -> jax.Array:
        a = self.a[...]
        features, parts, count, rank = a.shape
        mask = selection(adapters, count, x.dtype) * self.scaling
        shrunk = (x @ a.reshape(features, -1)).reshape(-1, parts, count, rank)
        shrunk = (shrunk * mask[:, None, :, None]).reshape(-1, parts, count * rank)
        delta = jnp.einsum("tpk,pko->tpo", shrunk, b.reshape(parts, count * rank, -1))
        return delta[:, 0] if self.parts is None else delta


class LoraRow(nnx.Module):
    """The adapter stack of a row-parallel projection: its delta is this rank's share of the
    LoRA product, joining the base projection's partial sum.

    Attributes:
      a: [in, adapters, rank], the in rows split over `group` like the base kernel.
      b: [adapters, rank, out], whole on every rank.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        spec: LoraSpec,
        *,
        group: SumGroup,
        topology: Topology,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.a = param(
            Normal(in_features**-0.5),
            (in_features, spec.adapters, spec.rank),
            dtype,
            rngs=rngs,
            sharding=(topology.shard_entry(group), None, None),
        )
        self.b = param(
            Normal(spec.rank**-0.5),
            (spec.adapters, spec.rank, out_features),
            dtype,
            rngs=rngs,
            sharding=(None, None, None),
        )
        self.scaling = spec.scaling

    def __call__(self, x: jax.Array, adapters: jax.Array) -> jax.Array:
        """This rank's [T, local in] rows and [T] adapter indices -> [T, out], this rank's
        partial of the delta (unreduced: the stage's one sum completes it)."""
        a, b = self.a[...], self.b[...]
        features, count, rank = a.shape
        mask = selection(adapters, count, x.dtype) * self.scaling
        shrunk = (x @ a.reshape(features, -1)).reshape(-1, count, rank) * mask[:, :, None]
        return shrunk.reshape(-1, count * rank) @ b.reshape(count * rank, -1)


def column_lora(
    spec: LoraSpec | None,
    targets: tuple[LoraTarget, ...],
    in_features: int,
    out_features: int,
    *,
    group: SumGroup | None,
    topology: Topology,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
) -> LoraColumn | None:
    """The stacks of a column-parallel projection that computes `targets` (one, or one per
    part), or None where no adapter targets any of them."""
    if spec is None or not any(spec.targeted(*targets)):
        return None
    return LoraColumn(
        in_features,
        out_features,
        spec,
        group=group,
        topology=topology,
        parts=None if len(targets) == 1 else len(targets),
        dtype=dtype,
        rngs=rngs,
    )


def row_lora(
    spec: LoraSpec | None,
    target: LoraTarget,
    in_features: int,
    out_features: int,
    *,
    group: SumGroup,
    topology: Topology,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
) -> LoraRow | None:
    """The stack of a row-parallel projection `target`, or None where no adapter targets it."""
    if spec is None or target not in spec.targets:
        return None
    return LoraRow(
        in_features, out_features, spec, group=group, topology=topology, dtype=dtype, rngs=rngs
    )


def adapter_indices(
    spec: LoraSpec | None, adapters: Sequence[str | int | None] | None, count: int
) -> tuple[int, ...] | None:
    """Each of `count` sequences' adapter row index from its name (or index; None: no adapter),
    or None for a batch that names none.

    Raises:
      ValueError: Not one per sequence, an unknown name, or names for a model without adapters.
    """
    if adapters is None:
        return None
    if isinstance(adapters, str) or len(adapters) != count:
        raise ValueError(
            f"adapters names one LoRA adapter (or None) per sequence; got {adapters!r} for "
            f"{count} sequences"
        )
    if spec is None:
        if all(a is None for a in adapters):
            return None
        raise ValueError(
            f"the batch names LoRA adapters {sorted({str(a) for a in adapters})}, but the model "
            "was loaded without adapters; load them with --lora NAME=DIR (load_model(..., "
            "adapters={NAME: DIR}))"
        )
    return tuple(spec.index(a) for a in adapters)
