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

from .attention import AttentionImpl
from .config import Architecture, DecoderConfig
from .decoder import PLAIN, CausalLM, DecoderLayer, LayerDesigns, Remat
from .hyper_connections import HyperConnections
from .mlp import SwiGLU
from .moe import GroupedMatmulImpl
from .moe_ffn import MoeFfn


def moe_stage_facts(
    config: DecoderConfig,
    dispatch: bj.MoeDispatch,
    layer_index: int,
    designs: LayerDesigns = PLAIN,
) -> tuple[bj.StageDeclaration, bj.StageDeclaration]:
    """Layer `layer_index`'s stages: attention, then a sparse FFN dispatched as `dispatch` where
    the config makes the layer sparse, else a dense FFN over the full TP group; `designs` gives
    each stage's residual read and update (as for `decoder.stage_facts`)."""
    attn, ffn = designs
    if config.sparse_layers[layer_index]:
        return bj.declare_attn(**attn), bj.declare_ffn(sparse=True, moe_dispatch=dispatch, **ffn)
    return bj.declare_attn(**attn), bj.declare_ffn(**ffn)


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
            rngs=rngs,
        )

    def stage_facts(
        self, layer_index: int, designs: LayerDesigns | None = None
    ) -> tuple[bj.StageDeclaration, ...]:
        designs = self.layer_designs() if designs is None else designs
        return moe_stage_facts(self.config, self.moe_dispatch, layer_index, designs)

    def make_layer(self, config: DecoderConfig, index: int, **common) -> nnx.Module:
        if config.sparse_layers[index]:
            mlp = MoeFfn(
                config.hidden_size,
                config.moe,
                common["topology"],
                dispatch=self.moe_dispatch,
                capacity=self.moe_capacity,
                impl=self.grouped_matmul,
                dtype=common["dtype"],
                rngs=common["rngs"],
            )
        else:
            mlp = SwiGLU(config.hidden_size, config.intermediate_size, **common)
        designs = self.layer_designs(dtype=common["dtype"], rngs=common["rngs"])
        return MoeDecoderLayer(
            config,
            self.stage_facts(index, designs),
            lambda: mlp,
            attention=self.attention,
            layer_index=index,
            **common,
        )


class Qwen3MoeForCausalLM(MoeCausalLM):
    """Qwen3-MoE: q/k RMSNorm per head, sparse layers by `mlp_only_layers` and
    `decoder_sparse_step`, top-k weights renormalized where `norm_topk_prob`."""

    architectures = (Architecture.QWEN3_MOE,)


class MixtralForCausalLM(MoeCausalLM):
    """Mixtral: every layer sparse, top-k renormalized, sliding-window attention where set."""

    architectures = (Architecture.MIXTRAL,)


class Qwen2MoeForCausalLM(MoeCausalLM):
    """Qwen2-MoE: q/k/v biases, top-k weights as the softmax gave them (renormalized only where
    `norm_topk_prob`), and a shared expert scaled by `sigmoid(x @ shared_expert_gate)` that every
    token goes through, summed with the routed experts' output."""

    architectures = (Architecture.QWEN2_MOE,)
