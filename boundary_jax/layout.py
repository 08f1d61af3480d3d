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
    """The named mesh axes boundary-jax understands, outermost first.

    A `*_EP` axis is the expert-parallel part of the token axis that follows it: present only
    where the expert-parallel size splits that axis (`Topology`), the axis after it then holds
    the rest.
    """

    PP = "pp"
    ATTN_DP_EP = "attn_dp_ep"
    ATTN_DP = "attn_dp"
    ATTN_CP_EP = "attn_cp_ep"
    ATTN_CP = "attn_cp"
    ATTN_TP_EP = "attn_tp_ep"
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
        """The name of the mesh axis this token axis is, or, where it is split, its inner part."""
        return self.value.value

    @property
    def expert_mesh_axis(self) -> MeshAxis:
        """The mesh axis of this axis's expert-parallel part, where `moe_ep` splits it."""
        return _EXPERT_PART[self]


_TOKEN_AXIS_ORDER = {axis: i for i, axis in enumerate(TokenAxis)}
_EXPERT_PART = {
    TokenAxis.ATTN_DP: MeshAxis.ATTN_DP_EP,
    TokenAxis.ATTN_CP: MeshAxis.ATTN_CP_EP,
    TokenAxis.ATTN_TP: MeshAxis.ATTN_TP_EP,
}


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
                f"Layout axes must be distinct and in canonical order; got sharded={self.sharded!r}"
            )

    def __contains__(self, axis: TokenAxis) -> bool:
        return axis in self.sharded

    def __str__(self) -> str:
        return "{" + (", ".join(axis.name for axis in self.sharded) or "all rows") + "}"


class SumGroup(enum.Enum):
    """A named group of ranks whose partial contributions one sum completes.

    ATTN_TP: attention TP alone (an attention's heads).
    FULL_TP: the full TP group, attention DP x CP x TP (a dense FFN's weights).
    MOE_OUTPUT: the ranks a gathered MoE's output is summed over (the full TP group's axes).
    ATTN_CP: attention CP alone.
    MOE_EP, MOE_TP: the expert-parallel ranks and the ranks an expert's width is split over.

    `SumGroup.TP` is a deprecated alias of `FULL_TP` (the same member), kept for one release:
    beside `ATTN_TP` it read as attention TP, not as the whole DP x CP x TP group.
    """

    ATTN_TP = "attention TP"
    FULL_TP = "full TP"
    MOE_OUTPUT = "MoE output"
    ATTN_CP = "attention CP"
    MOE_EP = "MoE expert parallel"
    MOE_TP = "MoE expert width"
    TP = "full TP"  # Deprecated alias of FULL_TP; removed in the next release.


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
    `moe_tp = tp_size / moe_ep` ranks): `moe_ep x moe_tp = attn_dp x attn_cp x attn_tp`, for
    every divisor `moe_ep` of the full TP group. Each token axis is factored into an
    expert-parallel part and a width part, greedily from the outermost: the part of an axis of
    size `n` is `gcd(moe_ep left, n)`. A token axis whose part is strictly between 1 and `n` is
    two mesh axes, outer first: its part (`TokenAxis.expert_mesh_axis`, e.g. `attn_tp_ep`) and the
    rest (keeping the axis's name). A collective over that token axis names both (`mesh_names`),
    so its ranks keep their order; the MoE groups are sets of mesh axes (`group_names`).

    Attributes:
      attn_dp: Attention data-parallel size.
      attn_cp: Attention context-parallel size.
      attn_tp: Attention tensor-parallel size.
      pp: Pipeline-parallel size.
      moe_ep: Expert-parallel size (not a token axis: a grouping of the full TP group's ranks).
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
                f"{self.tp_size}); got moe_ep={self.moe_ep!r}. Choose moe_ep among "
                f"{[d for d in range(1, self.tp_size + 1) if self.tp_size % d == 0]}"
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
                f"moe_ep must divide the number of experts; got moe_ep={self.moe_ep!r} for "
                f"{num_experts=}. Choose an expert-parallel size that divides {num_experts}"
            )
        return num_experts // self.moe_ep

    @classmethod
    def from_mesh(cls, mesh, *, moe_ep: int = 1) -> Topology:
        """Reads the sizes of the `MeshAxis` axes of `mesh` (a `jax.sharding.Mesh`).

        The mesh must have the axes `moe_ep` factors its token axes into (`mesh_shape`, as
        `boundary_jax.make_mesh` builds them; size-one axes may be absent).

        Raises:
          ValueError: The mesh has an axis boundary-jax does not know, `moe_ep` does not
            divide its full TP group, or its axes are not those `moe_ep` factors them into.
        """
        sizes = dict(mesh.shape)
        topology = cls.from_axis_sizes(sizes, moe_ep=moe_ep)
        topology._check_mesh_shape(sizes)
        return topology

    @classmethod
    def from_axis_sizes(cls, sizes: Mapping[str, int], *, moe_ep: int = 1) -> Topology:
        """Builds a topology from `{mesh axis name: size}`; absent axes have size one.

        A token axis is the product of its axis and its expert-parallel part
        (`{"attn_tp_ep": 2, "attn_tp": 2}` is attention TP 4). Where `sizes` names an
        expert-parallel part, the factoring must be that of `moe_ep`.

        Raises:
          ValueError: An axis boundary-jax does not know, `moe_ep` not dividing the full TP
            group, or expert-parallel parts that another `moe_ep` would make.
        """
        known = {axis.value for axis in MeshAxis}
        unknown = sorted(set(sizes) - known)
        if unknown:
            raise ValueError(
                f"mesh axes must be among {sorted(known)}; got unknown axes {unknown}. "
                "Name the mesh axes with boundary_jax.MeshAxis values."
            )

        def size(axis: MeshAxis) -> int:
            return int(sizes.get(axis.value, 1))

        tokens = {a.name.lower(): size(a.value) * size(a.expert_mesh_axis) for a in TokenAxis}
        topology = cls(**tokens, pp=size(MeshAxis.PP), moe_ep=moe_ep)
        if any(size(axis.expert_mesh_axis) > 1 for axis in TokenAxis):
            topology._check_mesh_shape(sizes)
        return topology

    def _check_mesh_shape(self, sizes: Mapping[str, int]) -> None:
        given = {name: int(size) for name, size in sizes.items() if int(size) > 1}
        want = {name: size for name, size in self.mesh_shape().items() if size > 1}
        if given != want:
            raise ValueError(
                f"moe_ep={self.moe_ep} factors the mesh axes as {want}; got a mesh of {given}. "
                "Build the mesh with boundary_jax.make_mesh(topology), or pass the moe_ep it "
                "was made for"
            )

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
        """The attention's rows: each attention-DP rank's tokens (under context parallelism,
        this attention-CP rank's zigzag share of them), alike over attention TP.

        Also the rows of the stack input (the embedding) and of the stack output.
        """
        return self.layout(TokenAxis.ATTN_DP, TokenAxis.ATTN_CP)

    def sum_axes(self, group: SumGroup) -> tuple[TokenAxis, ...]:
        """The token axes a sum over `group` runs across, size-one axes dropped.

        Raises:
          ValueError: `group` is `MOE_EP` or `MOE_TP`, groups of mesh axes that may split a
            token axis (`group_names`, `group_size`).
        """
        if group in (SumGroup.MOE_EP, SumGroup.MOE_TP):
            raise ValueError(
                f"sum_axes takes a group of whole token axes; got {group=}, a group of mesh axes "
                "that may split one. Use Topology.group_names / group_size / shard_entry for it"
            )
        return self.active(_SUM_GROUP_AXES[group])

    def expert_part(self, axis: TokenAxis) -> int:
        """The expert-parallel part of `axis`: its ranks in the `MOE_EP` group (see the class
        docstring); the rest of its ranks are in `MOE_TP`."""
        parts, left = {}, self.moe_ep
        for token in TokenAxis:  # outermost first
            parts[token] = math.gcd(left, self.size(token))
            left //= parts[token]
        return parts[axis]

    def _parts(self, axis: TokenAxis) -> tuple[tuple[str, int, bool], ...]:
        """`(mesh axis name, size, in the MOE_EP group)` of the mesh axes of `axis`, outer first."""
        size, part = self.size(axis), self.expert_part(axis)
        if 1 < part < size:
            return (
                (axis.expert_mesh_axis.value, part, True),
                (axis.mesh_name, size // part, False),
            )
        return ((axis.mesh_name, size, part > 1),)

    def mesh_names(self, axes: Iterable[TokenAxis]) -> tuple[str, ...]:
        """Mesh axis names of `axes` (a split axis: both its mesh axes, outer first), for
        collectives over them."""
        return tuple(name for axis in canonical(axes) for name, _, _ in self._parts(axis))

    def group_names(self, group: SumGroup) -> tuple[str, ...]:
        """Mesh axis names of the ranks of `group`, outermost first, size-one axes dropped: for
        a collective over `group` or this rank's index in it."""
        if group not in (SumGroup.MOE_EP, SumGroup.MOE_TP):
            return self.mesh_names(self.sum_axes(group))
        expert = group is SumGroup.MOE_EP
        return tuple(
            name
            for axis in self.active(_SUM_GROUP_AXES[SumGroup.FULL_TP])
            for name, size, in_ep in self._parts(axis)
            if in_ep is expert and size > 1
        )

    def group_size(self, group: SumGroup) -> int:
        """Number of ranks in `group`."""
        if group is SumGroup.MOE_EP:
            return self.moe_ep
        if group is SumGroup.MOE_TP:
            return self.moe_tp
        return self.size(self.sum_axes(group))

    def spec_entry(self, axes: Iterable[TokenAxis]) -> str | tuple[str, ...] | None:
        """The `PartitionSpec` entry of one dimension split over `axes` (size-one dropped)."""
        return _entry(self.mesh_names(self.active(axes)))

    def shard_entry(self, group: SumGroup) -> str | tuple[str, ...] | None:
        """The `PartitionSpec` entry of a weight dimension split over the ranks of `group`
        (`SumGroup.MOE_EP`: the expert axis of stacked experts; `MOE_TP`: their width)."""
        return _entry(self.group_names(group))

    def row_spec(self, layout: Layout, *trailing) -> PartitionSpec:
        """The `PartitionSpec` of a [rows, ...] array whose rows follow `layout`."""
        return PartitionSpec(self.spec_entry(layout.sharded), *trailing)

    def mesh_shape(self) -> dict[str, int]:
        """`{mesh axis name: size}`, outermost first: every token axis and the pipeline axis,
        size-one axes included, and the expert-parallel part of each axis `moe_ep` splits."""
        shape = {MeshAxis.PP.value: self.pp}
        for axis in TokenAxis:
            shape.update((name, size) for name, size, _ in self._parts(axis))
        return shape


def _entry(names: tuple[str, ...]) -> str | tuple[str, ...] | None:
    if not names:
        return None
    return names[0] if len(names) == 1 else names


_SUM_GROUP_AXES = {
    SumGroup.ATTN_TP: (TokenAxis.ATTN_TP,),
    SumGroup.FULL_TP: (TokenAxis.ATTN_DP, TokenAxis.ATTN_CP, TokenAxis.ATTN_TP),
    SumGroup.MOE_OUTPUT: (TokenAxis.ATTN_DP, TokenAxis.ATTN_CP, TokenAxis.ATTN_TP),
    SumGroup.ATTN_CP: (TokenAxis.ATTN_CP,),
}
