"""Nemotron-H's ungated MLP, `down(relu(up(x))^2)`, split over the full TP group; it returns an
unreduced partial sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from boundary_jax import SumGroup, Topology

from .activations import ExpertActivation
from .linear import ColumnParallelLinear, RowParallelLinear, group_size


class Relu2Mlp(nnx.Module):
    """`down(relu(up(x))^2)` (transformers' `NemotronHMLP`, `mlp_hidden_act` "relu2") with the
    intermediate features split over full TP.

    Full TP spans attention DP x CP x TP, so the input rows must be the same on every rank of
    the group (the boundary gathers attention-DP rows before the FFN).

    Attributes:
      up_proj: [hidden, intermediate], columns split over `SumGroup.FULL_TP`.
      down_proj: [intermediate, hidden], rows split over `SumGroup.FULL_TP`.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        topology: Topology,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        tp = group_size(topology, SumGroup.FULL_TP)
        if intermediate_size % tp:
            raise ValueError(
                f"intermediate_size ({intermediate_size}) must be a multiple of the full TP size "
                f"({tp} = attn_dp x attn_cp x attn_tp); choose a mesh whose TP size divides it"
            )
        common = {"group": SumGroup.FULL_TP, "topology": topology, "dtype": dtype, "rngs": rngs}
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, **common)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[T, hidden] complete rows -> [T, hidden] partial, owing a sum over full TP."""
        return self.down_proj(ExpertActivation.RELU2.apply(self.up_proj(x)))
