"""The ungated MLP, `down(act(up(x)))` (relu^2, xIELU, ...), split over the full TP group; it
returns an unreduced partial sum."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from boundary_jax import SumGroup, Topology

from .linear import ColumnParallelLinear, RowParallelLinear, group_size
from .lora import LoraSpec, LoraTarget, column_lora, row_lora


class UngatedMlp(nnx.Module):
    """`down(act(up(x)))` with the intermediate features split over full TP: transformers'
    non-gated MLPs, `down_proj(act_fn(up_proj(x)))`.

    Full TP spans attention DP x CP x TP, so the input rows must be the same on every rank of
    the group (the boundary gathers attention-DP rows before the FFN). The activation is
    elementwise: each rank applies it to its own columns.

    Attributes:
      up_proj: [hidden, intermediate], columns split over `SumGroup.FULL_TP` (with `bias`, its
        bias split alike).
      down_proj: [intermediate, hidden], rows split over `SumGroup.FULL_TP` (with `bias`, a
        [hidden] bias whole on every rank, added where the stage boundary counts it:
        `mlp.replicated_parts`).
      act_fn: The activation: a function (`activations.relu2`), or a module whose parameters
        are the layer's (`activations.Xielu`, replicated on every rank).
      up_lora, down_lora: The adapter stacks of the projections (`layers.lora`), or None where
        no adapter targets them.

    Both projections are dense, in the model's dtype (not FP8: they take no `linears`), drawn
    from N(0, init_std^2) (`linear.weight_init`; None: std 1/sqrt(fan_in)). A LoRA spec that
    targets gate_proj is refused (NotImplementedError): there is no gate.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: Callable[[jax.Array], jax.Array],
        topology: Topology,
        bias: bool = False,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        lora: LoraSpec | None = None,
        rngs: nnx.Rngs,
    ):
        if lora is not None and LoraTarget.GATE in lora.targets:
            raise NotImplementedError(
                "an ungated MLP has no gate_proj for an adapter to target; got targets "
                f"{sorted(t.value for t in lora.targets)}. Target up_proj and down_proj (and the "
                "attention's projections)"
            )
        tp = group_size(topology, SumGroup.FULL_TP)
        if intermediate_size % tp:
            raise ValueError(
                f"intermediate_size ({intermediate_size}) must be a multiple of the full TP size "
                f"({tp} = attn_dp x attn_cp x attn_tp); choose a mesh whose TP size divides it"
            )
        common = {
            "group": SumGroup.FULL_TP,
            "topology": topology,
            "bias": bias,
            "dtype": dtype,
            "init_std": init_std,
            "rngs": rngs,
        }
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, **common)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, **common)
        self.act_fn = activation
        stacks = {"group": SumGroup.FULL_TP, "topology": topology, "dtype": dtype, "rngs": rngs}
        self.up_lora = column_lora(lora, (LoraTarget.UP,), hidden_size, intermediate_size, **stacks)
        self.down_lora = row_lora(lora, LoraTarget.DOWN, intermediate_size, hidden_size, **stacks)

    def __call__(
        self,
        x: jax.Array,
        adapters: jax.Array | None = None,
        *,
        counts_bias: bool | jax.Array | None = None,
    ) -> jax.Array:
        """[T, hidden] complete rows -> [T, hidden] partial, owing a sum over full TP. With
        `adapters` ([T] LoRA adapter of each row, 0 for none) each row's adapter deltas join
        its projections; with biases, `counts_bias` says whether this rank adds the down
        projection's (the stage boundary's `counts(mlp.DOWN_PROJ_BIAS, stream)`)."""
        up = self.up_proj(x)
        if adapters is not None and self.up_lora is not None:
            up = up + self.up_lora(x, adapters)
        hidden = self.act_fn(up)
        y = self.down_proj(hidden, counts_bias=counts_bias)
        if adapters is not None and self.down_lora is not None:
            y = y + self.down_lora(hidden, adapters)
        return y
