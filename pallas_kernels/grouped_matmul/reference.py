"""The specification of a grouped matmul: each row times its group's weights."""

import jax
import jax.numpy as jnp
from jax import lax


def grouped_matmul_reference(
    rows: jax.Array,  # [M, K], sorted by group
    weights: jax.Array,  # [G, K, N]
    group_sizes: jax.Array,  # [G] int
) -> jax.Array:
    """`jax.lax.ragged_dot` in float32 accumulation, rows past the groups zero: the spec.

    Returns:
      [M, N] in `rows.dtype`: row r is `rows[r] @ weights[g]` for the group g it falls in
      (group g's rows follow group g - 1's), zero past `sum(group_sizes)`.
    """
    return lax.ragged_dot(rows, weights, group_sizes, preferred_element_type=jnp.float32).astype(
        rows.dtype
    )
