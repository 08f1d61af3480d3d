"""Mesh axes, token layouts, sum groups and the parallel topology read from a mesh.

Names only: nothing here holds a device or an array. Every other module spells mesh axes through
`MeshAxis`; models get the partition-spec entries they need from `Topology`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping

from jax.sharding import PartitionSpec


class MeshAxis(enum.StrEnum):
    """The named mesh axes boundary-jax understands, outermost first."""

    PP = "pp"
    ATTN_DP = "attn_dp"
    ATTN_CP = "attn_cp"
    ATTN_TP = "attn_tp"


class TokenAxis(enum.Enum):
    """A mesh axis that can partition token rows or carry a partial sum, in canonical order."""

    ATTN_DP = MeshAxis.ATTN_DP
    ATTN_CP = MeshAxis.ATTN_CP
    ATTN_TP = MeshAxis.ATTN_TP

    @property
    def order(self) -> int:
        return _TOKEN_AXIS_ORDER[self]

    @property
    def mesh_name(self) -> str:
        return self.value.value


_TOKEN_AXIS_ORDER = {axis: i for i, axis in enumerate(TokenAxis)}


def canonical(axes: Iterable[TokenAxis]) -> tuple[TokenAxis, ...]:
    """`axes` without repeats, in canonical (DP, CP, TP) order."""
    return tuple(sorted(set(axes), key=lambda axis: axis.order))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which token axes partition a rank's rows.

    A rank holding `Layout((ATTN_DP,))` rows holds its attention-DP rank's tokens, alike on every
    attention-TP rank; `Layout((ATTN_DP, ATTN_TP))` is that rank's attention-TP slice of them;
    `Layout(())` is every token. Rows partitioned over several axes are ordered with the first
    axis outermost. Size-one axes are dropped by `Topology.layout`.

    Attributes:
      sharded: The partitioning token axes, in canonical order.
    """

    sharded: tuple[TokenAxis, ...] = ()

    def __post_init__(self):
        if tuple(self.sharded) != canonical(self.sharded):
            raise ValueError(
                f"Layout axes must be distinct and in canonical order; got {self.sharded=}"
            )

    def __contains__(self, axis: TokenAxis) -> bool:
        return axis in self.sharded

    def __str__(self) -> str:
        return "{" + (", ".join(axis.name for axis in self.sharded) or "all rows") + "}"


class SumGroup(enum.Enum):
    """A named group of ranks whose partial contributions one sum completes."""

    ATTN_TP = "attention TP"
    TP = "full TP"
    MOE_OUTPUT = "MoE output"
    ATTN_CP = "attention CP"
    MOE_EP = "MoE expert parallel"
    MOE_TP = "MoE expert width"


class BatchVariant(enum.Enum):
    """The row arrangement of one forward's batch; a stage binds a path per supported variant."""

    ORDINARY = "ORDINARY"
    INPUT_SCATTERED = "INPUT_SCATTERED"
    CONTEXT_PARALLEL = "CONTEXT_PARALLEL"
    UNPADDED = "UNPADDED"


@dataclasses.dataclass(frozen=True)
class Topology:
    """The parallel configuration, read from the named axes of a mesh.

    Full TP is the product of the attention DP, CP and TP axes: a dense FFN over the full TP group
    shards its weights over all three. The pipeline axis is reserved.

    A sparse FFN's experts are split over the expert-parallel group (`SumGroup.MOE_EP`, `moe_ep`
    ranks) and each expert's width over the rest of the full TP group (`SumGroup.MOE_TP`,
    `moe_tp = tp_size / moe_ep` ranks), EP outermost: `moe_ep x moe_tp = attn_dp x attn_cp x
    attn_tp`. Each group is made of whole mesh axes: the EP group is the outermost active axes
    of the full TP group whose sizes multiply to `moe_ep`.

    Attributes:
      attn_dp: Attention data-parallel size.
      attn_cp: Attention context-parallel size.
      attn_tp: Attention tensor-parallel size.
      pp: Pipeline-parallel size.
      moe_ep: Expert-parallel size (not a mesh axis: a grouping of the full TP group's axes).
    """

    attn_dp: int = 1
    attn_cp: int = 1
    attn_tp: int = 1
    pp: int = 1
    moe_ep: int = 1

    def __post_init__(self):
        for name in ("attn_dp", "attn_cp", "attn_tp", "pp", "moe_ep"):
            size = getattr(self, name)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"Topology sizes are positive integers; got {name}={size!r}")
        if self.tp_size % self.moe_ep:
            raise ValueError(
                f"moe_ep must divide the full TP group (attn_dp x attn_cp x attn_tp = "
                f"{self.tp_size}); got {self.moe_ep=}. Choose moe_ep among "
                f"{[d for d in range(1, self.tp_size + 1) if self.tp_size % d == 0]}"
            )
        self._moe_ep_axes()  # raises for an EP group that would split a mesh axis

    def _moe_ep_axes(self) -> tuple[TokenAxis, ...]:
        axes = self.active(_SUM_GROUP_AXES[SumGroup.TP])
        for count in range(len(axes) + 1):
            if math.prod(self.size(axis) for axis in axes[:count]) == self.moe_ep:
                return axes[:count]
        sizes = {axis.mesh_name: self.size(axis) for axis in axes}
        raise NotImplementedError(
            f"the expert-parallel group is made of whole mesh axes, outermost first; "
            f"{self.moe_ep=} is no product of the leading axes of {sizes}. Choose moe_ep among "
            f"{[math.prod(list(sizes.values())[:n]) for n in range(len(sizes) + 1)]}"
        )

    @property
    def moe_tp(self) -> int:
        """Ranks each expert's width is split over: `tp_size / moe_ep`."""
        return self.tp_size // self.moe_ep

    def experts_per_rank(self, num_experts: int) -> int:
        """The experts each expert-parallel rank holds.

        Raises:
          ValueError: `moe_ep` does not divide `num_experts`.
        """
        if num_experts % self.moe_ep:
            raise ValueError(
                f"moe_ep must divide the number of experts; got {self.moe_ep=} for "
                f"{num_experts=}. Choose an expert-parallel size that divides {num_experts}"
            )
        return num_experts // self.moe_ep

    @classmethod
    def from_mesh(cls, mesh, *, moe_ep: int = 1) -> Topology:
        """Reads the sizes of the `MeshAxis` axes of `mesh` (a `jax.sharding.Mesh`).

        Raises:
          ValueError: The mesh has an axis boundary-jax does not know, or `moe_ep` does not
            divide its full TP group.
        """
        return cls.from_axis_sizes(dict(mesh.shape), moe_ep=moe_ep)

    @classmethod
    def from_axis_sizes(cls, sizes: Mapping[str, int], *, moe_ep: int = 1) -> Topology:
        """Builds a topology from `{mesh axis name: size}`; absent axes have size one."""
        known = {axis.value for axis in MeshAxis}
        unknown = sorted(set(sizes) - known)
        if unknown:
            raise ValueError(
                f"mesh axes must be among {sorted(known)}; got unknown axes {unknown}. "
                "Name the mesh axes with boundary_jax.MeshAxis values."
            )
        axes = {axis.name.lower(): int(sizes.get(axis.value, 1)) for axis in MeshAxis}
        return cls(**axes, moe_ep=moe_ep)

    @property
    def tp_size(self) -> int:
        """Size of the full TP group (attention DP x CP x TP)."""
        return self.attn_dp * self.attn_cp * self.attn_tp

    def size(self, axes: TokenAxis | Iterable[TokenAxis]) -> int:
        """Number of ranks along one token axis, or along several together."""
        if isinstance(axes, TokenAxis):
            return getattr(self, axes.name.lower())
        return math.prod(self.size(axis) for axis in axes)

    def active(self, axes: Iterable[TokenAxis]) -> tuple[TokenAxis, ...]:
        """`axes` in canonical order with size-one axes dropped."""
        return tuple(axis for axis in canonical(axes) if self.size(axis) > 1)

    def layout(self, *axes: TokenAxis) -> Layout:
        """The layout whose rows `axes` partition, size-one axes dropped."""
        return Layout(self.active(axes))

    def attention_rows(self) -> Layout:
        """The attention's rows: each attention-DP rank's tokens, alike over attention TP.

        Also the rows of the stack input (the embedding) and of the stack output.
        """
        return self.layout(TokenAxis.ATTN_DP)

    def sum_axes(self, group: SumGroup) -> tuple[TokenAxis, ...]:
        """The token axes a sum over `group` runs across, size-one axes dropped.

        `MOE_EP` and `MOE_TP` are the expert-parallel and expert-width parts of the full TP
        group (see the class docstring)."""
        if group is SumGroup.MOE_EP:
            return self._moe_ep_axes()
        if group is SumGroup.MOE_TP:
            ep = self._moe_ep_axes()
            return tuple(a for a in self.active(_SUM_GROUP_AXES[SumGroup.TP]) if a not in ep)
        return self.active(_SUM_GROUP_AXES[group])

    @staticmethod
    def mesh_names(axes: Iterable[TokenAxis]) -> tuple[str, ...]:
        """Mesh axis names of `axes`, for collectives."""
        return tuple(axis.mesh_name for axis in canonical(axes))

    def spec_entry(self, axes: Iterable[TokenAxis]) -> str | tuple[str, ...] | None:
        """The `PartitionSpec` entry of one dimension split over `axes` (size-one dropped)."""
        names = self.mesh_names(self.active(axes))
        if not names:
            return None
        return names[0] if len(names) == 1 else names

    def shard_entry(self, group: SumGroup) -> str | tuple[str, ...] | None:
        """The `PartitionSpec` entry of a weight dimension split over the ranks of `group`
        (`SumGroup.MOE_EP`: the expert axis of stacked experts; `MOE_TP`: their width)."""
        return self.spec_entry(self.sum_axes(group))

    def row_spec(self, layout: Layout, *trailing) -> PartitionSpec:
        """The `PartitionSpec` of a [rows, ...] array whose rows follow `layout`."""
        return PartitionSpec(self.spec_entry(layout.sharded), *trailing)

    def mesh_shape(self) -> dict[str, int]:
        """`{mesh axis name: size}` for every axis, outermost first, size-one axes included."""
        return {axis.value: getattr(self, axis.name.lower()) for axis in MeshAxis}


_SUM_GROUP_AXES = {
    SumGroup.ATTN_TP: (TokenAxis.ATTN_TP,),
    SumGroup.TP: (TokenAxis.ATTN_DP, TokenAxis.ATTN_CP, TokenAxis.ATTN_TP),
    SumGroup.MOE_OUTPUT: (TokenAxis.ATTN_DP, TokenAxis.ATTN_CP, TokenAxis.ATTN_TP),
    SumGroup.ATTN_CP: (TokenAxis.ATTN_CP,),
}
