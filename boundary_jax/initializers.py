"""Parameters that keep their initializer, so a model's parameters can be drawn again from its
abstract state.

A parameter made by `param` holds its `Initializer` (a frozen, hashable dataclass) in its
metadata. `nnx.eval_shape` of a model then gives, per leaf, everything needed to create it: shape,
dtype, sharding and initializer (`initializer_of`), so one jitted function can draw every leaf
straight into its shards, each from its own key, without tracing the model again.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

PartitionEntries = tuple[str | tuple[str, ...] | None, ...]
"""A parameter's `PartitionSpec` entries: mesh axis name(s) or None, one per dimension."""


class Initializer(Protocol):
    """Draws a value of `shape` and `dtype` from `key`; frozen and hashable (it is metadata)."""

    def __call__(
        self, key: jax.Array | None, shape: tuple[int, ...], dtype: jnp.dtype
    ) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class Normal:
    """N(0, std^2) values, drawn in float32 and cast, so every dtype gets the same values.

    Attributes:
      std: The standard deviation (> 0).
    """

    std: float

    def __post_init__(self):
        if not self.std > 0:
            raise ValueError(f"Normal needs a positive std; got std={self.std!r}")

    def __call__(
        self, key: jax.Array | None, shape: tuple[int, ...], dtype: jnp.dtype
    ) -> jax.Array:
        if key is None:
            raise TypeError(f"{self} draws random values; pass a key (or rngs to `param`)")
        return (jax.random.normal(key, shape, jnp.float32) * self.std).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Constant:
    """Every value `value` (ones for a norm's scale, zeros for Gemma's `1 + w` scale).

    Attributes:
      value: The value.
    """

    value: float

    def __call__(
        self, key: jax.Array | None, shape: tuple[int, ...], dtype: jnp.dtype
    ) -> jax.Array:
        del key
        return jnp.full(shape, self.value, dtype)


@dataclasses.dataclass(frozen=True)
class ZeroPadded:
    """`inner`'s values over the leading block `shape` of the parameter, zeros beyond it: a
    vocab-parallel table padded to split evenly, drawn at the real vocabulary, so a key gives the
    same values whatever the padding (on every mesh).

    Attributes:
      inner: The initializer of the block.
      shape: The block's shape (no larger than the parameter's on any axis).
    """

    inner: Initializer
    shape: tuple[int, ...]

    def __call__(
        self, key: jax.Array | None, shape: tuple[int, ...], dtype: jnp.dtype
    ) -> jax.Array:
        if len(shape) != len(self.shape) or any(
            n < m for n, m in zip(shape, self.shape, strict=True)
        ):
            raise ValueError(
                f"ZeroPadded draws a block of shape {self.shape} inside the parameter; got a "
                f"parameter of shape {shape}. Give the block's shape per axis, each no larger"
            )
        block = self.inner(key, self.shape, dtype)
        return jnp.pad(block, [(0, n - m) for n, m in zip(shape, self.shape, strict=True)])


def param(
    initializer: Initializer,
    shape: tuple[int, ...],
    dtype: jnp.dtype,
    *,
    rngs: nnx.Rngs | None = None,
    sharding: PartitionEntries | None = None,
) -> nnx.Param:
    """A parameter drawn by `initializer` (from `rngs.params()`, for a random one) that keeps
    `initializer` in its metadata (`initializer_of`).

    Args:
      initializer: What the value is drawn from.
      shape: The parameter's global shape.
      dtype: Its dtype.
      rngs: The key source of a random initializer; None for a constant one.
      sharding: The `PartitionSpec` entries the parameter is split by (its `out_sharding`), or
        None for a parameter without a sharding.
    """
    value = initializer(None if rngs is None else rngs.params(), shape, dtype)
    if sharding is None:
        return nnx.Param(value, initializer=initializer)
    return nnx.Param(value, initializer=initializer, out_sharding=sharding, eager_sharding=False)


def initializer_of(variable: nnx.Variable) -> Initializer:
    """The initializer a parameter was made with (by `param`).

    Raises:
      TypeError: The variable carries none (it was made as a plain `nnx.Param`).
    """
    initializer = variable.get_metadata().get("initializer")
    if initializer is None:
        raise TypeError(
            f"{type(variable).__name__} of shape {variable.shape} carries no initializer; make "
            "it with `boundary_jax.initializers.param` so it can be drawn from an abstract state"
        )
    return initializer
