"""Nemotron-H (Hugging Face `NemotronHForCausalLM`): a hybrid stack of single-stage layers, with
its `config.json` reader and writer and tensor names.

Each layer is ONE stage, `x + mixer(norm(x))`: a Mamba2 mixer (`M`), attention without
positional encoding (`*`), a relu^2 MLP (`-`) or a mixture of relu^2 experts with the Nemotron-3
router (`E`: sigmoid scores, a score-correction bias that only picks, a grouped top-k, a shared
expert). Each layer appends its one stage to the model's layer stack, so which stage completes a
sum is decided by binding from the two neighbours (the guide's MixerExit):

- A Mamba2 or attention stage is a mixer, `declare_mixer()` (EXIT_SCOPED, reading its own
  rows): before an FFN its exit leaves its attention-TP sum to the FFN's input (under attention
  DP too); before another mixer it leaves the sum to that mixer's input
  without attention DP and completes it under attention DP; at the stack's end it completes it.
- An MLP stage is `declare_ffn()`: over the full TP group on every DP rank's rows.
- An MoE stage is `declare_ffn(sparse=True)`: on gathered rows; it may hand its finalize on.

A decode carries, per sequence slot, each Mamba2 layer's conv and SSM state (`Mamba2Cache`) beside
each attention layer's KV cache; the FFN layers hold none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import boundary_jax as bj

from ..config import (
    DecoderConfig,
    DeepseekRouting,
    ExpertScoring,
    GroupScore,
    HybridConfig,
    HybridLayer,
    HybridMoeConfig,
    Mamba2Spec,
    MoeConfig,
    parse_pattern,
)
from ..config.hf import required
from ..config.registry import add_presets, register
from ..config.tensors import KV_PARTS, HFTensor, mamba2_tensors, whole_model_names
from ..decoder.designs import NormSpec, StageDesigns
from ..decoder.layer import attend_rows
from ..decoder.moe import MoeCausalLM
from ..inputs.rows import TokenRows
from ..layers.activations import ExpertActivation, relu2
from ..layers.attention.kv_cache import KVCache
from ..layers.attention.self_attention import Attention
from ..layers.mixers.mamba2 import Mamba2Cache, Mamba2Mixer
from ..layers.moe.deepseek_router import DeepseekMoeFfn
from ..layers.moe.ffn import replicated_parts
from ..layers.ungated_mlp import UngatedMlp
from ..options import BuildOptions

ARCHITECTURE = "NemotronHForCausalLM"

NO_ROPE_THETA = 10_000.0
"""The `rope_theta` a hybrid config holds: its attention applies no positional encoding
(`nope_full_layers`), so the value is never read."""
SHARED_EXPERT_DEFAULT = 7688
"""`NemotronHConfig`'s shared-expert width where config.json has no key for it."""


def read_nemotron_h(config: Mapping[str, Any]) -> DecoderConfig:
    """Reads a `NemotronHForCausalLM` `config.json` (as a dict).

    Raises:
      ValueError: A layer list and pattern that disagree, unknown layer types, a missing key.
      NotImplementedError: Biases (`attention_bias`, `mlp_bias`, `use_bias`), a latent MoE
        projection (`moe_latent_size`), a sliding window, multi-token-prediction layers in the
        checkpoint, or an MLP activation other than relu^2.
    """
    layers = _read_layers(config)
    for key in ("attention_bias", "mlp_bias", "use_bias"):
        if config.get(key, False):
            raise NotImplementedError(
                f"NemotronHForCausalLM with {key}=true is not supported: the projections here "
                "have no bias"
            )
    unsupported = {
        "moe_latent_size": config.get("moe_latent_size"),
        "sliding_window": config.get("sliding_window"),
    }
    unsupported = {key: value for key, value in unsupported.items() if value is not None}
    if config.get("num_nextn_predict_layers", 0):
        unsupported["num_nextn_predict_layers"] = config["num_nextn_predict_layers"]
    if unsupported:
        raise NotImplementedError(
            f"NemotronHForCausalLM with {unsupported} is not supported; use a checkpoint "
            "without these keys (null, or 0 prediction layers)"
        )
    activation = config.get("mlp_hidden_act", "relu2")
    if activation != "relu2":
        raise NotImplementedError(
            f"the Nemotron-H MLP and experts compute relu^2; got mlp_hidden_act={activation!r}"
        )
    hidden = required(config, "hidden_size")
    heads = required(config, "num_attention_heads")
    mamba = Mamba2Spec.from_hf_config(config) if HybridLayer.MAMBA2 in layers else None
    moe = _read_moe(config) if HybridLayer.MOE in layers else None
    return DecoderConfig(
        architecture=ARCHITECTURE,
        vocab_size=required(config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=required(config, "intermediate_size"),
        num_layers=len(layers),
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        rms_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        rope_theta=NO_ROPE_THETA,
        rope_scaling=None,
        qk_norm=False,
        # transformers' NemotronHForCausalLM never ties its head, whatever the key says: it
        # reads the checkpoint's lm_head.weight.
        tie_word_embeddings=False,
        sliding_window=None,
        max_position_embeddings=required(config, "max_position_embeddings"),
        nope_full_layers=True,
        hybrid=HybridConfig(layers, mamba, moe),
    )


def _read_layers(config: Mapping[str, Any]) -> tuple[HybridLayer, ...]:
    """The layers from `layers_block_type`, else `hybrid_override_pattern`; both must agree."""
    names = config.get("layers_block_type")
    pattern = config.get("hybrid_override_pattern")
    if names is None and pattern is None:
        raise ValueError(
            "a NemotronHForCausalLM config.json names its layers in layers_block_type (or the "
            "older hybrid_override_pattern); it has neither"
        )
    from_pattern = None if pattern is None else parse_pattern(pattern)
    if names is None:
        return from_pattern
    known = {layer.value for layer in HybridLayer}
    if not isinstance(names, list) or not names or not set(names) <= known:
        raise ValueError(
            f"layers_block_type must be a non-empty list over {sorted(known)}; got {names!r}"
        )
    layers = tuple(HybridLayer(name) for name in names)
    if from_pattern is not None and from_pattern != layers:
        raise ValueError(
            f"layers_block_type {names} and hybrid_override_pattern {pattern!r} disagree; give one"
        )
    count = config.get("num_hidden_layers")
    if count is not None and count != len(layers):
        raise ValueError(
            f"num_hidden_layers ({count}) differs from the {len(layers)} layers of "
            "layers_block_type; drop num_hidden_layers (transformers 5 derives it)"
        )
    return layers


def _read_moe(config: Mapping[str, Any]) -> HybridMoeConfig:
    # As transformers: an absent width is the class default, a null one the MLP's width.
    shared = config.get("moe_shared_expert_intermediate_size", SHARED_EXPERT_DEFAULT)
    return HybridMoeConfig(
        num_experts=required(config, "n_routed_experts"),
        top_k=required(config, "num_experts_per_tok"),
        expert_intermediate_size=required(config, "moe_intermediate_size"),
        shared_expert_intermediate_size=shared or required(config, "intermediate_size"),
        num_groups=config.get("n_group") or 1,
        topk_groups=config.get("topk_group") or 1,
        renormalize=bool(config.get("norm_topk_prob", True)),
        scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
    )


def write_nemotron_h(config: DecoderConfig) -> dict[str, Any]:
    """The `NemotronHForCausalLM` `config.json` (as a dict, in transformers 5's keys) of a
    hybrid `config`; `read_nemotron_h` reads it back to `config`."""
    hybrid = config.hybrid
    if hybrid is None:
        raise ValueError(f"write_nemotron_h takes a hybrid config; got {config.architecture}")
    out: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": "nemotron_h",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "layers_block_type": [layer.value for layer in hybrid.layers],
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "layer_norm_epsilon": config.rms_norm_eps,
        "mlp_hidden_act": "relu2",
        "tie_word_embeddings": False,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "use_bias": False,
        "num_nextn_predict_layers": 0,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
    }
    mamba = hybrid.mamba
    if mamba is not None:
        out |= {
            "mamba_num_heads": mamba.num_heads,
            "mamba_head_dim": mamba.head_dim,
            "n_groups": mamba.n_groups,
            "ssm_state_size": mamba.state_size,
            "conv_kernel": mamba.conv_kernel,
            "chunk_size": mamba.chunk_size,
            "time_step_min": mamba.time_step_limit[0],
            "use_conv_bias": mamba.conv_bias,
            "mamba_hidden_act": "silu",
        }
    moe = hybrid.moe
    if moe is not None:
        out |= {
            "n_routed_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.expert_intermediate_size,
            "moe_shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
            "n_group": moe.num_groups,
            "topk_group": moe.topk_groups,
            "norm_topk_prob": moe.renormalize,
            "routed_scaling_factor": moe.scaling_factor,
            "moe_latent_size": None,
        }
    return out


def _layer_tensors(config: DecoderConfig, kind: HybridLayer) -> dict[str, HFTensor]:
    """One Nemotron-H layer's parameters (its `norm` and its stage's `mixer`), with
    layer-relative tensor names."""
    norm = {"norm.weight": HFTensor("norm.weight")}
    if kind is HybridLayer.MAMBA2:
        return norm | mamba2_tensors(config.hybrid.mamba)
    if kind is HybridLayer.ATTENTION:
        return norm | {
            "mixer.q_proj.kernel": HFTensor("mixer.q_proj.weight", transpose=True),
            "mixer.kv_proj.kernel": HFTensor(
                "mixer.{part}_proj.weight", transpose=True, parts=KV_PARTS, part_axis=1
            ),
            "mixer.o_proj.kernel": HFTensor("mixer.o_proj.weight", transpose=True),
        }
    if kind is HybridLayer.MLP:
        return norm | {
            f"mixer.{proj}_proj.kernel": HFTensor(f"mixer.{proj}_proj.weight", transpose=True)
            for proj in ("up", "down")
        }
    experts = config.hybrid.moe.num_experts
    return norm | {
        "mixer.router": HFTensor("mixer.gate.weight", transpose=True),
        "mixer.e_score_correction_bias": HFTensor("mixer.gate.e_score_correction_bias"),
        "mixer.gate_up_proj": HFTensor(  # relu^2 experts: the up projection is the one part
            "mixer.experts.{expert}.{part}_proj.weight",
            transpose=True,
            experts=experts,
            parts=("up",),
            part_axis=2,
        ),
        "mixer.down_proj": HFTensor(
            "mixer.experts.{expert}.down_proj.weight", transpose=True, experts=experts
        ),
        "mixer.shared_expert.gate_up_proj": HFTensor(  # relu^2: the up projection alone
            "mixer.shared_experts.{part}_proj.weight", transpose=True, parts=("up",), part_axis=1
        ),
        "mixer.shared_expert.down_proj": HFTensor(
            "mixer.shared_experts.down_proj.weight", transpose=True
        ),
    }


Cache = KVCache | Mamba2Cache | None
"""A hybrid layer's decode state: attention's KV cache, Mamba2's conv and SSM state, or none."""


def hybrid_stage(
    layer: HybridLayer,
    replicated: tuple[bj.declare.Replicated, ...] = (),
    dispatch: bj.MoeDispatch = bj.MoeDispatch.GATHER,
) -> bj.StageDeclaration:
    """The one stage a hybrid layer declares (fresh, for `append_stages`), with its MoE's
    replicated parts (`models.layers.moe.ffn.replicated_parts`), under the model's MoE
    dispatch (every stage of the stack: a mixer behind an all-to-all MoE gathers its input)."""
    if layer.is_mixer:
        # A mixer computes on complete rows, as attention does: its boundary gathers its input
        # where the residual arrives on attention-TP slices (an input-scattered batch, or behind
        # an all-to-all MoE, an FFN on its own rows).
        return bj.declare_mixer(gathers_attn_tp_input=True)
    if layer is HybridLayer.MOE:
        return bj.declare_ffn(sparse=True, moe_dispatch=dispatch, replicated=replicated)
    return bj.declare_ffn()


class SingleStageLayer(nnx.Module):
    """One hybrid layer: its norm, its compute and the boundary of its one stage.

    Attributes:
      kind: The layer's stage.
      norm: The stage's input RMSNorm (HF `backbone.layers.{i}.norm`).
      mixer: The stage's compute (HF `backbone.layers.{i}.mixer`): a `Mamba2Mixer`, an
        `Attention`, an `UngatedMlp` (relu^2) or a `DeepseekMoeFfn`.
      boundary: The stage's boundary.
    """

    def __init__(
        self,
        kind: HybridLayer,
        mixer: nnx.Module,
        stage: bj.StageDeclaration,
        *,
        norm: NormSpec,
        dtype: jnp.dtype,
    ):
        self.kind = kind
        self.norm = norm.rms_norm(dtype)
        self.mixer = mixer
        (self.boundary,) = bj.append_stages((stage, self.norm), owner=self)

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
                y, cache = attend_rows(self.mixer, h, rows, cache, self.boundary, stream)
            case HybridLayer.MLP:
                y = self.mixer(h)
            case HybridLayer.MOE:
                exit = self.boundary.exit(stream)
                y = self.mixer(h, defer=exit.defer_moe_finalize, counts=exit.counts)
                x, stream = exit.finish(y, stream)
                return x, stream, cache
        x, stream = self.boundary.finish(y, stream)
        return x, stream, cache


@register
class NemotronHForCausalLM(MoeCausalLM):
    """Nemotron-H: Mamba2, attention, relu^2 MLP and MoE layers, one stage each, in the order of
    `config.hybrid.layers`.

    Built as every decoder here (`CausalLM`: the vocab-parallel embedding owes its attention-TP
    sum to the first stage, the stack leaves through `final_norm`, HF `norm_f`); the MoE layers'
    experts split over `topology.moe_ep` on gathered rows. Not supported: scanned layers,
    hyper-connections and captures of hidden states. Under the all-to-all dispatch each MoE
    layer takes its own rows, and the mixer after it gathers them back over attention TP. As
    pipeline stages, each stage holds its layers' decode states (`cache_specs`).
    """

    architectures = (ARCHITECTURE,)
    model_type = "nemotron_h"
    # transformers' attribute_map: two names config.json may give one key.
    config_aliases = {
        "layer_types": "layers_block_type",
        "num_local_experts": "n_routed_experts",
    }
    # transformers' NemotronHConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "head_dim": 128,
    }
    quantizable = False
    ties_head = False
    embedding_padding = False
    hyper_connections = False
    captures_hidden_states = False

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        return read_nemotron_h(hf_config)

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return write_nemotron_h(config)

    @classmethod
    def check_config(cls, config: DecoderConfig) -> None:
        """A hybrid stack's config: its layer pattern (`hybrid`), no `moe` (its MoE layers'
        facts are the pattern's) and no MLP biases."""
        if config.hybrid is None or config.moe is not None or config.mlp_bias:
            raise ValueError(
                f"{config.architecture} needs hybrid layer settings and takes no MoE settings or "
                f"MLP biases; got hybrid={config.hybrid!r}, moe={config.moe!r}, "
                f"mlp_bias={config.mlp_bias}"
            )

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        """`layers.{i}.norm.weight` and the stage's parameters under `layers.{i}.mixer`, from
        `backbone.`, as transformers saves them."""
        config.layer_blocks(scan_layers)  # raises for a scanned hybrid stack
        layers = {}
        for index, kind in enumerate(config.hybrid.layers):
            for path, tensor in _layer_tensors(config, kind).items():
                layers[f"layers.{index}.{path}"] = dataclasses.replace(
                    tensor, name=f"backbone.layers.{index}.{tensor.name}"
                )
        return whole_model_names(
            config, layers, prefix="backbone.", embedding="embeddings", final_norm="norm_f"
        )

    @classmethod
    def check_build(
        cls, config: DecoderConfig, topology: bj.Topology, options: BuildOptions
    ) -> None:
        if options.hyper_connections is not None:
            raise NotImplementedError(
                "Nemotron-H with MHC hyper-connections is not supported; build it without"
            )
        if config.hybrid.moe is None and topology.moe_ep != 1:
            raise ValueError(
                f"the hybrid pattern {config.hybrid.pattern!r} has no MoE layer; got "
                f"moe_ep={topology.moe_ep}. Leave the MoE options unset"
            )
        super().check_build(config, topology, options)

    def stage_facts(
        self, layer_index: int, stages: StageDesigns | None = None
    ) -> tuple[bj.StageDeclaration, ...]:
        """Layer `layer_index`'s one stage (every hybrid layer reads `norm(residual)` and adds
        its output, so `stages` adds nothing)."""
        del stages
        kind = self.config.hybrid.layers[layer_index]
        parts = ()
        if kind is HybridLayer.MOE:
            parts = replicated_parts(self.experts(), self.topology, self.moe_dispatch)
        return (hybrid_stage(kind, parts, self.moe_dispatch),)

    def experts(self) -> MoeConfig:
        """The MoE layers' experts: DeepSeek's sigmoid routing over groups, a shared expert."""
        moe = self.config.hybrid.moe
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
        return MoeConfig(
            num_experts=moe.num_experts,
            top_k=moe.top_k,
            expert_intermediate_size=moe.expert_intermediate_size,
            renormalize=moe.renormalize,
            shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
            routing=rule,
        )

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
                    impl=self.options.attention,
                    rngs=rngs,
                )
            case HybridLayer.MLP:
                mixer = UngatedMlp(
                    config.hidden_size,
                    config.intermediate_size,
                    activation=relu2,
                    topology=topology,
                    dtype=dtype,
                    rngs=rngs,
                )
            case HybridLayer.MOE:
                mixer = DeepseekMoeFfn(
                    config.hidden_size,
                    self.experts(),
                    topology,
                    dispatch=self.moe_dispatch,
                    activation=ExpertActivation.RELU2,
                    impl=self.grouped_matmul,
                    dtype=dtype,
                    rngs=rngs,
                )
        norm = NormSpec(config.hidden_size, config.rms_norm_eps)
        (stage,) = self.stage_facts(index)
        return SingleStageLayer(kind, mixer, stage, norm=norm, dtype=dtype)

    def cache_specs(self) -> tuple:
        """Per layer this module holds, its decode state's `PartitionSpec` tree (None for an
        FFN layer)."""
        specs = {
            HybridLayer.MAMBA2: Mamba2Cache.specs(self.topology),
            HybridLayer.ATTENTION: KVCache.specs(self.topology),
        }
        return tuple(specs.get(kind) for kind in self._held_kinds())

    def token_cache_layers(self) -> int:
        """The attention layers (each keeps a KV cache)."""
        return self.config.hybrid.layers.count(HybridLayer.ATTENTION)

    def state_bytes_per_slot(self, dtype: jnp.dtype) -> int:
        """Each Mamba2 layer's conv inputs (in `dtype`) and float32 SSM state of one slot on one
        device, over the layers."""
        hybrid = self.config.hybrid
        one = Mamba2Cache.bytes_per_slot(hybrid.mamba, self.topology, dtype)
        return one * hybrid.layers.count(HybridLayer.MAMBA2)

    def _held_kinds(self) -> tuple[HybridLayer, ...]:
        """The kinds of the layers this module holds (all, or a pipeline stage's share)."""
        return tuple(self.config.hybrid.layers[index] for index in self.layer_range)

    def new_caches(
        self, *, slots: int, max_len: int, dtype: jnp.dtype, mesh: Mesh | None = None
    ) -> tuple[Cache, ...]:
        """Per layer this module holds, a zero decode state for `slots` sequences (over all
        attention-DP ranks): a KV cache of `max_len` positions for attention, the conv and SSM
        state for Mamba2 (the SSM state in float32), None for an FFN layer; on `mesh`, each
        device allocates its shard."""
        config, topology = self.config, self.topology
        caches = []
        for kind in self._held_kinds():
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


# Nemotron-H: a Mamba2 mixer, attention (no RoPE), a relu^2 MLP and a MoE of 8 relu^2 experts (top
# 2 of the best 2 of 4 groups, sigmoid router with a score-correction bias, a shared expert): one
# stage per layer, so the mixer's exit faces a mixer, then an FFN, and an FFN an FFN.
TINY = DecoderConfig(
    architecture=ARCHITECTURE,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=NO_ROPE_THETA,
    rope_scaling=None,
    qk_norm=False,
    tie_word_embeddings=False,
    sliding_window=None,
    max_position_embeddings=128,
    nope_full_layers=True,
    hybrid=HybridConfig(
        parse_pattern("M*-E"),
        Mamba2Spec(
            hidden_size=64, num_heads=8, head_dim=8, n_groups=2, state_size=16, chunk_size=16
        ),
        HybridMoeConfig(
            num_experts=8,
            top_k=2,
            expert_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_groups=4,
            topk_groups=2,
            scaling_factor=2.5,
        ),
    ),
)
add_presets({"tiny-nemotron-h": TINY})
