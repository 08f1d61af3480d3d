"""Making a decoder: with random weights drawn straight into their shards, or loaded from a
Hugging Face checkpoint with each device reading only its shards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import boundary_jax as bj

from .checkpoints import load_config, load_params
from .checkpoints.fp8 import stored_fp8
from .config import DecoderConfig
from .families import CausalLM, MoeCausalLM, Remat, model_class
from .layers.attention import AttentionImpl
from .layers.fp8_linear import Fp8Quantization
from .layers.hyper_connections import HyperConnections


def _platform(mesh: Mesh | None) -> str:
    return jax.default_backend() if mesh is None else mesh.devices.flat[0].platform


def _construct(
    config: DecoderConfig,
    topology: bj.Topology,
    moe_dispatch: bj.MoeDispatch | None,
    **options,
) -> CausalLM:
    cls = model_class(config)
    if issubclass(cls, MoeCausalLM):
        return cls(config, topology, moe_dispatch=moe_dispatch or bj.MoeDispatch.GATHER, **options)
    if moe_dispatch is not None or topology.moe_ep != 1:
        raise ValueError(
            f"{config.architecture.value} has no experts; got {moe_dispatch=} and "
            f"moe_ep={topology.moe_ep}. Leave the MoE options unset"
        )
    return cls(config, topology, **options)


def build_model(
    config: DecoderConfig,
    topology: bj.Topology,
    *,
    reduction: bj.ReductionPolicy = bj.ReductionPolicy.AUTO,
    fusions: bj.fusions.FusionProvider = bj.fusions.NO_FUSIONS,
    moe_dispatch: bj.MoeDispatch | None = None,
    dtype: jnp.dtype = jnp.float32,
    seed: int = 0,
    attention: AttentionImpl | None = None,
    mesh: Mesh | None = None,
    remat: Remat = Remat.NONE,
    hyper_connections: HyperConnections | None = None,
    scan_layers: bool = False,
    quantization: Fp8Quantization | None = None,
) -> CausalLM:
    """A model of `config` with random weights (every shard different).

    Args:
      fusions: The stack's fusion provider (default: none, the built-in path).
      moe_dispatch: For an MoE config, the sparse layers' dispatch (None:
        `MoeDispatch.GATHER`); `topology.moe_ep` gives their expert parallelism. A dense config
        takes neither.
      attention: The attention kernel; None picks `AttentionImpl.for_platform` of `mesh` (or
        of the default backend).
      mesh: None builds every weight whole on the default device; a mesh builds the model
        abstractly and creates each weight straight into its shards (no unsharded copy), at
        the cost of compiling the initializer (seconds; worth it for large models). The
        values are the same either way.
      remat: What each layer keeps for the backward pass (training).
      hyper_connections: Build every boundary with MHC hyper-connections (random MHC weights);
        None: the plain pre-norm add + RMSNorm.
      scan_layers: Stack the parameters of each run of identical layers between the stack
        entry and the terminal layer once, here, and run the run as one `lax.scan`
        (`DecoderConfig.layer_blocks`); the values are those of the unscanned model.
      quantization: FP8 projection weights (random blocks quantized as drawn) and FP8 inputs
        into them; None: every weight in `dtype`.
    """
    if attention is None:
        attention = AttentionImpl.for_platform(_platform(mesh))

    def make() -> CausalLM:
        return _construct(
            config,
            topology,
            moe_dispatch,
            reduction=reduction,
            fusions=fusions,
            dtype=dtype,
            attention=attention,
            remat=remat,
            hyper_connections=hyper_connections,
            scan_layers=scan_layers,
            quantization=quantization,
            rngs=nnx.Rngs(seed),
        )

    if mesh is None:
        return make()
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
    shardings = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), nnx.get_partition_spec(abstract_state)
    )
    return nnx.merge(graphdef, _initialize_in_parts(make, abstract_state, shardings))


LAYERS_PER_INIT_PART = 4
"""Layers whose weights one compiled initializer creates (`build_model` with a mesh)."""


def _initialize_in_parts(make: Callable[[], nnx.Module], abstract_state, shardings):
    """The state `make()` builds, created straight into `shardings` by one jitted initializer
    per `LAYERS_PER_INIT_PART` layers (a scanned run's stack goes with its first layer) and
    one for the rest. Each traces the whole `make` and keeps its part; XLA drops the other
    parts' random draws. One initializer for the whole model compiles in time that grows
    faster than its size on GPU (RESULTS run 15: 11 s at 8 layers, 60 s at 16, minutes at 32):
    XLA merges every layer's draws into the same few kernels."""
    paths = [path for path, _ in nnx.to_flat_state(abstract_state)]
    placement = dict(nnx.to_flat_state(shardings))
    parts: dict[tuple, list[tuple]] = {}
    for path in paths:
        part = ("layers", path[1] // LAYERS_PER_INIT_PART) if path[0] == "layers" else ()
        parts.setdefault(part, []).append(path)
    created = {}
    for members in parts.values():

        def initialize(members=members):
            made = dict(nnx.to_flat_state(nnx.split(make())[1]))
            return [made[path] for path in members]

        values = jax.jit(initialize, out_shardings=[placement[p] for p in members])()
        created.update(zip(members, values, strict=True))
    return nnx.from_flat_state([(path, created[path]) for path in paths])


def load_model(
    checkpoint_dir: str | Path,
    mesh: Mesh,
    *,
    reduction: bj.ReductionPolicy = bj.ReductionPolicy.AUTO,
    fusions: bj.fusions.FusionProvider = bj.fusions.NO_FUSIONS,
    moe_ep: int = 1,
    moe_dispatch: bj.MoeDispatch | None = None,
    dtype: jnp.dtype = jnp.float32,
    attention: AttentionImpl | None = None,
    remat: Remat = Remat.NONE,
    scan_layers: bool = False,
    quantization: Fp8Quantization | None = None,
) -> CausalLM:
    """A model loaded from a Hugging Face checkpoint directory, each device reading its shard.

    The model is built abstractly (no weights allocated), then every parameter is read straight
    into its sharded global array (stacked experts: each device reads only its experts). MoE
    checkpoints take `moe_ep` (expert-parallel size, dividing the mesh's full TP group) and
    `moe_dispatch` (None: `MoeDispatch.GATHER`). `attention` None picks
    `AttentionImpl.for_platform`; `remat` says what each layer keeps for a backward pass.
    With `scan_layers` (see `build_model`) a stacked parameter is read layer by layer, each
    device still reading only its shard of each layer's tensor.

    A fine-grained FP8 checkpoint (`quantization_config` with `quant_method: fp8`) loads as an
    FP8 model (`quantization` None: `Fp8Quantization.for_platform`); `quantization` given
    quantizes any other checkpoint on load, each device its own blocks (`checkpoints.fp8`).
    """
    config = load_config(checkpoint_dir)
    platform = _platform(mesh)
    if quantization is None and stored_fp8(checkpoint_dir):
        quantization = Fp8Quantization.for_platform(platform)
    topology = bj.Topology.from_mesh(mesh, moe_ep=moe_ep)
    if attention is None:
        attention = AttentionImpl.for_platform(platform)
    abstract = nnx.eval_shape(
        lambda: _construct(
            config,
            topology,
            moe_dispatch,
            reduction=reduction,
            fusions=fusions,
            dtype=dtype,
            attention=attention,
            remat=remat,
            scan_layers=scan_layers,
            quantization=quantization,
            rngs=nnx.Rngs(0),
        )
    )
    graphdef, abstract_state = nnx.split(abstract)
    params = load_params(
        checkpoint_dir,
        abstract_state,
        mesh,
        np.dtype(dtype),
        scan_layers=scan_layers,
        quantization=quantization,
    )
    return nnx.merge(graphdef, params)
