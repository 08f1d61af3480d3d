"""LongCat-Flash (Hugging Face `LongcatFlashForCausalLM`) built only from stage boundaries, its
shortcut-connected MoE a branch of the residual stream; with its `config.json` reader and writer
and tensor names.

A layer, as transformers' `LongcatFlashDecoderLayer`:

    x1 = x + attn_0(input_norm_0(x))
    h = post_attn_norm_0(x1)
    x2 = x1 + mlps_0(h)                      # the dense branch reads the MoE's input
    x3 = x2 + attn_1(input_norm_1(x2))
    out = x3 + mlps_1(post_attn_norm_1(x3)) + mlp(h)    # the MoE's output joins at the end

The main chain is the latent attention `attn_0` and the MoE `mlp` (DeepSeek's MoE with LongCat's
router: softmax, correction bias, zero-computation experts); the model's `stage_facts` lists only
these two. The dense FFN `mlps_0`, the latent attention `attn_1` and the dense FFN `mlps_1` are a
branch appended with `prepared_from=` the MoE stage: `branch_input` hands `mlps_0` the MoE's
normalized input `h` (moved onto the dense FFN's rows, never normalized twice: the branch's first
norm, the MoE's own, is never applied) and forks the residual the MoE's read wrote (`x1`); the
branch's stages add into their own residual (`x2`, `x3`, ...), `branch_output` completes what
the branch's output owes where the merge cannot take it unsummed, and `merge_branch` adds the
MoE's output to the branch's residual: the next layer's input completes both sums in the one
collective it runs anyway.

Each layer holds two latent caches (`LongcatCache`), one per attention.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import boundary_jax as bj

from ..config import DecoderConfig, DeepseekRouting, ExpertScoring, MlaConfig, MoeConfig
from ..config.registry import add_presets, register
from ..config.rope_scaling import read_latent_rope, rope_parameters
from ..config.tensors import (
    GATED_MLP_TENSORS,
    HFTensor,
    mla_tensors,
    sparse_ffn_tensors,
    whole_model_names,
)
from ..decoder.designs import StageDesigns
from ..decoder.layer import AttentionFirstLayer, attend_rows
from ..decoder.moe import MoeCausalLM
from ..inputs.rows import TokenRows
from ..layers.attention.latent import LatentCache, MultiHeadLatentAttention
from ..layers.mlp import SwiGLU
from ..layers.moe.deepseek_router import DeepseekMoeFfn
from ..layers.moe.ffn import replicated_parts
from ..layers.moe.sparse import GroupedMatmulImpl
from ..options import BuildOptions

ARCHITECTURE = "LongcatFlashForCausalLM"
_SKIPPED = re.compile(r"model\.(mtp\.|layers\.\d+\.mlp\.experts\.(\d+)\.)")

MODEL_TYPE = "longcat_flash"
DEFAULT_HEAD_DIM = 64
"""`LongcatFlashConfig.head_dim` when the file has none: the dimension its RoPE rotates."""


def read_longcat_config(config: Mapping[str, Any]) -> DecoderConfig:
    """Reads a LongCat-Flash `config.json` (as a dict) into a `DecoderConfig` with its `mla`
    attention (`lora_scaled`) and its `moe.routing` rule (`zero_experts`); `num_layers` is
    LongCat's layer count, `intermediate_size` the dense FFNs' width.

    Raises:
      ValueError: Another `model_type`, a required key missing, or what transformers does not
        run: a hidden activation other than SiLU, attention biases, kv heads other than the
        query heads, a RoPE dimension (`head_dim`) other than `qk_rope_head_dim`, LoRA scales
        switched off, zero-computation experts other than the identity, or a router bias
        (transformers builds `classifier.bias` and never adds it; LongCat's own code adds it:
        refusing to guess).
    """
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"LongcatFlashForCausalLM needs model_type {MODEL_TYPE!r}; got "
            f"{config.get('model_type')!r}"
        )
    layers = config.get("num_layers")
    if layers is None and config.get("num_hidden_layers") is not None:
        layers = config["num_hidden_layers"] // 2  # transformers' setter
    required = (
        "vocab_size",
        "hidden_size",
        "num_attention_heads",
        "ffn_hidden_size",
        "expert_ffn_hidden_size",
        "n_routed_experts",
        "moe_topk",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
    )
    missing = [key for key in required if config.get(key) is None]
    if layers is None or missing:
        raise ValueError(
            f"config.json has no {missing + ['num_layers'] * (layers is None)}; they are "
            "required to build the decoder"
        )
    _check_unsupported(config)
    theta, scaling = read_latent_rope(config)
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads") not in (None, heads):
        raise ValueError(
            "MLA expands every head's key and value from the latent; num_key_value_heads "
            f"must equal num_attention_heads ({heads}); got {config['num_key_value_heads']}"
        )
    mla = MlaConfig(
        hidden_size=config["hidden_size"],
        num_heads=heads,
        q_lora_rank=config["q_lora_rank"],
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleaved=True,
        lora_scaled=True,
    )
    routing = DeepseekRouting(
        config["n_routed_experts"],
        config["moe_topk"],
        ExpertScoring.SOFTMAX,
        correction_bias=True,
        scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        zero_experts=config.get("zero_expert_num") or 0,
    )
    return DecoderConfig(
        architecture=ARCHITECTURE,
        vocab_size=config["vocab_size"],
        hidden_size=mla.hidden_size,
        intermediate_size=config["ffn_hidden_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=mla.qk_head_dim,
        rms_norm_eps=float(config["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=False,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=None,
        max_position_embeddings=config["max_position_embeddings"],
        moe=MoeConfig(
            num_experts=routing.num_experts,
            top_k=routing.top_k,
            expert_intermediate_size=config["expert_ffn_hidden_size"],
            renormalize=False,
            routing=routing,
        ),
        mla=mla,
        initializer_range=float(config.get("initializer_range", 0.02)),
    )


def _check_unsupported(config: Mapping[str, Any]) -> None:
    """Raises for a LongCat-Flash option transformers computes otherwise than the file says."""
    checks = {
        "hidden_act": ("silu", "silu"),
        "attention_bias": (False, False),
        "mla_scale_q_lora": (True, True),
        "mla_scale_kv_lora": (True, True),
        "zero_expert_type": ("identity", "identity"),
        "router_bias": (False, False),
    }
    for key, (default, runs) in checks.items():
        if config.get(key, default) != runs:
            raise ValueError(
                f"LongcatFlashForCausalLM with {key}={config[key]!r} is not supported "
                f"(transformers runs {key}={runs!r}); use a checkpoint without it"
            )
    rope = config.get("qk_rope_head_dim")
    if config.get("head_dim", DEFAULT_HEAD_DIM) != rope:
        raise ValueError(
            "transformers' LongCat-Flash rotates head_dim dimensions of the rope part; "
            f"head_dim ({config.get('head_dim', DEFAULT_HEAD_DIM)}) must equal "
            f"qk_rope_head_dim ({rope})"
        )


def write_longcat_config(config: DecoderConfig) -> dict[str, Any]:
    """The Hugging Face `config.json` (as a dict) of a LongCat-Flash `config`, in transformers
    5's format; `read_longcat_config` reads it back."""
    mla, moe = config.mla, config.moe
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope_parameters(mla.rope_theta, mla.rope_scaling),
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "ffn_hidden_size": config.intermediate_size,
        "expert_ffn_hidden_size": moe.expert_intermediate_size,
        "n_routed_experts": moe.num_experts,
        "zero_expert_num": moe.zero_experts,
        "moe_topk": moe.top_k,
        "routed_scaling_factor": moe.routing.scaling_factor,
        "initializer_range": config.initializer_range,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
    }


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["attn_0", "attn_1"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class LongcatCache:
    """One LongCat-Flash layer's decode cache: the latent cache of each of its two attentions.

    Attributes:
      attn_0: The first attention's `LatentCache` (its `PartitionSpec` in a spec tree).
      attn_1: The second attention's.
    """

    attn_0: LatentCache
    attn_1: LatentCache


class LongcatDecoderLayer(AttentionFirstLayer):
    """Two latent attentions, two dense FFNs and one MoE: the attention and the MoE on the main
    chain, the dense FFN, attention and dense FFN a branch prepared from the MoE's input.

    Attributes (HF names in parentheses):
      attn_0, attn_1: `MultiHeadLatentAttention` (`self_attn.0`, `self_attn.1`).
      mlp: The MoE, `DeepseekMoeFfn` (`mlp`).
      mlps_0, mlps_1: Dense `SwiGLU`s over the full TP group (`mlps.0`, `mlps.1`).
      input_norm_0, post_attn_norm_0, input_norm_1, post_attn_norm_1: The stages' RMSNorms
        (`input_layernorm.{0,1}`, `post_attention_layernorm.{0,1}`); `post_attn_norm_0` is the
        MoE's and (never applied) the branch's first.
      attn_boundary, moe_boundary: The main chain's boundaries.
      mlps_0_boundary, attn_1_boundary, mlps_1_boundary: The branch's.
    """

    def __init__(
        self,
        config: DecoderConfig,
        topology: bj.Topology,
        main: tuple[bj.StageDeclaration, bj.StageDeclaration],
        *,
        moe_dispatch: bj.MoeDispatch,
        moe_capacity: int | None,
        grouped_matmul: GroupedMatmulImpl,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        attn = functools.partial(
            MultiHeadLatentAttention, config.mla, topology=topology, dtype=dtype, rngs=rngs
        )
        dense = functools.partial(
            SwiGLU,
            config.hidden_size,
            config.intermediate_size,
            topology=topology,
            dtype=dtype,
            init_std=config.initializer_range,
            rngs=rngs,
        )
        norm = functools.partial(
            bj.RMSNorm, config.hidden_size, eps=config.rms_norm_eps, param_dtype=dtype
        )
        self.attn_0, self.attn_1 = attn(), attn()
        self.mlp = DeepseekMoeFfn(
            config.hidden_size,
            config.moe,
            topology,
            dispatch=moe_dispatch,
            capacity=moe_capacity,
            impl=grouped_matmul,
            dtype=dtype,
            rngs=rngs,
        )
        self.mlps_0, self.mlps_1 = dense(), dense()
        self.input_norm_0, self.post_attn_norm_0 = norm(), norm()
        self.input_norm_1, self.post_attn_norm_1 = norm(), norm()
        attn_stage, moe_stage = main
        self.attn_boundary, self.moe_boundary = bj.append_stages(
            (attn_stage, self.input_norm_0), (moe_stage, self.post_attn_norm_0), owner=self
        )
        self.mlps_0_boundary, self.attn_1_boundary, self.mlps_1_boundary = bj.append_stages(
            (bj.declare_ffn(), self.post_attn_norm_0),  # never applied: the MoE's input is read
            (bj.declare_attn(), self.input_norm_1),
            (bj.declare_ffn(), self.post_attn_norm_1),
            owner=self,
            prepared_from=self.moe_boundary,
        )

    def stages(self) -> tuple[tuple[str, bj.StageBoundary], ...]:
        """The layer's stage boundaries by name: the main chain, then the branch."""
        return (
            ("attention", self.attn_boundary),
            ("moe", self.moe_boundary),
            ("branch ffn 0", self.mlps_0_boundary),
            ("branch attention", self.attn_1_boundary),
            ("branch ffn 1", self.mlps_1_boundary),
        )

    def run_stages(
        self, h: jax.Array, stream: bj.ResidualStream, rows: TokenRows, cache: LongcatCache | None
    ) -> tuple[bj.OwedOutput, bj.ResidualStream, LongcatCache | None]:
        """The layer after its first attention's input: attention, the MoE's input, the branch
        forked from it, the MoE, the branch's stages, and the merge."""
        y, cache_0 = attend_rows(
            self.attn_0,
            h,
            rows,
            None if cache is None else cache.attn_0,
            self.attn_boundary,
            stream,
        )
        x, stream = self.attn_boundary.finish(y, stream)
        h, stream = self.moe_boundary.prepare(x, stream)
        g, stream, branch = bj.adapters.branch_input(
            self.mlps_0_boundary, self.moe_boundary, h, stream
        )
        exit = self.moe_boundary.exit(stream)
        y = self.mlp(h, defer=exit.defer_moe_finalize, counts=exit.counts)
        x, stream = exit.finish(y, stream)
        y, branch = self.mlps_0_boundary.finish(self.mlps_0(g), branch)
        g, branch = self.attn_1_boundary.prepare(y, branch)
        y, cache_1 = attend_rows(
            self.attn_1,
            g,
            rows,
            None if cache is None else cache.attn_1,
            self.attn_1_boundary,
            branch,
        )
        y, branch = self.attn_1_boundary.finish(y, branch)
        g, branch = self.mlps_1_boundary.prepare(y, branch)
        y, branch = self.mlps_1_boundary.finish(self.mlps_1(g), branch)
        y, branch = bj.adapters.branch_output(self.mlps_1_boundary, y, branch)
        x, stream = bj.adapters.merge_branch(x, stream, y, branch)
        return x, stream, None if cache is None else LongcatCache(cache_0, cache_1)


@register
class LongcatFlashForCausalLM(MoeCausalLM):
    """LongCat-Flash: layers of two latent attentions, two dense FFNs and a shortcut MoE with
    zero-computation experts, the dense FFN, attention and dense FFN a branch of the MoE's
    input (`LongcatDecoderLayer`). Every layer is sparse.

    Not built (each rejected when the model is built): hyper-connections, scanned runs of
    layers and FP8; a stack with branches binds no input-scattered path. As pipeline stages,
    each stage holds its layers' two latent caches each.
    """

    architectures = (ARCHITECTURE,)
    model_type = "longcat_flash"
    # transformers' attribute_map: two names config.json may give one key.
    config_aliases = {
        "num_local_experts": "n_routed_experts",
        "num_experts_per_tok": "moe_topk",
        "intermediate_size": "ffn_hidden_size",
        "moe_intermediate_size": "expert_ffn_hidden_size",
    }
    # transformers' LongcatFlashConfig defaults: a key config.json leaves out reads as there
    # (but num_layers: a file may give num_hidden_layers instead, twice the layers).
    config_defaults = {
        "rope_theta": 10000000.0,
        "routed_scaling_factor": 6.0,
        "zero_expert_num": 256,
    }
    quantizable = False
    hyper_connections = False

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        return read_longcat_config(hf_config)

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return write_longcat_config(config)

    @classmethod
    def check_config(cls, config: DecoderConfig) -> None:
        """A LongCat-Flash config has latent attention and a router with zero-computation
        experts' room (`moe.routing`)."""
        super().check_config(config)
        if config.mla is None or config.moe.routing is None:
            raise ValueError(
                f"{config.architecture}: multi-head latent attention (mla) and its router "
                f"(moe.routing) are its facts; got mla={config.mla!r}, moe={config.moe!r}"
            )

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        """Per layer, the attentions `attn_{0,1}` and dense FFNs `mlps_{0,1}` from
        `self_attn.{0,1}` and `mlps.{0,1}`, their norms `input_norm_{0,1}` and
        `post_attn_norm_{0,1}` from `input_layernorm.{0,1}` and `post_attention_layernorm.{0,1}`,
        and the MoE `mlp` (its router from `mlp.router.classifier.weight` and
        `mlp.router.e_score_correction_bias`)."""
        if scan_layers:
            raise NotImplementedError(
                "scanned runs of LongCat-Flash layers are not supported: build it without "
                "scan_layers"
            )
        layer = sparse_ffn_tensors(config, shared="shared_experts")
        layer["mlp.router"] = HFTensor("mlp.router.classifier.weight", transpose=True)
        layer["mlp.e_score_correction_bias"] = HFTensor("mlp.router.e_score_correction_bias")
        for index in (0, 1):
            for path, tensor in mla_tensors(config.mla).items():
                name = tensor.name.replace("self_attn.", f"self_attn.{index}.")
                path = path.replace("attn.", f"attn_{index}.")
                layer[path] = dataclasses.replace(tensor, name=name)
            for path, tensor in GATED_MLP_TENSORS.items():
                name = tensor.name.replace("mlp.", f"mlps.{index}.")
                layer[path.replace("mlp.", f"mlps_{index}.")] = dataclasses.replace(
                    tensor, name=name
                )
            layer[f"input_norm_{index}.weight"] = HFTensor(f"input_layernorm.{index}.weight")
            layer[f"post_attn_norm_{index}.weight"] = HFTensor(
                f"post_attention_layernorm.{index}.weight"
            )
        layers = {
            f"layers.{i}.{path}": dataclasses.replace(
                tensor, name=f"model.layers.{i}.{tensor.name}"
            )
            for i in range(config.num_layers)
            for path, tensor in layer.items()
        }
        return whole_model_names(config, layers)

    @classmethod
    def unread_tensors(
        cls, config: DecoderConfig, names: Iterable[str]
    ) -> tuple[tuple[str, ...], str | None]:
        """The multi-token-prediction head (`model.mtp.*`, which transformers ignores too) and
        the weights of zero-computation experts (`mlp.experts.{e}.*` with e >=
        n_routed_experts: transformers 5 holds `gate_up_proj` for every expert and
        `save_pretrained` writes those rows)."""
        unread = []
        for name in names:
            found = _SKIPPED.match(name)
            expert = None if found is None else found.group(2)
            if found is not None and (expert is None or int(expert) >= config.moe.num_experts):
                unread.append(name)
        if not unread:
            return (), None
        notice = (
            f"ignoring {len(unread)} tensors the causal LM never reads (zero-computation "
            f"experts' weights, the multi-token-prediction head), e.g. {sorted(unread)[0]}"
        )
        return tuple(unread), notice

    @classmethod
    def check_build(
        cls, config: DecoderConfig, topology: bj.Topology, options: BuildOptions
    ) -> None:
        if options.hyper_connections is not None or options.scan_layers:
            asked = [
                name
                for name, given in (
                    ("hyper_connections", options.hyper_connections is not None),
                    ("scan_layers", options.scan_layers),
                )
                if given
            ]
            raise NotImplementedError(
                f"LongcatFlashForCausalLM is not built with {asked}; build it without them"
            )
        super().check_build(config, topology, options)

    def stage_facts(
        self, layer_index: int, stages: StageDesigns | None = None
    ) -> tuple[bj.StageDeclaration, ...]:
        """The main chain of every layer: the first attention, then the MoE (the branch's stages
        are no neighbour of another layer's)."""
        del layer_index, stages
        parts = replicated_parts(self.config.moe, self.topology, self.moe_dispatch)
        return bj.declare_attn(), bj.declare_ffn(
            sparse=True, moe_dispatch=self.moe_dispatch, replicated=parts
        )

    def make_layer(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Decoder layer `index` (inside the open layer stack)."""
        return LongcatDecoderLayer(
            self.config,
            self.topology,
            self.stage_facts(index),
            moe_dispatch=self.moe_dispatch,
            moe_capacity=self.options.moe_capacity,
            grouped_matmul=self.grouped_matmul,
            dtype=dtype,
            rngs=rngs,
        )

    def block_cache_specs(self, *, stacked: bool = False) -> LongcatCache:
        """The `PartitionSpec` tree of one layer's two latent caches."""
        spec = LatentCache.specs(self.topology, stacked=stacked)
        return LongcatCache(spec, spec)

    def block_cache(
        self, *, slots: int, max_len: int, dtype: jnp.dtype, mesh: Mesh | None, layers: int | None
    ) -> LongcatCache:
        """One layer's two zero latent caches, as `LatentCache.create` makes them."""
        make = functools.partial(
            LatentCache.create,
            self.config.mla,
            self.topology,
            slots=slots,
            max_len=max_len,
            dtype=dtype,
            mesh=mesh,
            layers=layers,
        )
        return LongcatCache(make(), make())

    def cache_bytes_per_token(self, dtype: jnp.dtype) -> int:
        """`2 * (kv_lora_rank + qk_rope_head_dim) * itemsize`: one token of one layer's two
        latent caches on one device."""
        return 2 * LatentCache.bytes_per_token(self.config.mla, dtype)


# LongCat-Flash-style: two layers, each two latent attentions with LongCat's LoRA scales, two dense
# FFNs and a MoE of 8 routed and 4 zero-computation experts (top-3, softmax with a correction
# bias, scaled by 6).
TINY_MLA = MlaConfig(
    hidden_size=64,
    num_heads=8,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_theta=1e4,
    lora_scaled=True,
)
TINY_ROUTING = DeepseekRouting(
    num_experts=8,
    top_k=3,
    scoring=ExpertScoring.SOFTMAX,
    correction_bias=True,
    scaling_factor=6.0,
    zero_experts=4,
)
add_presets(
    {
        "tiny-longcat-flash": DecoderConfig(
            architecture=ARCHITECTURE,
            vocab_size=256,
            hidden_size=TINY_MLA.hidden_size,
            intermediate_size=128,
            num_layers=2,
            num_heads=TINY_MLA.num_heads,
            num_kv_heads=TINY_MLA.num_heads,
            head_dim=TINY_MLA.qk_head_dim,
            rms_norm_eps=1e-6,
            rope_theta=TINY_MLA.rope_theta,
            rope_scaling=None,
            qk_norm=False,
            tie_word_embeddings=False,
            sliding_window=None,
            max_position_embeddings=128,
            moe=MoeConfig(
                num_experts=TINY_ROUTING.num_experts,
                top_k=TINY_ROUTING.top_k,
                expert_intermediate_size=32,
                renormalize=False,
                routing=TINY_ROUTING,
            ),
            mla=TINY_MLA,
        )
    }
)
