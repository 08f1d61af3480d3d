"""The gated MLP (SwiGLU, or the tanh-GELU GeGLU), split over the full TP group; it returns an
unreduced partial sum. An MLP with biases declares its down projection's bias replicated on its
stage (`replicated_parts`), so the sum over full TP counts it once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from boundary_jax import SumGroup, Topology
from boundary_jax.declare import Replicated
from boundary_jax.designs import Quantized

from ..config import Activation
from .linear import DENSE_LINEARS, Linears, group_size
from .lora import LoraSpec, LoraTarget, column_lora, row_lora


def _gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


_ACTIVATIONS = {Activation.SILU: jax.nn.silu, Activation.GELU_TANH: _gelu_tanh}

DOWN_PROJ_BIAS = "mlp.down_proj.bias"
"""The replicated part an MLP with biases declares on its stage."""


def replicated_parts(bias: bool) -> tuple[Replicated, ...]:
    """What a dense FFN stage declares replicated: with `bias` (`DecoderConfig.mlp_bias`) the
    down projection's bias, which every rank of full TP holds whole."""
    return (Replicated(DOWN_PROJ_BIAS),) if bias else ()


class SwiGLU(nnx.Module):
    """`down(act(gate(x)) * up(x))` with the intermediate features split over full TP; `act` is
    SiLU (SwiGLU) unless the `activation` says otherwise (GeGLU: GELU, tanh form).

    Full TP spans attention DP x CP x TP, so the input rows must be the same on every rank of
    the group (the boundary gathers attention-DP rows before the FFN). Both projections are
    drawn from N(0, init_std^2) (`linear.weight_init`; None: std 1/sqrt(fan_in)).

    Attributes:
      gate_up_proj: [hidden, 2, intermediate]: the gate and up projections stacked (one matmul),
        columns split over `SumGroup.FULL_TP`; with `bias`, their [2, intermediate] biases
        split alike.
      down_proj: [intermediate, hidden], rows split over `SumGroup.FULL_TP`; with `bias`, a
        [hidden] bias whole on every rank, added where the stage boundary counts it.
      activation: The gate's activation.
      gate_up_lora, down_lora: The adapter stacks of the projections (`layers.lora`: gate and
        up as the parts of one), or None where no adapter targets them.

    The projections come from `linears` (dense by default; FP8 with `fp8_linear.Fp8Linears`).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        topology: Topology,
        dtype: jnp.dtype = jnp.float32,
        activation: Activation = Activation.SILU,
        bias: bool = False,
        init_std: float | None = None,
        linears: Linears = DENSE_LINEARS,
        lora: LoraSpec | None = None,
        rngs: nnx.Rngs,
    ):
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"SwiGLU gates with {sorted(_ACTIVATIONS)}; got {activation=}. An ungated "
                "activation is `layers.ungated_mlp.UngatedMlp`'s"
            )
        tp = group_size(topology, SumGroup.FULL_TP)
        if intermediate_size % tp:
            raise ValueError(
                f"intermediate_size ({intermediate_size}) must be a multiple of the full TP size "
                f"({tp} = attn_dp x attn_cp x attn_tp); choose a mesh whose TP size divides it"
            )
        self.gate_up_proj = linears.column(
            hidden_size,
            intermediate_size,
            group=SumGroup.FULL_TP,
            topology=topology,
            parts=2,
            bias=bias,
            dtype=dtype,
            init_std=init_std,
            rngs=rngs,
        )
        self.down_proj = linears.row(
            intermediate_size,
            hidden_size,
            group=SumGroup.FULL_TP,
            topology=topology,
            bias=bias,
            dtype=dtype,
            init_std=init_std,
            rngs=rngs,
        )
        self.gate_up_lora = column_lora(
            lora,
            (LoraTarget.GATE, LoraTarget.UP),
            hidden_size,
            intermediate_size,
            group=SumGroup.FULL_TP,
            topology=topology,
            dtype=dtype,
            rngs=rngs,
        )
        self.down_lora = row_lora(
            lora,
            LoraTarget.DOWN,
            intermediate_size,
            hidden_size,
            group=SumGroup.FULL_TP,
            topology=topology,
            dtype=dtype,
            rngs=rngs,
        )
        self.activation = activation

    def __call__(
        self,
        x: jax.Array | Quantized,
        adapters: jax.Array | None = None,
        *,
        counts_bias: bool | jax.Array | None = None,
    ) -> jax.Array:
        """[T, hidden] complete rows (or their FP8 `Quantized` form, for FP8 projections) ->
        [T, hidden] partial, owing a sum over full TP; with `adapters` ([T] int32 LoRA adapter
        of each row, 0 for none) each row's adapter deltas join its projections. With biases,
        `counts_bias` is the stage boundary's `counts(DOWN_PROJ_BIAS, stream)`: whether this
        rank adds the down projection's bias."""
        activation = _ACTIVATIONS[self.activation]
        if adapters is None and counts_bias is None:
            return self.down_proj.of_activation(self.gate_up_proj(x), activation)
        gate_up = self.gate_up_proj(x)
        if adapters is not None and self.gate_up_lora is not None:
            gate_up = gate_up + self.gate_up_lora(x, adapters)
        hidden = activation(gate_up[:, 0]) * gate_up[:, 1]
        y = self.down_proj(hidden, counts_bias=counts_bias)
        if adapters is not None and self.down_lora is not None:
            y = y + self.down_lora(hidden, adapters)
        return y
