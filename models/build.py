"""Making a decoder: with random weights drawn straight into their shards, or loaded from a
Hugging Face checkpoint with each device reading only its shards. Both take one `BuildOptions`;
the config's registered family builds the model and refuses what it does not compute."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import boundary_jax as bj

from .config import DecoderConfig, family_of
from .decoder.model import CausalLM
from .layers.fp8_linear import Fp8Quantization
from .options import BuildOptions
from .weights import load_config, load_params
from .weights.fp8 import stored_fp8
from .weights.initialization import initialize_params
from .weights.peft import is_lora_path, lora_spec, read_adapters, stacked_adapters

_LOG = logging.getLogger(__name__)


def mesh_platform(mesh: Mesh | None) -> str:
    """The platform a model built for `mesh` runs on (the default backend without one)."""
    return jax.default_backend() if mesh is None else mesh.devices.flat[0].platform


def abstract_model(
    config: DecoderConfig,
    topology: bj.Topology,
    options: BuildOptions,
    *,
    layer_range: range | None = None,
) -> CausalLM:
    """The model of `config` as its family builds it, abstract (`nnx.eval_shape`: shapes and
    shardings, no weights allocated), for an initializer or a checkpoint to fill.

    Raises:
      NotImplementedError, ValueError: The family refuses an option or the mesh
        (`CausalLM.check_build`).
    """
    family = family_of(config)
    return nnx.eval_shape(
        lambda: family(config, topology, options, layer_range=layer_range, rngs=nnx.Rngs(0))
    )


def build_model(
    config: DecoderConfig,
    topology: bj.Topology,
    options: BuildOptions = BuildOptions(),
    *,
    seed: int = 0,
    mesh: Mesh | None = None,
) -> CausalLM:
    """A model of `config` with random weights, drawn as the family initializes them (Hugging
    Face: normal(0, `config.initializer_range`) projections, embeddings and experts; norms ones,
    `1 + w` norms zeros).

    The model is built abstractly, then every parameter is drawn from its own key (the seed
    folded with a hash of the parameter's path; `models.weights.initialization`) at its global
    shape, on a mesh by one jitted initializer straight into its shards: a seed gives the same
    values on every mesh and without one, scanned or not.

    Args:
      config: The architecture.
      topology: The parallel topology (`topology.moe_ep` gives a MoE's expert parallelism).
      options: How the model is built (the attention kernel, where None, is the fastest for
        `mesh`'s platform).
      seed: The random seed.
      mesh: None builds every weight whole on the default device; a mesh creates each weight
        straight into its shards (no unsharded copy), at the cost of compiling the
        initializer (seconds). The values are the same either way.
    """
    options = options.for_platform(mesh_platform(mesh))
    graphdef, abstract_state = nnx.split(abstract_model(config, topology, options))
    blocks = config.layer_blocks(options.scan_layers)
    return nnx.merge(graphdef, initialize_params(abstract_state, blocks, seed=seed, mesh=mesh))


def load_model(
    checkpoint_dir: str | Path,
    mesh: Mesh,
    options: BuildOptions = BuildOptions(),
    *,
    moe_ep: int = 1,
    adapters: Mapping[str, str | Path] | None = None,
) -> CausalLM:
    """A model loaded from a Hugging Face checkpoint directory, each device reading its shard.

    The model is built abstractly (no weights allocated), then every parameter is read straight
    into its sharded global array (stacked experts: each device reads only its experts). MoE
    checkpoints take `moe_ep` (the expert-parallel size, dividing the mesh's full TP group).
    With `options.scan_layers` a stacked parameter is read layer by layer, each device still
    reading only its shard of each layer's tensor.

    A fine-grained FP8 checkpoint (`quantization_config` with `quant_method: fp8`) loads as an
    FP8 model (`options.quantization` None: `Fp8Quantization.for_platform`), or, for a family
    that builds no FP8 projections, dequantized to `options.dtype`; a quantization given
    quantizes any other checkpoint on load, each device its own blocks (`weights.fp8`).

    `adapters` (`{name: PEFT LoRA folder}`) are served over the base model: the model is built
    with their stacks (`BuildOptions.lora`; a batch picks each sequence's adapter by name or
    index, `LoraSpec.index`), and each device holds only its shard of each adapter. Without
    `adapters`, stacks that `options.lora` asks for (to train) are drawn at random.
    """
    config = load_config(checkpoint_dir)
    platform = mesh_platform(mesh)
    options = options.for_platform(platform)
    peft = None
    if adapters:
        peft = read_adapters(adapters, config)
        options = options.replace(lora=lora_spec(peft))
    topology = bj.Topology.from_mesh(mesh, moe_ep=moe_ep)
    fp8 = options.quantization is None and stored_fp8(checkpoint_dir)
    if fp8 and family_of(config).quantizable:
        model, options = _stored_fp8_model(config, topology, options, platform, checkpoint_dir)
    else:
        model = abstract_model(config, topology, options)
    graphdef, lora_state, abstract_state = nnx.split(model, is_lora_path, ...)
    params = load_params(
        checkpoint_dir,
        abstract_state,
        mesh,
        np.dtype(options.dtype),
        scan_layers=options.scan_layers,
        quantization=options.quantization,
    )
    if peft is None and options.lora is not None:
        # Stacks to train over the checkpoint: drawn as `build_model` draws them.
        blocks = config.layer_blocks(options.scan_layers)
        return nnx.merge(graphdef, initialize_params(lora_state, blocks, seed=0, mesh=mesh), params)
    if peft is None:
        return nnx.merge(graphdef, lora_state, params)
    stacks = stacked_adapters(
        peft, lora_state, mesh, np.dtype(options.dtype), layers=range(config.num_layers)
    )
    return nnx.merge(graphdef, stacks, params)


def _stored_fp8_model(
    config: DecoderConfig,
    topology: bj.Topology,
    options: BuildOptions,
    platform: str,
    checkpoint_dir: str | Path,
) -> tuple[CausalLM, BuildOptions]:
    """The abstract model of a fine-grained FP8 checkpoint and the options that built it: with
    FP8 projections where the family builds them at the checkpoint's sizes; otherwise (shared
    experts, a residual design or projection FP8 layers do not take, widths that are no multiple
    of 128) without, its weights then dequantized on load, with a warning. A mesh that splits
    the FP8 blocks stays refused, as for `--quantize fp8`: fewer ranks fix it."""
    quantized = options.replace(quantization=Fp8Quantization.for_platform(platform))
    try:
        return abstract_model(config, topology, quantized), quantized
    except (NotImplementedError, ValueError) as error:
        try:
            abstract_model(config, bj.Topology(), quantized)
        except (NotImplementedError, ValueError):
            reason = str(error)
        else:
            raise
    model = abstract_model(config, topology, options)
    _LOG.warning(
        "%s: its FP8 weights load dequantized to %s: no mesh builds FP8 layers for it, even "
        "one device (%s)",
        checkpoint_dir,
        np.dtype(options.dtype).name,
        reason,
    )
    return model, options
