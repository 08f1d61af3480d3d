"""Kimi-Linear (Hugging Face `KimiLinearForCausalLM`): Kimi Delta Attention on most layers and
multi-head latent attention without positional encoding on the others, DeepSeek's MoE (sigmoid
scores with a correction bias, a grouped top-k, scaled weights, shared experts) after the first
`first_k_dense_replace` dense layers; on the DeepSeek classes (`models.families.deepseek`).

Each layer is two stages, as DeepSeek's: its token mixer, then its FFN. Kimi Delta Attention
(`models.layers.mixers.kimi_delta`) is declared as attention is: it reads its own rows, splits
its heads over attention TP and leaves its o_proj partial sum to its exit, which binding
completes as for attention; it keeps a fixed-size state per sequence slot (`DeltaCache`) where
the latent-attention layers keep their latent cache (`LatentCache`). The latent attention is
DeepSeek's with its "rope" dimensions left unrotated (`MlaConfig.rotary`): one key part still
shared by the heads, no position in it.
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
    KimiDeltaSpec,
    LinearAttentionLayers,
    MlaConfig,
    MoeConfig,
)
from ..config.hf import required
from ..config.registry import add_presets, register
from ..config.tensors import (
    GATED_MLP_TENSORS,
    NORM_TENSORS,
    HFTensor,
    mla_tensors,
    sparse_ffn_tensors,
    whole_model_names,
)
from ..decoder.moe import MoeDecoderLayer
from ..inputs.rows import TokenRows
from ..layers.attention.latent import LatentCache
from ..layers.mixers.gated_deltanet import DeltaCache
from ..layers.mixers.kimi_delta import KimiDeltaAttention
from .deepseek import TINY as DEEPSEEK_TINY
from .deepseek import DeepseekCausalLM

ARCHITECTURE = "KimiLinearForCausalLM"
NO_ROPE_THETA = 10_000.0
"""The RoPE base a Kimi-Linear config carries: its latent attention rotates nothing
(`MlaConfig.rotary` false), so the value is never read."""
LINEAR, FULL = "linear_attention", "full_attention"
# transformers' `KimiLinearConfig.attribute_map`: a config.json may hold either name
# (`read_hf_config` gives the reader both); the reader reads the first.
ALIASES = {
    "num_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "num_shared_experts": "n_shared_experts",
    "model_max_length": "max_position_embeddings",
}


def read_kimi_layers(config: Mapping[str, Any], layers: int) -> tuple[bool, ...]:
    """Per layer, True for Kimi Delta Attention: `layer_types`, else the checkpoint's
    `linear_attn_config` (`kda_layers` / `full_attn_layers`, 1-indexed), else every fourth
    layer from layer 4 (0-indexed) attending fully, as transformers defaults.

    Raises:
      ValueError: Layer kinds of another length or kind.
    """
    kinds = config.get("layer_types")
    linear = config.get("linear_attn_config") or {}
    if kinds is None and "kda_layers" in linear:
        full = {index - 1 for index in linear.get("full_attn_layers", ())}
        kinds = [FULL if i in full else LINEAR for i in range(layers)]
    if kinds is None:
        return tuple(not (i and i % 4 == 0) for i in range(layers))
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {LINEAR, FULL}:
        raise ValueError(
            f"layer_types must name {LINEAR!r} or {FULL!r} for each of the {layers} layers; "
            f"got {kinds!r}"
        )
    return tuple(kind == LINEAR for kind in kinds)


def read_kimi_linear(config: Mapping[str, Any]) -> DecoderConfig:
    """Reads a `KimiLinearForCausalLM` `config.json` (as a dict), in transformers' keys or the
    checkpoint's (`linear_attn_config`, the `ALIASES`).

    Raises:
      ValueError: A missing key, bad layer kinds, dense layers other than the first ones.
      NotImplementedError: Attention biases, kv heads other than the heads, or an activation
        other than SiLU.
    """
    if config.get("attention_bias") or config.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(
            "KimiLinearForCausalLM with attention_bias or a hidden_act other than silu is not "
            "supported"
        )
    heads = required(config, "num_attention_heads")
    if config.get("num_key_value_heads") not in (None, heads):
        raise NotImplementedError(
            "latent attention expands every head's key and value; num_key_value_heads must be "
            f"num_attention_heads ({heads}); got {config['num_key_value_heads']}"
        )
    layers = required(config, "num_hidden_layers")
    hidden = required(config, "hidden_size")
    linear = config.get("linear_attn_config") or {}
    eps = float(config.get("rms_norm_eps", 1e-5))
    delta = KimiDeltaSpec(
        hidden_size=hidden,
        num_heads=linear.get("num_heads", config.get("linear_num_heads", 32)),
        head_dim=linear.get("head_dim", config.get("linear_head_dim", 128)),
        conv_kernel=linear.get("short_conv_kernel_size", config.get("linear_conv_kernel_dim", 4)),
        eps=eps,
    )
    mla = MlaConfig(
        hidden_size=hidden,
        num_heads=heads,
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=required(config, "kv_lora_rank"),
        qk_nope_head_dim=required(config, "qk_nope_head_dim"),
        qk_rope_head_dim=required(config, "qk_rope_head_dim"),
        v_head_dim=required(config, "v_head_dim"),
        rope_theta=NO_ROPE_THETA,
        rotary=False,
    )
    experts = config.get("num_experts")
    width = required(config, "moe_intermediate_size")
    routing = DeepseekRouting(
        experts,
        config.get("num_experts_per_token"),
        ExpertScoring.SIGMOID,
        num_groups=config.get("num_expert_group") or 1,
        topk_groups=config.get("topk_group") or 1,
        group_score=GroupScore.TOP2_SUM,
        correction_bias=True,
        renormalize=bool(config.get("moe_renormalize", True)),
        scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
    )
    kinds = config.get("mlp_layer_types")
    if kinds is None:  # transformers' default: first_k_dense_replace dense layers
        first = config.get("first_k_dense_replace", 1)
        kinds = ["dense" if index < first else "sparse" for index in range(layers)]
    if len(kinds) != layers or not set(kinds) <= {"dense", "sparse"}:
        raise ValueError(
            f"Kimi-Linear's mlp_layer_types names each of the {layers} layers 'dense' or "
            f"'sparse'; got {kinds}"
        )
    dense = tuple(index for index, kind in enumerate(kinds) if kind == "dense")
    shared = config.get("num_shared_experts") or 0
    return DecoderConfig(
        architecture=ARCHITECTURE,
        vocab_size=required(config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=required(config, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=mla.qk_head_dim,
        rms_norm_eps=eps,
        rope_theta=NO_ROPE_THETA,
        rope_scaling=None,
        qk_norm=False,
        # transformers' KimiLinearForCausalLM never ties its head, whatever the key says: it
        # reads the checkpoint's lm_head.weight.
        tie_word_embeddings=False,
        sliding_window=None,
        max_position_embeddings=config.get("model_max_length"),
        moe=MoeConfig(
            num_experts=experts,
            top_k=routing.top_k,
            expert_intermediate_size=width,
            renormalize=routing.renormalize,
            shared_expert_intermediate_size=shared * width or None,
            mlp_only_layers=dense,
            routing=routing,
        ),
        mla=mla,
        linear_attention=LinearAttentionLayers(delta, read_kimi_layers(config, layers)),
    )


def write_kimi_linear(config: DecoderConfig) -> dict[str, Any]:
    """The `config.json` (as a dict, in transformers' keys) `read_kimi_linear` reads back."""
    mla, moe, linear = config.mla, config.moe, config.linear_attention
    routing = moe.routing
    return {
        "architectures": [config.architecture],
        "model_type": "kimi_linear",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "layer_types": [LINEAR if kind else FULL for kind in linear.layers],
        "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "linear_num_heads": linear.spec.num_heads,
        "linear_head_dim": linear.spec.head_dim,
        "linear_conv_kernel_dim": linear.spec.conv_kernel,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": False,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_layer_types": ["sparse" if sparse else "dense" for sparse in config.sparse_layers],
        "moe_intermediate_size": moe.expert_intermediate_size,
        "num_experts": routing.num_experts,
        "num_experts_per_token": routing.top_k,
        "num_shared_experts": (moe.shared_expert_intermediate_size or 0)
        // moe.expert_intermediate_size,
        "num_expert_group": routing.num_groups,
        "topk_group": routing.topk_groups,
        "moe_renormalize": routing.renormalize,
        "routed_scaling_factor": routing.scaling_factor,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
    }


def kimi_delta_tensors() -> dict[str, HFTensor]:
    """A `KimiDeltaAttention` held as the layer's `attn`, from HF `self_attn.*`
    (layer-relative)."""
    projections = {
        f"attn.{name}.kernel": HFTensor(f"self_attn.{name}.weight", transpose=True)
        for name in ("f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")
    }
    return projections | {
        "attn.qkv_proj.kernel": HFTensor(
            "self_attn.{part}_proj.weight", transpose=True, parts=("q", "k", "v"), part_axis=1
        ),
        "attn.conv.weight": HFTensor(
            "self_attn.{part}_conv1d.weight", parts=("q", "k", "v"), part_axis=0
        ),
        "attn.dt_bias": HFTensor("self_attn.dt_bias"),
        "attn.a_log": HFTensor("self_attn.A_log"),
        "attn.norm_weight": HFTensor("self_attn.o_norm.weight"),
    }


def _in_block_sparse_moe(tensors: dict[str, HFTensor]) -> dict[str, HFTensor]:
    """The FFN's tensors under the checkpoint's `block_sparse_moe.` in place of `mlp.`."""
    return {
        path: dataclasses.replace(tensor, name="block_sparse_moe." + tensor.name[len("mlp.") :])
        for path, tensor in tensors.items()
    }


class KimiLinearLayer(MoeDecoderLayer):
    """A decoder layer whose token mixer (`attn`) is Kimi Delta Attention or latent
    attention."""

    def attend(
        self,
        h: jax.Array,
        rows: TokenRows,
        cache: DeltaCache | LatentCache | None,
        stream: bj.ResidualStream,
    ) -> tuple[jax.Array, DeltaCache | LatentCache | None]:
        if isinstance(self.attn, KimiDeltaAttention):
            return self.attn(h, rows.positions, rows.segment_ids, cache, phase=rows.phase)
        return super().attend(h, rows, cache, stream)


@register
class KimiLinearForCausalLM(DeepseekCausalLM):
    """Kimi-Linear: Kimi Delta Attention and NoPE latent attention layers, DeepSeek's MoE. As
    DeepSeek's (`DeepseekCausalLM`), without FP8, scanned layers or attention CP; as pipeline
    stages, each stage holds its layers' latent caches and delta states."""

    architectures = (ARCHITECTURE,)
    model_type = "kimi_linear"
    config_aliases = ALIASES
    # transformers' KimiLinearConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "kv_lora_rank": 512,
        "linear_conv_kernel_dim": 4,
        "linear_head_dim": 128,
        "linear_num_heads": 32,
        "model_max_length": 1048576,
        "moe_intermediate_size": 1024,
        "moe_renormalize": True,
        "num_attention_heads": 32,
        "num_expert_group": 1,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_hidden_layers": 27,
        "num_key_value_heads": 32,
        "num_shared_experts": 1,
        "pad_token_id": 163839,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-05,
        "routed_scaling_factor": 2.446,
        "topk_group": 1,
        "v_head_dim": 128,
        "vocab_size": 163840,
    }
    layer_class = KimiLinearLayer
    dense_layers_first = False  # mlp_layer_types names each layer's kind
    hyper_connections = False
    captures_hidden_states = False
    ties_head = False

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        return read_kimi_linear(hf_config)

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return write_kimi_linear(config)

    @classmethod
    def check_config(cls, config: DecoderConfig) -> None:
        """DeepSeek's facts, and Kimi Delta Attention on its linear layers."""
        super().check_config(config)
        linear = config.linear_attention
        if linear is None or not isinstance(linear.spec, KimiDeltaSpec):
            raise ValueError(
                f"{config.architecture} needs linear_attention with a KimiDeltaSpec; got {linear!r}"
            )

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        """Per layer its norms, its mixer (`self_attn.*`: Kimi Delta Attention's or latent
        attention's) and its FFN (`block_sparse_moe.*`)."""
        config.layer_blocks(scan_layers)  # raises for scanned layers
        sparse = sparse_ffn_tensors(config, experts=("w1", "w3", "w2"), shared="shared_experts")
        names = {}
        for index, linear in enumerate(config.linear_attention.layers):
            mixer = kimi_delta_tensors() if linear else mla_tensors(config.mla)
            ffn = sparse if config.sparse_layers[index] else GATED_MLP_TENSORS
            layer = NORM_TENSORS[config.residual_design] | mixer | _in_block_sparse_moe(ffn)
            for path, tensor in layer.items():
                names[f"layers.{index}.{path}"] = dataclasses.replace(
                    tensor, name=f"model.layers.{index}.{tensor.name}"
                )
        return whole_model_names(config, names)

    def make_layer(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Layer `index`: Kimi Delta Attention (in place of latent attention) or latent
        attention, each with its FFN."""
        linear = self.config.linear_attention
        if not linear.layers[index]:
            return super().make_layer(index, dtype=dtype, rngs=rngs)
        mixer = KimiDeltaAttention(linear.spec, topology=self.topology, dtype=dtype, rngs=rngs)
        return self.layer_class(
            mixer,
            self.make_mlp(index, dtype=dtype, rngs=rngs),
            design=self.design,
            declare=lambda stages: self.stage_facts(index, stages),
            dtype=dtype,
            rngs=rngs,
        )

    def _linear(self, index: int) -> bool:
        return self.config.linear_attention.layers[index]

    def cache_specs(self) -> tuple:
        """Per layer, its decode state's `PartitionSpec` tree."""
        return tuple(
            DeltaCache.specs(self.topology)
            if self._linear(index)
            else LatentCache.specs(self.topology)
            for index in self.layer_range
        )

    def new_caches(
        self, *, slots: int, max_len: int, dtype: jnp.dtype, mesh: Mesh | None = None
    ) -> tuple[DeltaCache | LatentCache, ...]:
        """Per layer, a zero decode state for `slots` sequences: the latent cache of `max_len`
        positions, or Kimi Delta Attention's conv and float32 state."""
        config, topology = self.config, self.topology
        spec = config.linear_attention.spec.cache_spec()
        return tuple(
            DeltaCache.create(spec, topology, slots=slots, dtype=dtype, mesh=mesh)
            if self._linear(index)
            else LatentCache.create(
                config.mla, topology, slots=slots, max_len=max_len, dtype=dtype, mesh=mesh
            )
            for index in self.layer_range
        )

    def token_cache_layers(self) -> int:
        """The latent-attention layers (each keeps a latent cache)."""
        return self.config.linear_attention.layers.count(False)

    def state_bytes_per_slot(self, dtype: jnp.dtype) -> int:
        """Each Kimi Delta Attention layer's conv inputs and float32 state of one slot on one
        device, over the layers."""
        linear = self.config.linear_attention
        one = DeltaCache.bytes_per_slot(linear.spec.cache_spec(), self.topology, dtype)
        return one * linear.layers.count(True)


# Kimi-Linear: DeepSeek-V3's small stack (`tiny-deepseek-v3`) with 4 heads, unrotated latent
# attention on layers 2 and 3, Kimi Delta Attention (4 heads of 8) on 0, 1 and 4; a dense first
# layer, then 8 experts (top 2 of the best group of 2) with the correction bias and a shared
# expert.
TINY = dataclasses.replace(
    DEEPSEEK_TINY,
    architecture=ARCHITECTURE,
    intermediate_size=96,
    num_layers=5,
    num_heads=4,
    num_kv_heads=4,
    rms_norm_eps=1e-5,
    rope_scaling=None,
    mla=dataclasses.replace(DEEPSEEK_TINY.mla, num_heads=4, rope_scaling=None, rotary=False),
    linear_attention=LinearAttentionLayers(
        KimiDeltaSpec(hidden_size=64, num_heads=4, head_dim=8), (True, True, False, False, True)
    ),
    moe=dataclasses.replace(
        DEEPSEEK_TINY.moe,
        expert_intermediate_size=16,
        shared_expert_intermediate_size=16,
        routing=dataclasses.replace(DEEPSEEK_TINY.moe.routing, num_groups=2, topk_groups=1),
    ),
)
add_presets({"tiny-kimi-linear": TINY})
