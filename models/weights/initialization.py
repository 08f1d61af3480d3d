"""A decoder's random parameters, drawn from its abstract state.

Every parameter carries its initializer (`boundary_jax.initializers`), so `nnx.eval_shape` of a
model gives all it takes to make the parameters: shape, dtype, sharding and initializer per leaf.
Each is drawn at its global shape from its own key, the seed folded with a hash of its path in
the unscanned model: a seed gives the same values on every mesh, without one, scanned or not.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from boundary_jax.initializers import Initializer, initializer_of

from ..config import LayerBlock

Unit = tuple[tuple[int, ...], np.dtype, Initializer]
"""What one key draws: (shape, dtype, initializer)."""


@dataclasses.dataclass(frozen=True)
class ParamDraw:
    """How one parameter of a model is drawn: hashable, so models of one structure share their
    compiled initializer.

    Attributes:
      keys: The dotted paths, in the unscanned model, whose hashes key the draw: one, or with
        `stacked` one per layer of a scanned run.
      shape: The parameter's global shape (with the run's layer axis first, when stacked).
      dtype: Its dtype.
      initializer: What the values are drawn from (`boundary_jax.initializers.initializer_of`).
      spec: The parameter's `PartitionSpec` (its `out_sharding`).
      stacked: The parameter stacks a scanned run's layers, each drawn as in the unscanned
        model.
    """

    keys: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    initializer: Initializer
    spec: PartitionSpec
    stacked: bool

    @property
    def unit(self) -> Unit:
        """What each key draws: the parameter, or a layer's slice of it when stacked."""
        return self.shape[1:] if self.stacked else self.shape, self.dtype, self.initializer

    @property
    def unit_spec(self) -> PartitionSpec:
        """The sharding of what each key draws."""
        return PartitionSpec(*self.spec[1:]) if self.stacked else self.spec


def path_hash(path: str) -> int:
    """A stable 32-bit hash of a dotted parameter path (Python's `hash` of a str is salted)."""
    return zlib.crc32(path.encode())


def param_draws(abstract_state: nnx.State, blocks: Sequence[LayerBlock]) -> tuple[ParamDraw, ...]:
    """How each leaf of a decoder's (abstract) state is drawn, in `nnx.to_flat_state` order.

    A leaf under `layers.{b}` is keyed by its path in the unscanned model, where block b of
    `blocks` (`DecoderConfig.layer_blocks`) is model layer `blocks[b].layers.start`; a leaf of
    a scanned run (`layers.{b}.layer.<path>`) stacks one draw per layer of the run.

    Raises:
      TypeError: A leaf made without an initializer (`boundary_jax.initializers.param`).
      ValueError: Two paths hash alike (rename one).
    """
    specs = dict(nnx.to_flat_state(nnx.get_partition_spec(abstract_state)))
    draws = []
    for path, variable in nnx.to_flat_state(abstract_state):
        scanned = False
        keys = (_dotted(path),)
        if path[0] == "layers":
            layers, scanned = blocks[path[1]]
            rest = path[3:] if scanned else path[2:]
            keys = tuple(_dotted(("layers", i, *rest)) for i in layers)
        draws.append(
            ParamDraw(
                keys,
                tuple(variable.shape),
                np.dtype(variable.dtype),
                initializer_of(variable),
                specs[path].get_value(),
                scanned,
            )
        )
    hashes: dict[int, str] = {}
    for key in (key for draw in draws for key in draw.keys):
        seen = hashes.setdefault(path_hash(key), key)
        if seen != key:
            raise ValueError(f"parameter paths {seen!r} and {key!r} hash alike; rename one")
    return tuple(draws)


def initialize_params(
    abstract_state: nnx.State,
    blocks: Sequence[LayerBlock],
    *,
    seed: int,
    mesh: Mesh | None = None,
) -> nnx.State:
    """The values of a decoder's abstract state (see the module docstring), drawn by
    `param_draws`.

    With a mesh, one jitted initializer creates every value straight into the shards its
    `out_sharding` names (no unsharded copy; `sharded_initializer`). Without, each value is
    drawn on the default device by a compiled draw per parameter shape, which every model
    shares. Both give the same values (up to float rounding of the normal's scaling).
    """
    draws = param_draws(abstract_state, blocks)
    seed_key = jax.random.key(seed)
    if mesh is None:
        values = [_draw_one_by_one(seed_key, draw) for draw in draws]
    else:
        values = sharded_initializer(draws, mesh)(seed_key)
    flat = nnx.to_flat_state(abstract_state)
    return nnx.from_flat_state(
        [
            (path, variable.replace(value=value))
            for (path, variable), value in zip(flat, values, strict=True)
        ]
    )


MAX_BATCH_BYTES = 1 << 30
"""The most bytes (at the global shape) one batched draw makes. A larger unit is drawn in
batches of fewer layers, so the initializer's peak stays near the model's size: GPT-OSS-20B's 24
expert gate|up units (1 GiB each) drawn as one batch, held whole beside the parameters cut from
it, made a 66.6 GiB program for 39 GiB of weights, more than an 80 GB H100 gives JAX."""


@functools.cache
def sharded_initializer(
    draws: tuple[ParamDraw, ...], mesh: Mesh, max_batch_bytes: int = MAX_BATCH_BYTES
) -> Callable[[jax.Array], list[jax.Array]]:
    """The jitted initializer of `draws` on `mesh`: seed key -> every parameter, in its shards.

    The draws of one unit and sharding (the same projection of every layer) are made as one
    batched draw of at most `max_batch_bytes` (more batches where the layers' units exceed it),
    so the program holds a few random-number computations per unit however many layers the
    model has. Each batch is kept whole (an optimization barrier) before the parameters are cut
    from it: XLA could otherwise fuse the draw into every parameter's copy and merge those
    copies across layers into a few kernels whose compile time grows faster than the layer
    count (benchmarks/RESULTS.md run 15). The same barrier holds the next batch's keys, so the
    batches run one after another and their temporaries never meet.
    """
    grouped: dict[tuple[Unit, PartitionSpec], list[list[tuple[int, str]]]] = {}
    for index, draw in enumerate(draws):
        shape, dtype, _ = draw.unit
        per_batch = max(1, max_batch_bytes // (int(np.prod(shape)) * np.dtype(dtype).itemsize))
        groups = grouped.setdefault((draw.unit, draw.unit_spec), [[]])
        for key in draw.keys:
            if len(groups[-1]) == per_batch:
                groups.append([])
            groups[-1].append((index, key))
    batches = [(unit, members) for unit, groups in grouped.items() for members in groups]
    hashes = np.array([path_hash(key) for _, members in batches for _, key in members], np.uint32)

    def initialize(seed: jax.Array) -> list[jax.Array]:
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(seed, hashes)
        values: list[list[jax.Array]] = [[] for _ in draws]
        start = 0
        for (unit, spec), members in batches:
            unit_keys = keys[start : start + len(members)]
            start += len(members)
            batch = jax.vmap(functools.partial(_draw, unit))(unit_keys)
            batch = _laid_out(batch, NamedSharding(mesh, PartitionSpec(None, *spec)))
            batch, keys = jax.lax.optimization_barrier((batch, keys))
            for position, (index, _) in enumerate(members):
                values[index].append(batch[position])
        return [
            jnp.stack(value) if draw.stacked else value[0]
            for draw, value in zip(draws, values, strict=True)
        ]

    shardings = [NamedSharding(mesh, draw.spec) for draw in draws]
    return jax.jit(initialize, out_shardings=shardings)


def _laid_out(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`value` split as `sharding` says: `reshard` on a mesh of explicit axes (as
    `boundary_jax.make_mesh` makes), a sharding constraint on automatic ones."""
    if all(kind is AxisType.Explicit for kind in sharding.mesh.axis_types):
        return jax.sharding.reshard(value, sharding)
    return jax.lax.with_sharding_constraint(value, sharding)


def _draw(unit: Unit, key: jax.Array) -> jax.Array:
    shape, dtype, initializer = unit
    return initializer(key, shape, dtype)


@functools.cache
def _compiled_draw(unit: Unit) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """seed key, path hash -> the unit drawn from the seed folded with the hash."""

    def draw(seed: jax.Array, hash: jax.Array) -> jax.Array:
        return _draw(unit, jax.random.fold_in(seed, hash))

    return jax.jit(draw)


def _draw_one_by_one(seed: jax.Array, draw: ParamDraw) -> jax.Array:
    """A parameter on the default device, one compiled draw per key (compiled per unit)."""
    values = [_compiled_draw(draw.unit)(seed, jnp.uint32(path_hash(key))) for key in draw.keys]
    return jnp.stack(values) if draw.stacked else values[0]


def _dotted(path: tuple) -> str:
    return ".".join(str(part) for part in path)
