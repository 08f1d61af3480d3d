"""A consumer's quantized input format: FP8 e4m3 values with one float32 scale per token group.

The fine-grained format of DeepSeek-V3 and the Qwen3 FP8 checkpoints: each row (token) is cut
into groups of `group` consecutive features; a group's scale is its largest magnitude / 448 (the
largest finite e4m3 value) in float32, and its values are the features divided by the scale,
rounded to the nearest e4m3 (`pallas_kernels.quantize` holds the specification the kernels
share). `values * scales` gives the features back to within half an FP8 step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.quantize import (
    dequantize_token_groups_reference,
    quantize_token_groups_reference,
)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class Quantized:
    """Rows quantized per token group: what a quantized read hands its stage's compute.

    Attributes:
      values: [rows, features] float8_e4m3fn.
      scales: [rows, features / group] float32: the factor each group's values are multiplied
        by to give the features back.
    """

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the rows (the values')."""
        return self.values.shape

    @property
    def group(self) -> int:
        """Features per scale."""
        return self.values.shape[-1] // self.scales.shape[-1]

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """`values * scales` per group, computed in float32 (wider for float64), in `dtype`."""
        return dequantize_token_groups_reference(self.values, self.scales, dtype)


@dataclasses.dataclass(frozen=True)
class Fp8TokenGroups:
    """The format: float8_e4m3fn values, one float32 scale per `group` features of a row.

    Attributes:
      group: Features per scale (128 in the Hugging Face fine-grained FP8 checkpoints).
    """

    group: int = 128

    def __post_init__(self):
        if not isinstance(self.group, int) or isinstance(self.group, bool) or self.group < 1:
            raise ValueError(f"group must be a positive int; got group={self.group!r}")

    @property
    def name(self) -> str:
        """The format in words, for plans and messages."""
        return f"fp8 e4m3, a float32 scale per {self.group} features"

    def quantize(self, x: jax.Array) -> Quantized:
        """`x` [..., features] in this format: `quantize_token_groups(x, self.group)`."""
        return quantize_token_groups(x, self.group)


def quantize_token_groups(x: jax.Array, group: int = 128) -> Quantized:
    """Quantizes rows per group of `group` features (`Fp8TokenGroups`' specification).

    Each group's scale is `max |x| / 448` in float32 (taken of `x` widened to float32); its
    values are `x / scale` rounded to the nearest float8_e4m3fn (a group of zeros: scale 0,
    values 0).

    Args:
      x: [..., features], features a multiple of `group`.
      group: Features per scale.

    Returns:
      The `Quantized` rows: values shaped like `x`, scales [..., features / group].

    Raises:
      ValueError: `features` is not a multiple of `group`.
    """
    return Quantized(*quantize_token_groups_reference(x, group))
