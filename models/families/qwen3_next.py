"""Qwen3-Next (Hugging Face `Qwen3NextForCausalLM`): a stack of attention + FFN layers whose token
mixer is Gated DeltaNet (`linear_attention`) on most layers and gated full attention on the
others, with a softmax top-k MoE whose shared expert is sigmoid-gated, and `1 + w` RMSNorms.

Each layer is two stages, as every decoder layer here: the token mixer, then the FFN. A Gated
DeltaNet mixer is declared as attention is (`declare_attn`): it reads its own rows, complete and
alike on every attention-TP rank, splits its heads over attention TP and leaves its out_proj
partial sum to its exit, which binding completes as for attention (fused with the FFN's add +
norm, or handed on); it holds a fixed-size state per sequence slot (`DeltaCache`) instead of a
KV cache. Full attention multiplies its output by the sigmoid of a per-head gate from q_proj,
rotates only the first `partial_rotary_factor` of each head, and norms q and k by `1 + w`.
The layer kinds come from `layer_types`, else every `full_attention_interval`-th layer attends.
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
    Activation,
    DecoderConfig,
    DeltaProjections,
    GatedDeltaNetSpec,
    LinearAttentionLayers,
    MoeConfig,
)
from ..config.hf import (
    attention_bias,
    plain_decoder,
    plain_decoder_json,
    plain_moe,
    plain_moe_json,
    read_activation,
    required,
)
from ..config.registry import add_presets, register
from ..config.tensors import (
    GATED_MLP_TENSORS,
    NORM_TENSORS,
    HFTensor,
    attention_tensors,
    sparse_ffn_tensors,
    whole_model_names,
)
from ..decoder.moe import MoeCausalLM, MoeDecoderLayer
from ..inputs.rows import TokenRows
from ..layers.attention.kv_cache import KVCache
from ..layers.attention.self_attention import HeadSplit
from ..layers.mixers.gated_deltanet import DeltaCache, GatedDeltaNet
from ..options import BuildOptions

Cache = KVCache | DeltaCache | None
"""A layer's decode state: full attention's KV cache or Gated DeltaNet's conv and delta state."""

LINEAR, FULL = "linear_attention", "full_attention"


def read_layer_kinds(config: Mapping[str, Any], layers: int) -> tuple[bool, ...]:
    """Per layer, True for Gated DeltaNet: `layer_types`, else every `full_attention_interval`-th
    layer (default 4) full attention.

    Raises:
      ValueError: `layer_types` of another length or with other kinds.
    """
    kinds = config.get("layer_types")
    if kinds is None:
        interval = config.get("full_attention_interval", 4)
        return tuple(bool((i + 1) % interval) for i in range(layers))
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {LINEAR, FULL}:
        raise ValueError(
            f"layer_types must name {LINEAR!r} or {FULL!r} for each of the {layers} layers; "
            f"got {kinds!r}"
        )
    return tuple(kind == LINEAR for kind in kinds)


def read_partial_rotary(config: Mapping[str, Any], head_dim: int) -> int:
    """The rotated channels of each head: `partial_rotary_factor` (in `rope_parameters` or at
    the top level; default 0.25) of `head_dim`."""
    factor = (config.get("rope_parameters") or {}).get(
        "partial_rotary_factor", config.get("partial_rotary_factor", 0.25)
    )
    return int(head_dim * factor)


def read_qwen3_next(
    hf_config: Mapping[str, Any], architecture: str, projections: DeltaProjections
) -> DecoderConfig:
    """A Qwen3-Next-style `config.json` (as a dict): its decoder, MoE (or dense MLP, without
    experts), partial RoPE, gated attention and Gated DeltaNet layers.

    Raises:
      ValueError: A missing key, bad `layer_types`.
      NotImplementedError: Attention biases or an activation other than SiLU.
    """
    read_activation(hf_config, Activation.SILU)
    layers = required(hf_config, "num_hidden_layers")
    heads = required(hf_config, "num_attention_heads")
    head_dim = hf_config.get("head_dim") or required(hf_config, "hidden_size") // heads
    moe = None
    if hf_config.get("num_experts") != 0:  # transformers builds every FFN dense at 0
        moe = plain_moe(
            hf_config,
            architecture,
            shared_expert_intermediate_size=required(hf_config, "shared_expert_intermediate_size"),
            shared_expert_gate=True,
        )
    spec = GatedDeltaNetSpec.from_hf_config(hf_config, projections)
    return plain_decoder(
        hf_config,
        architecture,
        **attention_bias(hf_config),
        qk_norm=True,
        unit_offset_norms=True,
        rotary_dim=read_partial_rotary(hf_config, head_dim),
        attention_output_gate=True,
        linear_attention=LinearAttentionLayers(spec, read_layer_kinds(hf_config, layers)),
        moe=moe,
    )


def write_qwen3_next(config: DecoderConfig, model_type: str) -> dict[str, Any]:
    """The `config.json` (as a dict) `read_qwen3_next` reads back to `config` (a dense model
    says `num_experts: 0`)."""
    linear = config.linear_attention
    spec = linear.spec
    out = plain_decoder_json(config, model_type) | {
        "layer_types": [LINEAR if kind else FULL for kind in linear.layers],
        "linear_num_key_heads": spec.num_k_heads,
        "linear_num_value_heads": spec.num_v_heads,
        "linear_key_head_dim": spec.k_dim,
        "linear_value_head_dim": spec.v_dim,
        "linear_conv_kernel_dim": spec.conv_kernel,
    }
    out["rope_parameters"] |= {"partial_rotary_factor": config.rotary_dim / config.head_dim}
    return out | plain_moe_json(config)


def delta_net_tensors(spec: GatedDeltaNetSpec) -> dict[str, HFTensor]:
    """A `GatedDeltaNet` held as the layer's `attn`, from HF `linear_attn.*` (layer-relative):
    the projections as `spec.projections` says, the conv kernel cut by channels."""
    conv, rows = "linear_attn.conv1d.weight", spec.conv_rows
    tensors = {
        "attn.conv_qk.weight": HFTensor(
            conv, parts=("q", "k"), part_axis=0, part_rows=(rows["q"], rows["k"])
        ),
        "attn.conv_v.weight": HFTensor(conv, rows=rows["v"]),
        "attn.dt_bias": HFTensor("linear_attn.dt_bias"),
        "attn.a_log": HFTensor("linear_attn.A_log"),
        "attn.norm_weight": HFTensor("linear_attn.norm.weight"),
        "attn.out_proj.kernel": HFTensor("linear_attn.out_proj.weight", transpose=True),
    }
    if spec.projections is DeltaProjections.PER_KEY_HEAD:
        return tensors | {
            f"attn.{name}.kernel": HFTensor(f"linear_attn.{name}.weight", transpose=True)
            for name in ("in_proj_qkvz", "in_proj_ba")
        }
    key, value = spec.key_size, spec.value_size
    qkv = "linear_attn.in_proj_qkv.weight"
    return tensors | {
        "attn.in_proj_qk.kernel": HFTensor(
            qkv, transpose=True, parts=("q", "k"), part_axis=1, part_rows=((0, key), (key, 2 * key))
        ),
        "attn.in_proj_v.kernel": HFTensor(qkv, transpose=True, rows=(2 * key, 2 * key + value)),
        "attn.in_proj_z.kernel": HFTensor("linear_attn.in_proj_z.weight", transpose=True),
        "attn.in_proj_ba.kernel": HFTensor(
            "linear_attn.in_proj_{part}.weight", transpose=True, parts=("b", "a"), part_axis=1
        ),
    }


class Qwen3NextLayer(MoeDecoderLayer):
    """A decoder layer whose token mixer (`attn`) is a `GatedDeltaNet` or gated attention."""

    def attend(
        self, h: jax.Array, rows: TokenRows, cache: Cache, stream: bj.ResidualStream
    ) -> tuple[jax.Array, Cache]:
        if isinstance(self.attn, GatedDeltaNet):
            return self.attn(h, rows.positions, rows.segment_ids, cache, phase=rows.phase)
        return super().attend(h, rows, cache, stream)


class Qwen3NextBase(MoeCausalLM):
    """What Qwen3-Next and Qwen3.5 share: Gated DeltaNet and gated-attention layers, an MoE (or
    dense MLPs), `1 + w` norms; per layer a KV cache or a `DeltaCache`. Either MoE dispatch:
    the mixer stage reads its own rows as attention does, so an all-to-all FFN after it takes
    its rows as after attention. Not built: scanned layers, attention CP, FP8,
    hyper-connections and captures of hidden states."""

    layer_class = Qwen3NextLayer
    quantizable = False
    hyper_connections = False
    captures_hidden_states = False
    projections = DeltaProjections.PER_KEY_HEAD

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        return read_qwen3_next(hf_config, cls.architectures[0], cls.projections)

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return write_qwen3_next(config, cls.model_type)

    @classmethod
    def check_config(cls, config: DecoderConfig) -> None:
        """A stack with its Gated DeltaNet layers named (`linear_attention`), and experts
        exactly where the family has them."""
        super().check_config(config)
        if config.linear_attention is None:
            raise ValueError(
                f"{config.architecture} needs linear_attention (which layers are Gated "
                "DeltaNet); got None"
            )

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        """Per layer its norms, its mixer (`self_attn.*` or `linear_attn.*`) and its FFN
        (`mlp.*`: the experts and the gated shared expert, or the dense MLP)."""
        config.layer_blocks(scan_layers)  # raises for scanned layers
        linear = config.linear_attention
        full = attention_tensors(config)
        names = {}
        for index in range(config.num_layers):
            mixer = delta_net_tensors(linear.spec) if linear.layers[index] else full
            ffn = sparse_ffn_tensors(config) if config.sparse_layers[index] else GATED_MLP_TENSORS
            for path, tensor in (NORM_TENSORS[config.residual_design] | mixer | ffn).items():
                names[f"layers.{index}.{path}"] = dataclasses.replace(
                    tensor, name=f"model.layers.{index}.{tensor.name}"
                )
        return whole_model_names(config, names)

    @classmethod
    def check_build(
        cls, config: DecoderConfig, topology: bj.Topology, options: BuildOptions
    ) -> None:
        if topology.attn_cp > 1:
            raise NotImplementedError(
                f"{config.architecture} is not built under attention CP (its Gated DeltaNet "
                f"mixers carry state along each sequence); got attn_cp={topology.attn_cp}"
            )
        super().check_build(config, topology, options)

    def make_layer(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Layer `index`: a Gated DeltaNet layer (its mixer built in place of attention) or a
        gated-attention one, each with its FFN."""
        linear = self.config.linear_attention
        if not linear.layers[index]:
            return super().make_layer(index, dtype=dtype, rngs=rngs)
        mixer = GatedDeltaNet(
            linear.spec,
            topology=self.topology,
            dtype=dtype,
            init_std=self.config.initializer_range,
            rngs=rngs,
        )
        return self.layer_class(
            mixer,
            self.make_mlp(index, dtype=dtype, rngs=rngs),
            design=self.design,
            declare=lambda stages: self.stage_facts(index, stages),
            dtype=dtype,
            rngs=rngs,
        )

    def cache_specs(self) -> tuple:
        """Per layer this module holds, its decode state's `PartitionSpec` tree."""
        return tuple(
            DeltaCache.specs(self.topology) if self._linear(index) else KVCache.specs(self.topology)
            for index in self.layer_range
        )

    def _linear(self, index: int) -> bool:
        return self.config.linear_attention.layers[index]

    def new_caches(
        self, *, slots: int, max_len: int, dtype: jnp.dtype, mesh: Mesh | None = None
    ) -> tuple[Cache, ...]:
        """Per layer this module holds, a zero decode state for `slots` sequences: a KV cache
        of `max_len` positions for full attention, the conv and float32 delta state for Gated
        DeltaNet."""
        config, topology = self.config, self.topology
        spec = config.linear_attention.spec
        return tuple(
            DeltaCache.create(spec, topology, slots=slots, dtype=dtype, mesh=mesh)
            if linear
            else KVCache.create(
                config, topology, slots=slots, max_len=max_len, dtype=dtype, mesh=mesh
            )
            for linear in map(self._linear, self.layer_range)
        )

    def token_cache_layers(self) -> int:
        """The full-attention layers (each keeps a KV cache)."""
        return self.config.linear_attention.layers.count(False)

    def state_bytes_per_slot(self, dtype: jnp.dtype) -> int:
        """Each Gated DeltaNet layer's conv inputs (in `dtype`) and float32 delta state of one
        slot on one device, over the layers."""
        linear = self.config.linear_attention
        one = DeltaCache.bytes_per_slot(linear.spec, self.topology, dtype)
        return one * linear.layers.count(True)

    def cache_bytes_per_token(self, dtype: jnp.dtype) -> int:
        """Bytes one token takes in one full-attention layer's KV cache on one device."""
        heads = HeadSplit.of(self.config, self.topology)
        return 2 * heads.local_kv_heads * self.config.head_dim * jnp.dtype(dtype).itemsize


@register
class Qwen3NextForCausalLM(Qwen3NextBase):
    """Qwen3-Next: its Gated DeltaNet's projections fused per key head (`in_proj_qkvz`,
    `in_proj_ba`)."""

    architectures = ("Qwen3NextForCausalLM",)
    model_type = "qwen3_next"
    experts_optional = True
    # transformers' Qwen3NextConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 32768,
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
    }


# Qwen3-Next: Gated DeltaNet (4 key heads of 8, 8 value heads of 8) on layers 0, 1 and 4, gated
# attention (partial RoPE over 4 of 16 channels) on 2 and 3; 8 experts (top 2) with a gated
# shared expert, dense MLPs on layers 1 and 3.
TINY = DecoderConfig(
    architecture="Qwen3NextForCausalLM",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=5,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    rope_scaling=None,
    qk_norm=True,
    tie_word_embeddings=False,
    sliding_window=None,
    max_position_embeddings=128,
    unit_offset_norms=True,
    rotary_dim=4,
    attention_output_gate=True,
    linear_attention=LinearAttentionLayers(
        GatedDeltaNetSpec(hidden_size=64, num_k_heads=4, num_v_heads=8, k_dim=8, v_dim=8),
        (True, True, False, False, True),
    ),
    moe=MoeConfig(
        num_experts=8,
        top_k=2,
        expert_intermediate_size=32,
        renormalize=True,
        mlp_only_layers=(1, 3),
        shared_expert_intermediate_size=48,
        shared_expert_gate=True,
    ),
)
add_presets({"tiny-qwen3-next": TINY})
