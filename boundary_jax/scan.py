"""Runs a homogeneous run of layers under `jax.lax.scan` over their stacked parameters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def scan_layers(
    layers: Sequence[nnx.Module],
    carry: Any,
    call: Callable[[nnx.Module, Any], Any] = lambda layer, carry: layer(*carry),
) -> Any:
    """Runs `carry = call(layer, carry)` for each layer, as one `lax.scan` over stacked state.

    The layers must share one structure, bound plans included: in a layer stack that holds for
    the layers between the stack entry and the terminal layer. The carry is typically
    `(output, stream)`; an `OwedOutput` has no leaves, so it scans as static structure.

    Raises:
      ValueError: The layers differ in structure (for example the stack entry or terminal layer).
    """
    return scan_layers_with_outputs(layers, carry, lambda layer, c: (call(layer, c), None))[0]


def scan_layers_with_outputs(
    layers: Sequence[nnx.Module],
    carry: Any,
    call: Callable[[nnx.Module, Any], tuple[Any, Any]],
) -> tuple[Any, Any]:
    """`scan_layers` whose `call(layer, carry)` returns `(carry, output)`; also returns every
    layer's output stacked on a leading axis (e.g. each layer's captured hidden state).

    Raises:
      ValueError: The layers differ in structure (for example the stack entry or terminal layer).
    """
    if not layers:
        return carry, None
    graphdefs, states = zip(*(nnx.split(layer) for layer in layers), strict=True)
    for index, graphdef in enumerate(graphdefs[1:], start=1):
        if graphdef != graphdefs[0]:
            raise ValueError(
                f"scan_layers needs layers of one structure; layer {index} differs from layer 0 "
                "(scan the layers between the stack entry and the terminal layer)"
            )
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)

    def body(carry, state):
        return call(nnx.merge(graphdefs[0], state), carry)

    return jax.lax.scan(body, carry, stacked)
