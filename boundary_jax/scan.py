"""Runs of identical layers held with their parameters stacked once at build, run by `lax.scan`.

`StackedLayers` takes built layers of one structure (bound plans included: in a layer stack
that holds for consecutive layers between the stack entry and the terminal layer that declare
the same stages) and keeps one of them whose every variable carries a leading layer axis. Each
call scans that layer over the stacked variables: the program holds the layer's body once (one
while loop per run) however many layers the run has. Inside the scan, every layer's ops run
under the named scope `layers_<start>_<stop>`; `boundary_jax.report.parse_hlo` counts a
collective there once per layer of the run. (A first layer that changes the carry's form runs
before the scan, from its slice, under `layer_<start>`.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx


def _stacked_variable(*variables: nnx.Variable) -> nnx.Variable:
    """One variable whose value stacks `variables`' values on a new leading axis; a sharding
    in its metadata gains a leading None (every rank holds every layer of its shard)."""
    first = variables[0]
    value = jnp.stack([v.get_value() for v in variables])
    sharding = first.get_metadata().get("out_sharding")
    if sharding is None:
        return first.replace(value=value)
    return first.replace(value=value, out_sharding=(None, *sharding))


@runtime_checkable
class LayerStacked(Protocol):
    """Per-layer state of a scanned run that is not sliced along a leading layer axis: each
    layer gets a view of it (`layer`) and hands back its updated view (`written`). A paged KV
    cache is one: every layer's pool lives in one flat pool that each layer's view reads and
    writes in place through offset page ids, where slicing a layer's pool out of a stacked one
    would copy it (a kernel needs its operand as a buffer of its own)."""

    def layer(self, index: jax.Array | int) -> Any:
        """Layer `index`'s view."""

    def written(self, index: jax.Array | int, view: Any) -> Any:
        """The state with layer `index`'s updated `view` in place."""


def _is_stacked(value: Any) -> bool:
    return isinstance(value, LayerStacked)


def layer_slice(per_layer: Any, index: jax.Array | int) -> Any:
    """Layer `index`'s part of `per_layer`: its slice of each leaf along the leading layer axis,
    and its view of each `LayerStacked` entry."""

    def take(value):
        if _is_stacked(value):
            return value.layer(index)
        return jax.lax.dynamic_index_in_dim(value, index, 0, False)

    return jax.tree.map(take, per_layer, is_leaf=_is_stacked)


def run_scope(start: int, stop: int) -> str:
    """The named scope the layers [start, stop) of a scanned run are traced in."""
    return f"layers_{start}_{stop}"


class StackedLayers(nnx.Module):
    """Layers [start, stop) of a model, of one structure, as one layer with stacked variables.

    Attributes:
      layer: The run's layer: its graph (plans, static options) is every layer's, and each of
        its variables holds all the run's values on a leading axis (parameter paths are
        `...layer.<path in the layer>`; `out_sharding` has a leading None).
      start: The index of the run's first layer in the model.
      stop: One past the index of the run's last layer.
    """

    def __init__(self, layers: Sequence[nnx.Module], *, start: int):
        """Stacks `layers` (built, consecutive, starting at model layer `start`).

        Raises:
          ValueError: No layers, or layers that differ in structure (for example the stack
            entry or terminal layer, or a sparse FFN beside a dense one).
        """
        if not layers:
            raise ValueError("a stacked run needs at least one layer")
        graphdefs, states = zip(*(nnx.split(layer) for layer in layers), strict=True)
        for offset, graphdef in enumerate(graphdefs[1:], start=1):
            if graphdef != graphdefs[0]:
                raise ValueError(
                    f"StackedLayers needs layers of one structure; layer {start + offset} "
                    f"differs from layer {start} (stack only layers between the stack entry and "
                    "the terminal layer that declare the same stages)"
                )
        stacked = jax.tree.map(
            _stacked_variable, *states, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        self.layer = nnx.merge(graphdefs[0], stacked)
        self.start = start
        self.stop = start + len(layers)

    @property
    def indices(self) -> range:
        """The model layer indices of the run."""
        return range(self.start, self.stop)

    def __len__(self) -> int:
        return self.stop - self.start

    def scan(
        self,
        call: Callable[[nnx.Module, Any, Any], tuple[Any, Any]],
        carry: Any,
        per_layer: Any = None,
        *,
        in_place: bool = False,
        remat: bool = False,
        policy: Callable | None = None,
    ) -> tuple[Any, Any]:
        """Runs `carry, out = call(layer, carry, per_layer[i])` for each layer i of the run, as
        one `lax.scan` over the stacked variables.

        Args:
          call: One layer's step; `layer` is the run's layer with one layer's variables.
          carry: What flows from layer to layer, e.g. `(output, stream)`; an `OwedOutput` has
            no leaves, so it scans as static structure.
          per_layer: A pytree whose leaves have a leading axis of the run's length (e.g. the
            run's stacked KV caches), sliced per layer; with `in_place` also `LayerStacked`
            entries, viewed per layer; None for none.
          in_place: `out` is layer i's `per_layer[i]` updated (a KV cache): the stacked
            `per_layer` rides in the loop's carry and each layer writes its slice back in place,
            instead of the scan stacking a fresh copy of all of it.
          remat: Run each layer under `jax.checkpoint` (its backward recomputes the layer).
          policy: The `jax.checkpoint` policy with `remat` (None: save nothing).

        Returns:
          (the final carry, every layer's `out` stacked on a leading axis).

        A first layer whose carry out differs in structure from its carry in (it takes what
        the layer before the run hands on differently, e.g. a finalize a sparse FFN deferred)
        runs unscanned from its slice, under `layer_<start>`; the rest scan.
        """
        graphdef, state = nnx.split(self.layer)

        def body(carry, sliced):
            state, xs = sliced
            return call(nnx.merge(graphdef, state), carry, xs)

        if remat:
            body = jax.checkpoint(body, policy=policy)
        stacked = (state, per_layer)
        first = (jax.tree.map(lambda leaf: leaf[0], state), layer_slice(per_layer, 0))
        scanned_from = 0 if _same_type(carry, jax.eval_shape(body, carry, first)[0]) else 1
        if in_place:
            return self._scan_in_place(body, carry, state, per_layer, scanned_from)
        if scanned_from == 0:
            with jax.named_scope(run_scope(self.start, self.stop)):
                return jax.lax.scan(body, carry, stacked)
        with jax.named_scope(f"layer_{self.start}"):
            carry, out = body(carry, first)
        if len(self) == 1:
            return carry, jax.tree.map(lambda leaf: leaf[None], out)
        with jax.named_scope(run_scope(self.start + 1, self.stop)):
            carry, outs = jax.lax.scan(body, carry, jax.tree.map(lambda leaf: leaf[1:], stacked))
        return carry, jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), out, outs)

    def _scan_in_place(self, body, carry, state, updated, scanned_from: int):
        """`scan` with `in_place`: layer i reads and writes back slice i of `updated`."""

        def step(carry, updated, state, index):
            carry, out = body(carry, (state, layer_slice(updated, index)))

            def write(value, written):
                if _is_stacked(value):
                    return value.written(index, written)
                return jax.lax.dynamic_update_index_in_dim(value, written, index, 0)

            return carry, jax.tree.map(write, updated, out, is_leaf=_is_stacked)

        if scanned_from:
            with jax.named_scope(f"layer_{self.start}"):
                first = jax.tree.map(lambda leaf: leaf[0], state)
                carry, updated = step(carry, updated, first, 0)
            state = jax.tree.map(lambda leaf: leaf[1:], state)
        if len(self) > scanned_from:

            def scanned(both, sliced):
                return step(*both, *sliced), None

            indices = jnp.arange(scanned_from, len(self), dtype=jnp.int32)
            with jax.named_scope(run_scope(self.start + scanned_from, self.stop)):
                (carry, updated), _ = jax.lax.scan(scanned, (carry, updated), (state, indices))
        return carry, updated


def _same_type(carry: Any, shapes: Any) -> bool:
    """Whether `shapes` (`eval_shape` of a carry out) has `carry`'s structure, shapes, dtypes."""
    if jax.tree.structure(carry) != jax.tree.structure(shapes):
        return False
    return all(
        jnp.shape(a) == b.shape and jnp.result_type(a) == b.dtype
        for a, b in zip(jax.tree.leaves(carry), jax.tree.leaves(shapes), strict=True)
    )
