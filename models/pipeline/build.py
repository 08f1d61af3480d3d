"""Making a pipeline-parallel decoder: one `CausalLM` per stage, each holding its share of the
layers on its own device group, with random weights equal to the one-program model's or loaded
from a Hugging Face checkpoint.

A process builds (and reads the checkpoint for) only the stages whose devices it holds; the
other stages are abstract models (shapes only), whose bound plans still describe the pipeline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import boundary_jax as bj

from ..build import abstract_model, mesh_platform
from ..config import DecoderConfig, LayerBlock
from ..decoder.model import CausalLM
from ..options import BuildOptions
from ..weights import load_config, load_params
from ..weights.initialization import initialize_params
from ..weights.peft import is_lora_path, lora_spec, read_adapters, stacked_adapters
from .split import PipelineSplit
from .transport import holds, stage_meshes


def pipeline_split(
    config: DecoderConfig, topology: bj.Topology, split: PipelineSplit | None
) -> PipelineSplit:
    """`split`, checked against the model and the mesh; None: the balanced split (the earlier
    stages hold the extra layers when `pp` does not divide them).

    Raises:
      ValueError: The split does not cover the model's layers or has another number of stages
        than the mesh's `pp` axis.
    """
    if split is None:
        return PipelineSplit.balanced(config.num_layers, topology.pp)
    if split.num_layers != config.num_layers or split.pp != topology.pp:
        raise ValueError(
            f"the pipeline split {list(split.sizes)} must have pp={topology.pp} stages covering "
            f"the model's {config.num_layers} layers"
        )
    return split


def _stage_topology(topology: bj.Topology) -> bj.Topology:
    """A stage's topology: its mesh is the pipeline mesh's devices at one `pp` index."""
    return dataclasses.replace(topology, pp=1)


def _stage_path(layers: range):
    """Where a stage's parameter path lives in the whole model."""

    def source(path: tuple) -> tuple:
        if path[0] != "layers":
            return path
        return ("layers", path[1] + layers.start, *path[2:])

    return source


def build_pipeline(
    config: DecoderConfig,
    topology: bj.Topology,
    mesh: Mesh,
    options: BuildOptions = BuildOptions(),
    *,
    split: PipelineSplit | None = None,
    seed: int = 0,
    weights: CausalLM | None = None,
) -> tuple[CausalLM, ...]:
    """One model per pipeline stage, with random weights equal to those `build_model(config,
    ...)` draws for the same layers (the same seed, the stage's attention DP x TP).

    Each stage's weights are created straight into their shards on the stage's devices (see
    `models.build.build_model(mesh=...)`), or taken from `weights`; a stage whose devices this
    process does not hold is returned abstract (`jax.ShapeDtypeStruct` leaves).

    Args:
      config: The architecture.
      topology: The parallel topology; `pp` is the number of stages.
      mesh: The pipeline mesh (`boundary_jax.make_mesh(topology)`): stage s runs on its
        devices at `pp` index s.
      options: As `build_model`'s; stages run their layers unrolled (no `scan_layers`).
      split: The layers of each stage (None: the balanced split, `PipelineSplit.balanced`).
      seed: The random seed.
      weights: A whole model of the same config and options (e.g. `build_model` without a
        mesh) whose weights the stages take, placed on their devices, instead of drawing them:
        no initializer is compiled, but the whole model is in memory first.

    Raises:
      ValueError: The split does not fit the model or the mesh, or `weights` lacks a stage's
        parameter or holds it in another shape.
      NotImplementedError: `options.scan_layers`.
    """
    split = pipeline_split(config, _mesh_topology(mesh, topology), split)
    options = _stage_options(options, mesh)
    stage_topology = _stage_topology(topology)
    whole_state = None if weights is None else dict(nnx.to_flat_state(nnx.state(weights)))
    stages = []
    for layers, stage_mesh in zip(split.stages, stage_meshes(mesh), strict=True):
        abstract_stage = abstract_model(config, stage_topology, options, layer_range=layers)
        graphdef, abstract = nnx.split(abstract_stage)
        if holds(stage_mesh):
            shardings = jax.tree.map(
                lambda spec, m=stage_mesh: NamedSharding(m, spec),
                nnx.get_partition_spec(abstract),
            )
            if whole_state is None:
                blocks = [LayerBlock(range(layer, layer + 1), False) for layer in layers]
                abstract = initialize_params(abstract, blocks, seed=seed, mesh=stage_mesh)
            else:
                abstract = _take(whole_state, abstract, shardings, _stage_path(layers))
        stages.append(nnx.merge(graphdef, abstract))
    return tuple(stages)


def _take(whole: dict, abstract: nnx.State, shardings, source) -> nnx.State:
    """`abstract` filled from a whole model's flat state, each value placed on its sharding."""
    placement = dict(nnx.to_flat_state(shardings))
    taken = []
    for path, variable in nnx.to_flat_state(abstract):
        value = whole.get(source(path))
        if value is None or value.shape != variable.shape:
            raise ValueError(
                f"the stage parameter {path} (model path {source(path)}, shape "
                f"{variable.shape}) is not in the whole model's weights in that shape; build "
                "`weights` from the same config and options"
            )
        taken.append(
            (path, variable.replace(value=jax.device_put(value[...], placement[path].get_value())))
        )
    return nnx.from_flat_state(taken)


def load_pipeline(
    checkpoint_dir: str | Path,
    mesh: Mesh,
    options: BuildOptions = BuildOptions(),
    *,
    split: PipelineSplit | None = None,
    moe_ep: int = 1,
    adapters: Mapping[str, str | Path] | None = None,
) -> tuple[CausalLM, ...]:
    """One model per pipeline stage loaded from a Hugging Face checkpoint directory: each
    process reads only the blocks of its own devices (of the stages it holds); the other stages
    are returned abstract. Arguments as `load_model` (LoRA `adapters` included: each stage
    holds its layers' share of every adapter) and `build_pipeline`."""
    config = load_config(checkpoint_dir)
    topology = bj.Topology.from_mesh(mesh, moe_ep=moe_ep)
    split = pipeline_split(config, topology, split)
    options = _stage_options(options, mesh)
    peft = None
    if adapters:
        peft = read_adapters(adapters, config)
        options = options.replace(lora=lora_spec(peft))
    stages = []
    for layers, stage_mesh in zip(split.stages, stage_meshes(mesh), strict=True):
        abstract = abstract_model(config, _stage_topology(topology), options, layer_range=layers)
        graphdef, lora_state, state = nnx.split(abstract, is_lora_path, ...)
        if holds(stage_mesh):
            dtype = np.dtype(options.dtype)
            state = load_params(checkpoint_dir, state, stage_mesh, dtype, layers=layers)
            if peft is not None:
                lora_state = stacked_adapters(peft, lora_state, stage_mesh, dtype, layers=layers)
        stages.append(nnx.merge(graphdef, lora_state, state))
    return tuple(stages)


def _stage_options(options: BuildOptions, mesh: Mesh) -> BuildOptions:
    """`options` for pipeline stages on `mesh`, checked."""
    if options.scan_layers:
        raise NotImplementedError(
            "pipeline stages run their layers unrolled; build them without scan_layers"
        )
    return options.for_platform(mesh_platform(mesh))


def _mesh_topology(mesh: Mesh, topology: bj.Topology) -> bj.Topology:
    mesh_topology = bj.Topology.from_mesh(mesh, moe_ep=topology.moe_ep)
    if mesh_topology != topology:
        raise ValueError(f"the topology is {topology} but the mesh is {mesh_topology}")
    return topology
