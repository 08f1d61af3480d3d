"""Nemotron-H (Hugging Face `NemotronHForCausalLM`): a hybrid stack of single-stage layers.

Each layer is ONE stage, `x + mixer(norm(x))`: a Mamba2 mixer (`M`), attention without
positional encoding (`*`), a relu^2 MLP (`-`) or a mixture of relu^2 experts with the Nemotron-3
router (`E`: sigmoid scores, a score-correction bias that only picks, a grouped top-k, a shared
expert). Each layer appends its one stage to the model's layer stack, so which stage completes a
sum is decided by binding from the two neighbours (the guide's MixerExit):

- A Mamba2 or attention stage is a mixer, `declare_attn(reduction=EXIT_SCOPED,
  gathers_attn_tp_input=False)`: before an FFN its exit leaves its attention-TP sum to the FFN's
  input (under attention DP too); before another mixer it leaves the sum to that mixer's input
  without attention DP and completes it under attention DP; at the stack's end it completes it.
- An MLP stage is `declare_ffn()`: over the full TP group on every DP rank's rows.
- An MoE stage is `declare_ffn(sparse=True)`: on gathered rows; it may hand its finalize on.

A decode carries, per sequence slot, each Mamba2 layer's conv and SSM state (`Mamba2Cache`) beside
each attention layer's KV cache; the FFN layers hold none.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import boundary_jax as bj

from ..config import Architecture, DecoderConfig, HybridLayer, MoeConfig
from ..decoder.designs import NormSpec, StageDesigns
from ..decoder.layer import attend_rows
from ..decoder.model import Remat
from ..decoder.moe import MoeCausalLM
from ..inputs.rows import TokenRows
from ..layers.activations import ExpertActivation
from ..layers.attention.self_attention import Attention, AttentionImpl, KVCache
from ..layers.hyper_connections import HyperConnections
from ..layers.mixers.mamba2 import Mamba2Cache, Mamba2Mixer
from ..layers.moe.deepseek_router import DeepseekMoeFfn, DeepseekRouting, ExpertScoring, GroupScore
from ..layers.moe.sparse import GroupedMatmulImpl
from ..layers.relu2_mlp import Relu2Mlp

Cache = KVCache | Mamba2Cache | None
"""A hybrid layer's decode state: attention's KV cache, Mamba2's conv and SSM state, or none."""


def hybrid_stage(layer: HybridLayer) -> bj.StageDeclaration:
    """The one stage a hybrid layer declares (fresh, for `append_stages`)."""
    if layer.is_mixer:
        return bj.declare_attn(
            reduction=bj.ProducerReduction.EXIT_SCOPED, gathers_attn_tp_input=False
        )
    return bj.declare_ffn(sparse=layer is HybridLayer.MOE)


class SingleStageLayer(nnx.Module):
    """One hybrid layer: its norm, its compute and the boundary of its one stage.

    Attributes:
      kind: The layer's stage.
      norm: The stage's input RMSNorm (HF `backbone.layers.{i}.norm`).
      mixer: The stage's compute (HF `backbone.layers.{i}.mixer`): a `Mamba2Mixer`, an
        `Attention`, a `Relu2Mlp` or a `DeepseekMoeFfn`.
      boundary: The stage's boundary.
    """

    def __init__(self, kind: HybridLayer, mixer: nnx.Module, *, norm: NormSpec, dtype: jnp.dtype):
        self.kind = kind
        self.norm = norm.rms_norm(dtype)
        self.mixer = mixer
        (self.boundary,) = bj.append_stages((hybrid_stage(kind), self.norm), owner=self)

    def stages(self) -> tuple[tuple[str, bj.StageBoundary], ...]:
        """The layer's one stage boundary by name (for plan reports)."""
        return ((self.kind.value, self.boundary),)

    def __call__(
        self, x: jax.Array | bj.OwedOutput, stream: bj.ResidualStream, rows: TokenRows, cache: Cache
    ) -> tuple[bj.OwedOutput, bj.ResidualStream, Cache]:
        h, stream = self.boundary.prepare(x, stream)
        match self.kind:
            case HybridLayer.MAMBA2:
                y, cache = self.mixer(h, rows.positions, rows.segment_ids, cache, phase=rows.phase)
            case HybridLayer.ATTENTION:
                y, cache = attend_rows(self.mixer, h, rows, cache)
            case HybridLayer.MLP:
                y = self.mixer(h)
            case HybridLayer.MOE:
                exit = self.boundary.exit(stream)
                x, stream = exit.finish(self.mixer(h, defer=exit.defer_moe_finalize), stream)
                return x, stream, cache
        x, stream = self.boundary.finish(y, stream)
        return x, stream, cache


class NemotronHForCausalLM(MoeCausalLM):
    """Nemotron-H: Mamba2, attention, relu^2 MLP and MoE layers, one stage each, in the order of
    `config.hybrid.layers`.

    Built as every decoder here (`CausalLM`: the vocab-parallel embedding owes its attention-TP
    sum to the first stage, the stack leaves through `final_norm`, HF `norm_f`); the MoE layers'
    experts split over `topology.moe_ep` on gathered rows. Not supported: scanned layers,
    hyper-connections, captures of hidden states, and the all-to-all dispatch (the mixers do not
    gather their input, so no FFN on its own rows can precede one).
    """

    architectures = (Architecture.NEMOTRON_H,)
    quantizable = False  # FP8 projections are not built for its layers

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
        if hyper_connections is not None:
            raise NotImplementedError(
                "Nemotron-H with MHC hyper-connections is not supported; build it without"
            )
        if moe_dispatch is not bj.MoeDispatch.GATHER:
            raise NotImplementedError(
                f"Nemotron-H's MoE layers run on gathered rows (MoeDispatch.GATHER); got "
                f"{moe_dispatch}. Its mixers do not gather their input, so no FFN on its own "
                "rows can precede one"
            )
        if config.hybrid is not None and config.hybrid.moe is None and topology.moe_ep != 1:
            raise ValueError(
                f"the hybrid pattern {config.hybrid.pattern!r} has no MoE layer; got "
                f"moe_ep={topology.moe_ep}. Leave the MoE options unset"
            )
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
            scan_layers=scan_layers,
            rngs=rngs,
        )

    def stage_facts(
        self, layer_index: int, stages: StageDesigns | None = None
    ) -> tuple[bj.StageDeclaration, ...]:
        """Layer `layer_index`'s one stage (every hybrid layer reads `norm(residual)` and adds
        its output, so `stages` adds nothing)."""
        del stages
        return (hybrid_stage(self.config.hybrid.layers[layer_index]),)

    def make_layer(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> SingleStageLayer:
        """Hybrid layer `index` (inside the open layer stack)."""
        config, topology = self.config, self.topology
        kind = config.hybrid.layers[index]
        match kind:
            case HybridLayer.MAMBA2:
                mixer = Mamba2Mixer(config.hybrid.mamba, topology=topology, dtype=dtype, rngs=rngs)
            case HybridLayer.ATTENTION:
                mixer = Attention(
                    config.attention_spec(index),
                    topology=topology,
                    dtype=dtype,
                    impl=self.attention,
                    rngs=rngs,
                )
            case HybridLayer.MLP:
                mixer = Relu2Mlp(
                    config.hidden_size,
                    config.intermediate_size,
                    topology=topology,
                    dtype=dtype,
                    rngs=rngs,
                )
            case HybridLayer.MOE:
                moe = config.hybrid.moe
                rule = DeepseekRouting(
                    moe.num_experts,
                    moe.top_k,
                    ExpertScoring.SIGMOID,
                    num_groups=moe.num_groups,
                    topk_groups=moe.topk_groups,
                    group_score=GroupScore.TOP2_SUM,
                    correction_bias=True,
                    renormalize=moe.renormalize,
                    scaling_factor=moe.scaling_factor,
                )
                experts = MoeConfig(
                    num_experts=moe.num_experts,
                    top_k=moe.top_k,
                    expert_intermediate_size=moe.expert_intermediate_size,
                    renormalize=moe.renormalize,
                    shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
                    routing=rule,
                )
                mixer = DeepseekMoeFfn(
                    config.hidden_size,
                    experts,
                    topology,
                    dispatch=self.moe_dispatch,
                    activation=ExpertActivation.RELU2,
                    impl=self.grouped_matmul,
                    dtype=dtype,
                    rngs=rngs,
                )
        norm = NormSpec(config.hidden_size, config.rms_norm_eps)
        return SingleStageLayer(kind, mixer, norm=norm, dtype=dtype)

    def cache_specs(self) -> tuple:
        """Per layer, its decode state's `PartitionSpec` tree (None for an FFN layer)."""
        specs = {
            HybridLayer.MAMBA2: Mamba2Cache.specs(self.topology),
            HybridLayer.ATTENTION: KVCache.specs(self.topology),
        }
        return tuple(specs.get(kind) for kind in self.config.hybrid.layers)

    def new_caches(
        self, *, slots: int, max_len: int, dtype: jnp.dtype, mesh: Mesh | None = None
    ) -> tuple[Cache, ...]:
        """Per layer, a zero decode state for `slots` sequences (over all attention-DP ranks):
        a KV cache of `max_len` positions for attention, the conv and SSM state for Mamba2 (the
        SSM state in float32), None for an FFN layer; on `mesh`, each device allocates its
        shard."""
        config, topology = self.config, self.topology
        caches = []
        for kind in config.hybrid.layers:
            if kind is HybridLayer.MAMBA2:
                spec = config.hybrid.mamba
                caches.append(
                    Mamba2Cache.create(spec, topology, slots=slots, dtype=dtype, mesh=mesh)
                )
            elif kind is HybridLayer.ATTENTION:
                caches.append(
                    KVCache.create(
                        config, topology, slots=slots, max_len=max_len, dtype=dtype, mesh=mesh
                    )
                )
            else:
                caches.append(None)
        return tuple(caches)

    def hidden_captured(
        self, rows: TokenRows, batch: bj.BatchFacts, capture_layers: Sequence[int]
    ) -> tuple[jax.Array, jax.Array]:
        """Not supported: an FFN layer's input does not capture the residual entering it."""
        raise NotImplementedError(
            "captured hidden states of a hybrid stack are not supported: only a mixer's input "
            "captures, and an MLP or MoE layer may start any layer of the pattern"
        )
