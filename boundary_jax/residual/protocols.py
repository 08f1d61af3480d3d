"""What a producer's residual update and a consumer's residual read must provide.

A boundary selects its ordering from the capabilities declared here, so declare only what the
implementation really supports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax

Norm = Callable[[jax.Array], jax.Array]


class ResidualUpdate(Protocol):
    """How a producer's complete contribution joins the residual.

    Attributes:
      plain: The update is `residual + value`. Only a plain update may be fused into an add + norm
        kernel, snapshotted, or added before a sum completes.
    """

    plain: bool

    def apply(self, residual: jax.Array, value: jax.Array) -> jax.Array:
        """The new residual, in `residual.dtype`."""
        ...


class ResidualReadout(Protocol):
    """How a consumer turns the residual into its compute input; each call returns
    `(compute_input, residual)`.

    Attributes:
      reads_before_dp_gather: The read runs on the source rows, before an attention-DP gather
        moves its result; otherwise the residual is gathered and read on the gathered rows.
    """

    reads_before_dp_gather: bool

    def init_residual(self, x: jax.Array, norm: Norm | None) -> tuple[jax.Array, jax.Array]:
        """At the stack entry: the complete input becomes the residual."""
        ...

    def read(self, residual: jax.Array, norm: Norm | None) -> tuple[jax.Array, jax.Array]:
        """Reads a written residual."""
        ...

    def update_and_read(
        self, update: ResidualUpdate, value: jax.Array, residual: jax.Array, norm: Norm | None
    ) -> tuple[jax.Array, jax.Array]:
        """Applies the producer's `update` of `value`, then reads; may fuse the two."""
        ...
