"""Mixture-of-experts decoders built only from stage boundaries.

A layer is attention + an FFN that is either the sparse `MoeFfn` or, for the layers the config
marks dense (`mlp_only_layers` and `decoder_sparse_step`), the dense gated MLP; one stack holds
both. Each layer declares its stages through the model's `stage_facts`, from the
config and the chosen `MoeDispatch`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import boundary_jax as bj
from pallas_kernels.grouped_matmul import default_grouped_matmul_impl

from ..config import DecoderConfig
from ..layers.attention.self_attention import replicated_parts as attention_parts
from ..layers.mlp import SwiGLU
from ..layers.moe.ffn import MoeFfn, replicated_parts
from ..layers.moe.fp8 import Fp8MoeFfn
from ..options import BuildOptions
from .designs import StageDesigns
from .layer import DecoderLayer
from .model import CausalLM


def moe_stage_facts(
    config: DecoderConfig,
    topology: bj.Topology,
    dispatch: bj.MoeDispatch,
    layer_index: int,
    stages: StageDesigns,
) -> tuple[bj.StageDeclaration, bj.StageDeclaration]:
    """Layer `layer_index`'s stages: attention, then a sparse FFN dispatched as `dispatch` where
    the config makes the layer sparse, else a dense FFN over the full TP group; `stages` gives
    each stage's residual read, update and output transform (as for `CausalLM.stage_facts`)."""
    attn = stages.attn.declare_attn(replicated=attention_parts(config.o_bias))
    if config.sparse_layers[layer_index]:
        parts = replicated_parts(config.moe, topology, dispatch)
        return attn, stages.ffn.declare_ffn(sparse=True, moe_dispatch=dispatch, replicated=parts)
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
        return exit.finish(self.mlp(h, defer=exit.defer_moe_finalize, counts=exit.counts), stream)

    def ffn_compute(self, h: jax.Array, stream: bj.ResidualStream) -> jax.Array:
        if not isinstance(self.mlp, MoeFfn):
            return super().ffn_compute(h, stream)
        counts = functools.partial(self.ffn_boundary.counts, stream=stream)
        return self.mlp(h, defer=False, counts=counts)


class MoeCausalLM(CausalLM):
    """An MoE decoder LM: `CausalLM` whose sparse layers run `MoeFfn`.

    The experts are split over `topology.moe_ep` ranks. `options.moe_dispatch` picks where the
    experts get their tokens (gathered rows, or an all-to-all from each rank's own rows); either
    way each expert's width is split over the rest of the full TP group. A fusion provider with
    `defer_finalize=True` lets each sparse FFN hand its top-k combine to the next input.

    Attributes (besides `CausalLM`'s):
      moe_dispatch: The sparse layers' dispatch (`options.moe_dispatch`, GATHER for None).
      grouped_matmul: The grouped matmul of every sparse layer (`options.grouped_matmul`, or
        `default_grouped_matmul_impl` for where JAX runs and the dtype).
    """

    layer_class = MoeDecoderLayer
    has_experts = True
    context_parallel = False
    cp_attention_modes = False

    def __init__(
        self,
        config: DecoderConfig,
        topology: bj.Topology,
        options: BuildOptions = BuildOptions(),
        *,
        layer_range: range | None = None,
        rngs: nnx.Rngs,
    ):
        self.moe_dispatch = options.moe_dispatch or bj.MoeDispatch.GATHER
        self.grouped_matmul = options.grouped_matmul or default_grouped_matmul_impl(
            jax.default_backend(), options.dtype
        )
        super().__init__(config, topology, options, layer_range=layer_range, rngs=rngs)

    def stage_facts(
        self, layer_index: int, stages: StageDesigns | None = None
    ) -> tuple[bj.StageDeclaration, ...]:
        stages = self.design.facts() if stages is None else stages
        # A sparse FFN's router reads its input unquantized; its experts quantize their rows.
        stages = self.quantized(stages, ffn=not self.config.sparse_layers[layer_index])
        return moe_stage_facts(self.config, self.topology, self.moe_dispatch, layer_index, stages)

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
        if self.options.quantization is not None:
            return Fp8MoeFfn(
                config.hidden_size,
                config.moe,
                self.topology,
                quantization=self.options.quantization,
                dispatch=self.moe_dispatch,
                capacity=self.options.moe_capacity,
                dtype=dtype,
                init_std=config.initializer_range,
                rngs=rngs,
            )
        return MoeFfn(
            config.hidden_size,
            config.moe,
            self.topology,
            dispatch=self.moe_dispatch,
            capacity=self.options.moe_capacity,
            impl=self.grouped_matmul,
            dtype=dtype,
            init_std=config.initializer_range,
            rngs=rngs,
        )
