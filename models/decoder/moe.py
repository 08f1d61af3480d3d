"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral, Qwen2-MoE) built only from stage boundaries.

A layer is attention + an FFN that is either the sparse `MoeFfn` or, for the layers the config
marks dense (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`), the dense SwiGLU; one
stack holds both. Each layer declares its stages through the model's `stage_facts`, from the
config and the chosen `MoeDispatch`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import boundary_jax as bj
from pallas_kernels.grouped_matmul import default_grouped_matmul_impl

from ..config import DecoderConfig
from ..layers.attention.self_attention import AttentionImpl
from ..layers.fp8_linear import Fp8Quantization
from ..layers.hyper_connections import HyperConnections
from ..layers.mlp import SwiGLU
from ..layers.moe.ffn import MoeFfn
from ..layers.moe.fp8 import Fp8MoeFfn
from ..layers.moe.sparse import GroupedMatmulImpl
from .designs import StageDesigns
from .model import CausalLM, DecoderLayer, Remat


def moe_stage_facts(
    config: DecoderConfig,
    dispatch: bj.MoeDispatch,
    layer_index: int,
    stages: StageDesigns,
) -> tuple[bj.StageDeclaration, bj.StageDeclaration]:
    """Layer `layer_index`'s stages: attention, then a sparse FFN dispatched as `dispatch` where
    the config makes the layer sparse, else a dense FFN over the full TP group; `stages` gives
    each stage's residual read, update and output transform (as for `CausalLM.stage_facts`)."""
    attn = stages.attn.declare_attn()
    if config.sparse_layers[layer_index]:
        return attn, stages.ffn.declare_ffn(sparse=True, moe_dispatch=dispatch)
    return attn, stages.ffn.declare_ffn()


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose FFN may be a `MoeFfn`: its exit decides, before compute, whether
    the MoE hands its finalize on (`mlp` is `MoeFfn` on a sparse layer, else `SwiGLU`)."""

    def run_ffn(
        self, h: jax.Array, stream: bj.ResidualStream
    ) -> tuple[bj.OwedOutput, bj.ResidualStream]:
        if not isinstance(self.mlp, MoeFfn):
            return super().run_ffn(h, stream)
        exit = self.ffn_boundary.exit(stream)
        return exit.finish(self.mlp(h, defer=exit.defer_moe_finalize), stream)

    def ffn_compute(self, h: jax.Array) -> jax.Array:
        if not isinstance(self.mlp, MoeFfn):
            return super().ffn_compute(h)
        return self.mlp(h, defer=False)


class MoeCausalLM(CausalLM):
    """An MoE decoder LM: `CausalLM` whose sparse layers run `MoeFfn`.

    The experts are split over `topology.moe_ep` ranks. `moe_dispatch` picks where the experts
    get their tokens (gathered rows, or an all-to-all from each rank's own rows); either way
    each expert's width is split over the rest of the full TP group. A fusion provider with
    `defer_finalize=True` lets each sparse FFN hand its top-k combine to the next input. The
    experts' grouped matmuls run as `grouped_matmul` says (None: `default_grouped_matmul_impl`
    for where JAX runs and `dtype`).

    Attributes (besides `CausalLM`'s):
      moe_dispatch: The sparse layers' dispatch.
      moe_capacity: The all-to-all capacity (rows per rank pair; None drops nothing).
      grouped_matmul: The grouped matmul implementation of every sparse layer.
    """

    layer_class = MoeDecoderLayer
    architectures = ()

    def __init__(
        self,
        config: DecoderConfig,
        topology: bj.Topology,
        *,
        moe_dispatch: bj.MoeDispatch = bj.MoeDispatch.GATHER,
        moe_capacity: int | None = None,
        grouped_matmul: GroupedMatmulImpl | None = None,
        reduction: bj.ReductionPolicy = bj.ReductionPolicy.AUTO,
        fusions: bj.fusions.FusionProvider = bj.fusions.NO_FUSIONS,
        dtype: jnp.dtype = jnp.float32,
        attention: AttentionImpl = AttentionImpl.XLA,
        remat: Remat = Remat.NONE,
        hyper_connections: HyperConnections | None = None,
        scan_layers: bool = False,
        layer_range: range | None = None,
        quantization: Fp8Quantization | None = None,
        rngs: nnx.Rngs,
    ):
        self.moe_dispatch = moe_dispatch
        self.moe_capacity = moe_capacity
        self.grouped_matmul = grouped_matmul or default_grouped_matmul_impl(
            jax.default_backend(), dtype
        )
        super().__init__(
            config,
            topology,
            reduction=reduction,
            fusions=fusions,
            dtype=dtype,
            attention=attention,
            remat=remat,
            hyper_connections=hyper_connections,
            scan_layers=scan_layers,
            layer_range=layer_range,
            quantization=quantization,
            rngs=rngs,
        )

    def stage_facts(
        self, layer_index: int, stages: StageDesigns | None = None
    ) -> tuple[bj.StageDeclaration, ...]:
        stages = self.design.facts() if stages is None else stages
        # A sparse FFN's router reads its input unquantized; its experts quantize their rows.
        stages = self.quantized(stages, ffn=not self.config.sparse_layers[layer_index])
        return moe_stage_facts(self.config, self.moe_dispatch, layer_index, stages)

    def make_mlp(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Layer `index`'s FFN: the sparse `MoeFfn` on a sparse layer, else the dense SwiGLU."""
        config = self.config
        if not config.sparse_layers[index]:
            return SwiGLU(
                config.hidden_size,
                config.intermediate_size,
                topology=self.topology,
                dtype=dtype,
                init_std=config.initializer_range,
                linears=self.linears,
                rngs=rngs,
            )
        if self.quantization is not None:
            return Fp8MoeFfn(
                config.hidden_size,
                config.moe,
                self.topology,
                quantization=self.quantization,
                dispatch=self.moe_dispatch,
                capacity=self.moe_capacity,
                dtype=dtype,
                init_std=config.initializer_range,
                rngs=rngs,
            )
        return MoeFfn(
            config.hidden_size,
            config.moe,
            self.topology,
            dispatch=self.moe_dispatch,
            capacity=self.moe_capacity,
            impl=self.grouped_matmul,
            dtype=dtype,
            init_std=config.initializer_range,
            rngs=rngs,
        )
