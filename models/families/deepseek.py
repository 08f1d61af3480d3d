"""DeepSeek-V2 and DeepSeek-V3 (Hugging Face `DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`) built
only from stage boundaries.

A layer is multi-head latent attention (`MultiHeadLatentAttention`: heads over attention TP, the
latent and its norms replicated) and an FFN: the first `first_k_dense_replace` layers a dense
SwiGLU, the rest DeepSeek's MoE (`DeepseekMoeFfn`: routed experts over EP, gathered or sent
all-to-all, and the shared experts counted once). The decode cache is the latent
(`LatentCache`): `kv_lora_rank + qk_rope_head_dim` values per token and layer, shared by the
heads.

The latent norms need no boundary read. The boundary hands attention complete rows (gathered
from attention-TP slices where the batch is input-scattered), q_a and kv_a are replicated, and
every rank computes the whole latent of every row and normalizes it there: no latent is split
over ranks before its norm, so no sum of squares has to cross one. (Running kv_a on each rank's
slice of an input-scattered batch and gathering the smaller latent instead of the hidden rows,
SGLang's latent-input hook, would save gather bytes; it is a speed option, not needed for
correctness.)

With `dense_ffn_dp` the dense layers are fully data-parallel (`declare_ffn(dense_tp_size=1)`):
every rank holds their whole weights and runs them on its own rows (its attention-TP slice of
its DP rank's tokens), so their output owes no sum.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import boundary_jax as bj

from ..config import Architecture, DecoderConfig
from ..decoder.designs import StageDesigns
from ..decoder.model import Remat
from ..decoder.moe import MoeCausalLM, moe_stage_facts
from ..layers.attention.latent import LatentCache, MultiHeadLatentAttention
from ..layers.attention.self_attention import AttentionImpl
from ..layers.hyper_connections import HyperConnections
from ..layers.mlp import SwiGLU
from ..layers.moe.deepseek_router import DeepseekMoeFfn
from ..layers.moe.sparse import GroupedMatmulImpl

WHOLE_ON_EVERY_RANK = bj.Topology()
"""The topology a fully data-parallel dense FFN is built on: one rank, so no weight is split."""


class DeepseekCausalLM(MoeCausalLM):
    """A DeepSeek decoder LM: `MoeCausalLM` with latent attention, DeepSeek's router and shared
    experts, and the latent decode cache.

    Attributes (besides `MoeCausalLM`'s):
      dense_ffn_dp: The dense layers' FFN is fully data-parallel (whole weights on every rank,
        run on the rank's own rows) instead of split over the full TP group.
    """

    architectures = ()
    quantizable = False  # FP8 projections are not built for its layers

    def __init__(
        self,
        config: DecoderConfig,
        topology: bj.Topology,
        *,
        moe_dispatch: bj.MoeDispatch = bj.MoeDispatch.GATHER,
        moe_capacity: int | None = None,
        grouped_matmul: GroupedMatmulImpl | None = None,
        dense_ffn_dp: bool = False,
        reduction: bj.ReductionPolicy = bj.ReductionPolicy.AUTO,
        fusions: bj.fusions.FusionProvider = bj.fusions.NO_FUSIONS,
        dtype: jnp.dtype = jnp.float32,
        attention: AttentionImpl = AttentionImpl.XLA,
        remat: Remat = Remat.NONE,
        hyper_connections: HyperConnections | None = None,
        scan_layers: bool = False,
        rngs: nnx.Rngs,
    ):
        self.dense_ffn_dp = dense_ffn_dp
        super().__init__(
            config,
            topology,
            moe_dispatch=moe_dispatch,
            moe_capacity=moe_capacity,
            grouped_matmul=grouped_matmul,
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
        self, layer_index: int, stages: StageDesigns | None = None
    ) -> tuple[bj.StageDeclaration, ...]:
        """Attention, then the sparse FFN, or the dense one (fully data-parallel under
        `dense_ffn_dp`)."""
        stages = self.design.facts() if stages is None else stages
        if self.dense_ffn_dp and not self.config.sparse_layers[layer_index]:
            return stages.attn.declare_attn(), stages.ffn.declare_ffn(dense_tp_size=1)
        return moe_stage_facts(self.config, self.moe_dispatch, layer_index, stages)

    def make_mlp(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Layer `index`'s FFN: DeepSeek's MoE on a sparse layer, else the dense SwiGLU (whole on
        every rank under `dense_ffn_dp`)."""
        config = self.config
        if config.sparse_layers[index]:
            return DeepseekMoeFfn(
                config.hidden_size,
                config.moe,
                self.topology,
                dispatch=self.moe_dispatch,
                capacity=self.moe_capacity,
                impl=self.grouped_matmul,
                dtype=dtype,
                rngs=rngs,
            )
        return SwiGLU(
            config.hidden_size,
            config.intermediate_size,
            topology=WHOLE_ON_EVERY_RANK if self.dense_ffn_dp else self.topology,
            dtype=dtype,
            rngs=rngs,
        )

    def make_layer(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Decoder layer `index`: latent attention and its FFN (inside the open layer stack)."""
        attn = MultiHeadLatentAttention(
            self.config.mla, topology=self.topology, dtype=dtype, impl=self.attention, rngs=rngs
        )
        return self.layer_class(
            attn,
            self.make_mlp(index, dtype=dtype, rngs=rngs),
            design=self.design,
            declare=lambda stages: self.stage_facts(index, stages),
            dtype=dtype,
            rngs=rngs,
        )

    def block_cache_specs(self, *, stacked: bool = False) -> LatentCache:
        """The `PartitionSpec` tree of one block's latent cache."""
        return LatentCache.specs(self.topology, stacked=stacked)

    def block_cache(
        self, *, slots: int, max_len: int, dtype: jnp.dtype, mesh: Mesh | None, layers: int | None
    ) -> LatentCache:
        """One block's zero latent cache, as `LatentCache.create` makes it."""
        return LatentCache.create(
            self.config.mla,
            self.topology,
            slots=slots,
            max_len=max_len,
            dtype=dtype,
            mesh=mesh,
            layers=layers,
        )

    def cache_bytes_per_token(self, dtype: jnp.dtype) -> int:
        """`(kv_lora_rank + qk_rope_head_dim) * itemsize`: one token of one layer's latent
        cache on one device, whatever the heads or the attention-TP size."""
        return LatentCache.bytes_per_token(self.config.mla, dtype)


class DeepseekV2ForCausalLM(DeepseekCausalLM):
    """DeepSeek-V2 (and V2-Lite): softmax routing, greedy or group-limited greedy top-k, the
    weights scaled by `routed_scaling_factor`, interleaved RoPE pairs."""

    architectures = (Architecture.DEEPSEEK_V2,)


class DeepseekV3ForCausalLM(DeepseekCausalLM):
    """DeepSeek-V3: sigmoid routing with a correction bias that only picks experts, grouped
    top-k (groups scored by their best two), renormalized and scaled weights, q LoRA."""

    architectures = (Architecture.DEEPSEEK_V3,)
