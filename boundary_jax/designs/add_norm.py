"""The plain residual design: `residual + value`, read through an RMSNorm with FP32 accumulation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import round_residual

from .norm import RMSNorm, accumulation_dtype, add_rms_norm
from .protocols import Norm, ReadState, ResidualUpdate
from .quantized import Fp8TokenGroups, Quantized


@dataclasses.dataclass(frozen=True)
class PlainAdd:
    """The update `residual + value`, summed in FP32 and rounded to the residual's dtype.

    Attributes:
      applied_at_exit: Run the add at the producer's exit (`ResidualUpdate.applied_at_exit`)
        rather than fused with the next stage's read.
    """

    plain: bool = dataclasses.field(default=True, init=False)
    applied_at_exit: bool = False

    def apply(self, residual: jax.Array, value: jax.Array, state: ReadState = None) -> jax.Array:
        acc = accumulation_dtype(jnp.promote_types(residual.dtype, value.dtype))
        return round_residual(residual.astype(acc) + value.astype(acc), residual.dtype)


@dataclasses.dataclass(frozen=True)
class AddNormRead:
    """Reads `norm(residual)`; after a plain update, fuses the add and the norm in FP32.

    With `quantize`, the stage's input is the normalized rows quantized in that format (a
    `Quantized`): the norm's output in the residual's dtype, then quantized, while the residual
    keeps its dtype and the add its FP32 accumulation.

    Attributes:
      reads_before_dp_gather: Normalize on the source rows before an attention-DP gather (the
        cheaper order; set False to gather the residual and normalize the gathered rows). A
        quantized input gathered over attention DP moves its FP8 values and scales.
      quantize: The input format the consumer takes, or None for the residual's dtype.
      reads_after_attn_tp_gather: Read on the attention's rows only (a subclass whose read
        needs every row of them); see `ResidualReadout`.
      completing_fusions: The read's own fused sum + add candidates, tried in order first.
      gathering_reads: The read's own read + gather over attention TP, tried in order.
    """

    reads_before_dp_gather: bool = True
    quantize: Fp8TokenGroups | None = None
    reads_after_attn_tp_gather: bool = False
    completing_fusions: tuple = ()
    gathering_reads: tuple = ()

    @property
    def input_format(self) -> Fp8TokenGroups | None:
        """The format of the input this read hands its stage (None: the residual's dtype)."""
        return self.quantize

    def init_residual(
        self, x: jax.Array, norm: Norm | None
    ) -> tuple[jax.Array | Quantized, jax.Array, None]:
        return self.read(x, norm)

    def read(
        self, residual: jax.Array, norm: Norm | None
    ) -> tuple[jax.Array | Quantized, jax.Array, None]:
        return self._formatted(residual if norm is None else norm(residual)), residual, None

    def update_and_read(
        self,
        update: ResidualUpdate,
        value: jax.Array,
        residual: jax.Array,
        norm: Norm | None,
        state: ReadState = None,
    ) -> tuple[jax.Array | Quantized, jax.Array, None]:
        if update.plain and isinstance(norm, RMSNorm):
            norm.check_width(residual)
            normed, summed = add_rms_norm(
                value, residual, norm.weight[...], eps=norm.eps, unit_offset=norm.unit_offset
            )
            return self._formatted(normed), summed, None
        return self.read(update.apply(residual, value, state), norm)

    def _formatted(self, normed: jax.Array) -> jax.Array | Quantized:
        return normed if self.quantize is None else self.quantize.quantize(normed)
