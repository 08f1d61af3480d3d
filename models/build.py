"""Making a decoder: with random weights drawn straight into their shards, or loaded from a
Hugging Face checkpoint with each device reading only its shards."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import boundary_jax as bj

from .config import DecoderConfig
from .families import CausalLM, DeepseekCausalLM, MoeCausalLM, Remat, model_class
from .layers.attention.context_parallel import CpAttentionMode
from .layers.attention.self_attention import AttentionImpl
from .layers.fp8_linear import Fp8Quantization
from .layers.hyper_connections import HyperConnections
from .weights import load_config, load_params
from .weights.fp8 import stored_fp8
from .weights.initialization import initialize_params


def mesh_platform(mesh: Mesh | None) -> str:
    """The platform a model built for `mesh` runs on (the default backend without one)."""
    return jax.default_backend() if mesh is None else mesh.devices.flat[0].platform


def construct_model(
    config: DecoderConfig,
    topology: bj.Topology,
    *,
    moe_dispatch: bj.MoeDispatch | None,
    reduction: bj.ReductionPolicy,
    fusions: bj.fusions.FusionProvider,
    dtype: jnp.dtype,
    attention: AttentionImpl,
    remat: Remat,
    hyper_connections: HyperConnections | None,
    scan_layers: bool,
    rngs: nnx.Rngs,
    dense_ffn_dp: bool = False,
    layer_range: range | None = None,
    quantization: Fp8Quantization | None = None,
    cp_attention: CpAttentionMode = CpAttentionMode.ALL_GATHER,
) -> CausalLM:
    cls = model_class(config)
    extra: dict = {}
    if topology.attn_cp > 1 and issubclass(cls, MoeCausalLM):
        raise NotImplementedError(
            f"context parallelism is built for dense decoders; {cls.__name__} has experts (or "
            f"SSM mixers) and is not supported under it yet; got attn_cp={topology.attn_cp}. "
            "Use a mesh with attn_cp=1"
        )
    if cp_attention is not CpAttentionMode.ALL_GATHER:
        if cls.__init__ is not CausalLM.__init__:
            raise NotImplementedError(
                f"{cls.__name__} takes no cp_attention option yet (only the plain dense "
                f"decoders do); got {cp_attention=}. Leave it at CpAttentionMode.ALL_GATHER"
            )
        extra["cp_attention"] = cp_attention
    if quantization is not None:
        if not cls.quantizable:
            raise NotImplementedError(
                f"FP8 quantization is built for the families whose projections take `linears` "
                f"(dense and Qwen-style MoE decoders); {cls.__name__} builds its layers "
                "otherwise. Build it without quantization"
            )
        extra["quantization"] = quantization
    if issubclass(cls, DeepseekCausalLM):
        extra["dense_ffn_dp"] = dense_ffn_dp
    elif dense_ffn_dp:
        raise ValueError(
            f"dense_ffn_dp (a fully data-parallel dense FFN) is a DeepSeek option; got a "
            f"{config.architecture.value} config. Leave it unset"
        )
    if layer_range is not None:
        extra["layer_range"] = layer_range
    if issubclass(cls, MoeCausalLM):
        extra["moe_dispatch"] = moe_dispatch or bj.MoeDispatch.GATHER
    elif moe_dispatch is not None or topology.moe_ep != 1:
        raise ValueError(
            f"{config.architecture.value} has no experts; got {moe_dispatch=} and "
            f"moe_ep={topology.moe_ep}. Leave the MoE options unset"
        )
    return cls(
        config,
        topology,
        reduction=reduction,
        fusions=fusions,
        dtype=dtype,
        attention=attention,
        remat=remat,
        hyper_connections=hyper_connections,
        scan_layers=scan_layers,
        rngs=rngs,
        **extra,
    )


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
    dense_ffn_dp: bool = False,
    quantization: Fp8Quantization | None = None,
    cp_attention: CpAttentionMode = CpAttentionMode.ALL_GATHER,
) -> CausalLM:
    """A model of `config` with random weights, drawn as the family initializes them (Hugging
    Face: normal(0, `config.initializer_range`) projections, embeddings and experts; norms ones,
    Gemma's `1 + w` norms zeros).

    The model is built abstractly, then every parameter is drawn from its own key (the seed
    folded with a hash of the parameter's path; `models.initialization`) at its global shape,
    on a mesh by one jitted initializer straight into its shards: a seed gives the same values
    on every mesh and without one, scanned or not.

    Args:
      fusions: The stack's fusion provider (default: none, the built-in path).
      moe_dispatch: For an MoE config, the sparse layers' dispatch (None:
        `MoeDispatch.GATHER`); `topology.moe_ep` gives their expert parallelism. A dense config
        takes neither.
      seed: The random seed.
      attention: The attention kernel; None picks `AttentionImpl.for_platform` of `mesh` (or
        of the default backend).
      mesh: None builds every weight whole on the default device; a mesh creates each weight
        straight into its shards (no unsharded copy), at the cost of compiling the
        initializer (seconds). The values are the same either way.
      remat: What each layer keeps for the backward pass (training).
      hyper_connections: Build every boundary with MHC hyper-connections (random MHC weights);
        None: the plain pre-norm add + RMSNorm.
      scan_layers: Stack the parameters of each run of identical layers between the stack
        entry and the terminal layer once, here, and run the run as one `lax.scan`
        (`DecoderConfig.layer_blocks`); the values are those of the unscanned model.
      dense_ffn_dp: DeepSeek: the dense layers' FFN fully data-parallel (whole weights on
        every rank, run on its own rows; `declare_ffn(dense_tp_size=1)`).
      quantization: FP8 projection weights (random blocks quantized as drawn) and FP8 inputs
        into them; None: every weight in `dtype`.
      cp_attention: How a prefill attends across attention-CP ranks, where `topology` has
        `attn_cp > 1` (all-gather of K/V or the ring; dense decoders only).
    """
    if attention is None:
        attention = AttentionImpl.for_platform(mesh_platform(mesh))
    abstract = nnx.eval_shape(
        lambda: construct_model(
            config,
            topology,
            moe_dispatch=moe_dispatch,
            dense_ffn_dp=dense_ffn_dp,
            reduction=reduction,
            fusions=fusions,
            dtype=dtype,
            attention=attention,
            remat=remat,
            hyper_connections=hyper_connections,
            scan_layers=scan_layers,
            quantization=quantization,
            cp_attention=cp_attention,
            rngs=nnx.Rngs(0),
        )
    )
    graphdef, abstract_state = nnx.split(abstract)
    blocks = config.layer_blocks(scan_layers)
    return nnx.merge(graphdef, initialize_params(abstract_state, blocks, seed=seed, mesh=mesh))


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
    dense_ffn_dp: bool = False,
    quantization: Fp8Quantization | None = None,
    cp_attention: CpAttentionMode = CpAttentionMode.ALL_GATHER,
) -> CausalLM:
    """A model loaded from a Hugging Face checkpoint directory, each device reading its shard.

    The model is built abstractly (no weights allocated), then every parameter is read straight
    into its sharded global array (stacked experts: each device reads only its experts). MoE
    checkpoints take `moe_ep` (expert-parallel size, dividing the mesh's full TP group) and
    `moe_dispatch` (None: `MoeDispatch.GATHER`). `attention` None picks
    `AttentionImpl.for_platform`; `remat` says what each layer keeps for a backward pass.
    With `scan_layers` (see `build_model`) a stacked parameter is read layer by layer, each
    device still reading only its shard of each layer's tensor. `dense_ffn_dp` and
    `cp_attention`: as `build_model`'s.

    A fine-grained FP8 checkpoint (`quantization_config` with `quant_method: fp8`) loads as an
    FP8 model (`quantization` None: `Fp8Quantization.for_platform`); `quantization` given
    quantizes any other checkpoint on load, each device its own blocks (`checkpoints.fp8`).
    """
    config = load_config(checkpoint_dir)
    platform = mesh_platform(mesh)
    if quantization is None and stored_fp8(checkpoint_dir):
        quantization = Fp8Quantization.for_platform(platform)
    topology = bj.Topology.from_mesh(mesh, moe_ep=moe_ep)
    if attention is None:
        attention = AttentionImpl.for_platform(platform)
    abstract = nnx.eval_shape(
        lambda: construct_model(
            config,
            topology,
            moe_dispatch=moe_dispatch,
            dense_ffn_dp=dense_ffn_dp,
            reduction=reduction,
            fusions=fusions,
            dtype=dtype,
            attention=attention,
            remat=remat,
            hyper_connections=None,
            scan_layers=scan_layers,
            quantization=quantization,
            cp_attention=cp_attention,
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
