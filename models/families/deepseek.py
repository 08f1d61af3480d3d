"""DeepSeek-V2 and DeepSeek-V3 (Hugging Face `DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`) built
only from stage boundaries: their `config.json` reader and writer, tensor names and layers.

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

import re
from collections.abc import Iterable, Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import boundary_jax as bj

from ..config import (
    DecoderConfig,
    DeepseekRouting,
    ExpertScoring,
    GroupScore,
    MlaConfig,
    MoeConfig,
    YarnRopeScaling,
)
from ..config.registry import add_presets, register
from ..config.rope_scaling import read_latent_rope, rope_parameters
from ..config.tensors import (
    GATED_MLP_TENSORS,
    NORM_TENSORS,
    HFTensor,
    decoder_tensor_names,
    mla_tensors,
    sparse_ffn_tensors,
)
from ..decoder.designs import StageDesigns
from ..decoder.moe import MoeCausalLM, moe_stage_facts
from ..layers.attention.latent import LatentCache, MultiHeadLatentAttention
from ..layers.mlp import SwiGLU
from ..layers.moe.deepseek_router import DeepseekMoeFfn

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
MODEL_TYPES = {V2: "deepseek_v2", V3: "deepseek_v3"}
"""The `model_type` of each DeepSeek architecture."""
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def read_mla(config: Mapping[str, Any]) -> MlaConfig:
    """Reads the attention of a DeepSeek-V2 / V3 `config.json` (as a dict).

    Accepts the legacy `rope_theta` + `rope_scaling` and transformers 5's
    `rope_parameters`; YaRN's `factor` defaults, as in transformers, to
    `max_position_embeddings / original_max_position_embeddings`.

    Raises:
      ValueError: Another model type, attention biases, kv heads other than the query
        heads, or an unsupported RoPE type.
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES.values():
        raise ValueError(
            f"DeepSeek's attention reader reads deepseek_v2 / v3 configs; got {model_type=}"
        )
    if config.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported (no DeepSeek checkpoint has it)")
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads") not in (None, heads):
        raise ValueError(
            "MLA expands every head's key and value from the latent; num_key_value_heads "
            f"must equal num_attention_heads ({heads}); got {config['num_key_value_heads']}"
        )
    interleaved = model_type == "deepseek_v2" or config.get("rope_interleave", True)
    theta, scaling = read_latent_rope(config)
    return MlaConfig(
        hidden_size=config["hidden_size"],
        num_heads=heads,
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleaved=bool(interleaved),
    )


def read_routing(config: Mapping[str, Any]) -> DeepseekRouting:
    """Reads the router of a DeepSeek-V2 / V3 `config.json` (as a dict), as transformers 5
    runs it.

    Raises:
      ValueError: Another model type, or a rule transformers does not run (V2's
        `norm_topk_prob`, which transformers ignores but DeepSeek's code honours; a
        `topk_method` or `scoring_func` other than these).
    """
    model_type = config.get("model_type")
    experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
    scaling = float(config.get("routed_scaling_factor", 1.0))
    if model_type == "deepseek_v2":
        if config.get("norm_topk_prob"):
            raise ValueError(
                "deepseek_v2 with norm_topk_prob=true: transformers ignores it, DeepSeek's "
                "code renormalizes instead of scaling; refusing to guess"
            )
        method = config.get("topk_method", "greedy")
        if method == "greedy":
            return DeepseekRouting(experts, top_k, ExpertScoring.SOFTMAX, scaling_factor=scaling)
        if method == "group_limited_greedy":
            return DeepseekRouting(
                experts,
                top_k,
                ExpertScoring.SOFTMAX,
                num_groups=config["n_group"],
                topk_groups=config["topk_group"],
                scaling_factor=scaling,
            )
        raise ValueError(f"deepseek_v2 topk_method {method!r} is not supported")
    if model_type == "deepseek_v3":
        if config.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"deepseek_v3 scores by sigmoid; got {config['scoring_func']!r}")
        return DeepseekRouting(
            experts,
            top_k,
            ExpertScoring.SIGMOID,
            num_groups=config.get("n_group") or 1,
            topk_groups=config.get("topk_group") or 1,
            group_score=GroupScore.TOP2_SUM,
            correction_bias=True,
            renormalize=bool(config.get("norm_topk_prob", True)),
            scaling_factor=scaling,
        )
    raise ValueError(f"the router reader reads deepseek_v2 / v3 configs; {model_type=}")


def read_deepseek_config(config: Mapping[str, Any], architecture: str) -> DecoderConfig:
    """Reads a DeepSeek-V2 / V3 `config.json` (as a dict) into a `DecoderConfig` with its `mla`
    attention and its `moe.routing` rule; `head_dim` is the query/key head width (nope + rope).

    Raises:
      ValueError: The architecture and `model_type` disagree, a required key is missing, or
        the config asks for what transformers does not run (see `read_mla`,
        `read_routing`; a hidden activation other than SiLU, MLP biases, a
        `moe_layer_freq` other than 1).
    """
    if config.get("model_type") != MODEL_TYPES[architecture]:
        raise ValueError(
            f"{architecture} needs model_type {MODEL_TYPES[architecture]!r}; got "
            f"{config.get('model_type')!r}"
        )
    for key, default in (("hidden_act", "silu"), ("mlp_bias", False), ("moe_layer_freq", 1)):
        if config.get(key, default) != default:
            raise ValueError(
                f"{architecture} with {key}={config[key]!r} is not supported (transformers "
                f"runs {key}={default!r}); use a checkpoint without it"
            )
    missing = [
        key
        for key in ("vocab_size", "num_hidden_layers", "intermediate_size", "rms_norm_eps")
        + ("max_position_embeddings", "moe_intermediate_size")
        if config.get(key) is None
    ]
    if missing:
        raise ValueError(f"config.json has no {missing}; they are required to build the decoder")
    mla = read_mla(config)
    routing = read_routing(config)
    width = config["moe_intermediate_size"]
    shared = config.get("n_shared_experts") or 0
    layers = config["num_hidden_layers"]
    dense = min(config.get("first_k_dense_replace") or 0, layers)
    return DecoderConfig(
        architecture=architecture,
        vocab_size=config["vocab_size"],
        hidden_size=mla.hidden_size,
        intermediate_size=config["intermediate_size"],
        num_layers=layers,
        num_heads=mla.num_heads,
        num_kv_heads=mla.num_heads,
        head_dim=mla.qk_head_dim,
        rms_norm_eps=float(config["rms_norm_eps"]),
        rope_theta=mla.rope_theta,
        rope_scaling=mla.rope_scaling,
        qk_norm=False,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=None,
        max_position_embeddings=config["max_position_embeddings"],
        moe=MoeConfig(
            num_experts=routing.num_experts,
            top_k=routing.top_k,
            expert_intermediate_size=width,
            renormalize=routing.renormalize,
            shared_expert_intermediate_size=shared * width or None,
            mlp_only_layers=tuple(range(dense)),
            routing=routing,
        ),
        mla=mla,
    )


def write_deepseek_config(config: DecoderConfig) -> dict[str, Any]:
    """The Hugging Face `config.json` (as a dict) of a DeepSeek `config`, in transformers 5's
    format, with no multi-token-prediction layer; `read_deepseek_config` reads it back."""
    mla, moe = config.mla, config.moe
    routing = moe.routing
    shared = moe.shared_expert_intermediate_size or 0
    v2 = config.architecture == V2
    out: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": MODEL_TYPES[config.architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope_parameters(mla.rope_theta, mla.rope_scaling),
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "first_k_dense_replace": len(moe.mlp_only_layers),
        "moe_intermediate_size": moe.expert_intermediate_size,
        "n_routed_experts": routing.num_experts,
        "num_experts_per_tok": routing.top_k,
        "n_shared_experts": shared // moe.expert_intermediate_size,
        "n_group": routing.num_groups,
        "topk_group": routing.topk_groups,
        "norm_topk_prob": routing.renormalize,
        "routed_scaling_factor": routing.scaling_factor,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
    }
    if v2:
        out["topk_method"] = "group_limited_greedy" if routing.num_groups > 1 else "greedy"
    else:
        out |= {"rope_interleave": mla.rope_interleaved, "num_nextn_predict_layers": 0}
    return out


WHOLE_ON_EVERY_RANK = bj.Topology()
"""The topology a fully data-parallel dense FFN is built on: one rank, so no weight is split."""


class DeepseekCausalLM(MoeCausalLM):
    """A DeepSeek decoder LM: `MoeCausalLM` with latent attention, DeepSeek's router and shared
    experts, and the latent decode cache.

    Attributes (besides `MoeCausalLM`'s):
      dense_ffn_dp: The dense layers' FFN is fully data-parallel (whole weights on every rank,
        run on the rank's own rows) instead of split over the full TP group.
      dense_layers_first: The config format counts the dense layers (`first_k_dense_replace`),
        so they are the first ones; False where it names each layer's kind.
    """

    quantizable = False
    dense_ffn_dp = True
    dense_layers_first = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        return read_deepseek_config(hf_config, cls.architectures[0])

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return write_deepseek_config(config)

    @classmethod
    def check_config(cls, config: DecoderConfig) -> None:
        """A DeepSeek config has latent attention, DeepSeek's router, and (`dense_layers_first`)
        its dense layers first (`first_k_dense_replace`), the rest sparse."""
        super().check_config(config)
        if config.mla is None or config.moe.routing is None:
            raise ValueError(
                f"{config.architecture}: multi-head latent attention (mla) and DeepSeek routing "
                f"(moe.routing) are its facts; got mla={config.mla!r}, moe={config.moe!r}"
            )
        dense = config.moe.mlp_only_layers
        if config.moe.decoder_sparse_step != 1 or (
            cls.dense_layers_first and dense != tuple(range(len(dense)))
        ):
            raise ValueError(
                "DeepSeek's dense layers are the first first_k_dense_replace ones, the rest "
                f"sparse; got mlp_only_layers={dense}, "
                f"decoder_sparse_step={config.moe.decoder_sparse_step}"
            )

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        """Latent attention's projections and norms in place of grouped-query attention's; the
        sparse layers' shared experts from `mlp.shared_experts.*`, the V3 router's correction
        bias from `mlp.gate.e_score_correction_bias`."""
        dense = NORM_TENSORS[config.residual_design] | mla_tensors(config.mla) | GATED_MLP_TENSORS
        sparse = sparse_ffn_tensors(config, shared="shared_experts")
        return decoder_tensor_names(config, scan_layers=scan_layers, dense=dense, sparse=sparse)

    @classmethod
    def unread_tensors(
        cls, config: DecoderConfig, names: Iterable[str]
    ) -> tuple[tuple[str, ...], str | None]:
        """The multi-token-prediction layers' tensors (`model.layers.{i}.*` with i >=
        num_layers, as DeepSeek-V3's `model.layers.61.*`), which the causal LM does not run."""
        unread, layers = [], set()
        for name in names:
            found = _LAYER_INDEX.match(name)
            if found is not None and int(found.group(1)) >= config.num_layers:
                unread.append(name)
                layers.add(int(found.group(1)))
        if not unread:
            return (), None
        notice = (
            f"ignoring multi-token-prediction layer(s) {sorted(layers)} (model.layers."
            f"{min(layers)}.* ...): the causal LM does not run them"
        )
        return tuple(unread), notice

    def stage_facts(
        self, layer_index: int, stages: StageDesigns | None = None
    ) -> tuple[bj.StageDeclaration, ...]:
        """Attention, then the sparse FFN, or the dense one (fully data-parallel under
        `dense_ffn_dp`)."""
        stages = self.design.facts() if stages is None else stages
        if self.options.dense_ffn_dp and not self.config.sparse_layers[layer_index]:
            return stages.attn.declare_attn(), stages.ffn.declare_ffn(dense_tp_size=1)
        return moe_stage_facts(self.config, self.topology, self.moe_dispatch, layer_index, stages)

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
                capacity=self.options.moe_capacity,
                impl=self.grouped_matmul,
                dtype=dtype,
                rngs=rngs,
            )
        return SwiGLU(
            config.hidden_size,
            config.intermediate_size,
            topology=WHOLE_ON_EVERY_RANK if self.options.dense_ffn_dp else self.topology,
            dtype=dtype,
            rngs=rngs,
        )

    def make_layer(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Decoder layer `index`: latent attention and its FFN (inside the open layer stack)."""
        attn = MultiHeadLatentAttention(
            self.config.mla,
            topology=self.topology,
            dtype=dtype,
            impl=self.options.attention,
            rngs=rngs,
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


@register
class DeepseekV2ForCausalLM(DeepseekCausalLM):
    """DeepSeek-V2 (and V2-Lite): softmax routing, greedy or group-limited greedy top-k, the
    weights scaled by `routed_scaling_factor`, interleaved RoPE pairs."""

    architectures = (V2,)
    model_type = MODEL_TYPES[V2]
    # transformers' attribute_map: two names config.json may give one key.
    config_aliases = {
        "num_experts": "n_routed_experts",
    }
    # transformers' DeepseekV2Config defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": False,
        "first_k_dense_replace": 0,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "kv_lora_rank": 512,
        "max_position_embeddings": 2048,
        "mlp_bias": False,
        "moe_intermediate_size": 1407,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": False,
        "topk_method": "greedy",
        "v_head_dim": 128,
        "vocab_size": 102400,
    }


@register
class DeepseekV3ForCausalLM(DeepseekCausalLM):
    """DeepSeek-V3: sigmoid routing with a correction bias that only picks experts, grouped
    top-k (groups scored by their best two), renormalized and scaled weights, q LoRA."""

    architectures = (V3,)
    model_type = MODEL_TYPES[V3]
    # transformers' attribute_map: two names config.json may give one key.
    config_aliases = {
        "num_local_experts": "n_routed_experts",
        "num_mtp_layers": "num_nextn_predict_layers",
    }
    # transformers' DeepseekV3Config defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": False,
        "first_k_dense_replace": 3,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 4096,
        "moe_intermediate_size": 2048,
        "n_group": 8,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_interleave": True,
        "rope_theta": 10000.0,
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
        "topk_group": 4,
        "v_head_dim": 128,
        "vocab_size": 129280,
    }


# DeepSeek-V3-style: latent attention with q LoRA and YaRN, one dense layer then three sparse
# ones (8 experts in 4 groups of which 2 are kept, top-2 by sigmoid scores and a correction bias,
# one shared expert).
TINY_MLA = MlaConfig(
    hidden_size=64,
    num_heads=8,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_theta=1e4,
    rope_scaling=YarnRopeScaling(
        factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0
    ),
)
TINY_ROUTING = DeepseekRouting(
    num_experts=8,
    top_k=2,
    scoring=ExpertScoring.SIGMOID,
    num_groups=4,
    topk_groups=2,
    group_score=GroupScore.TOP2_SUM,
    correction_bias=True,
    renormalize=True,
    scaling_factor=2.5,
)
TINY = DecoderConfig(
    architecture=V3,
    vocab_size=256,
    hidden_size=TINY_MLA.hidden_size,
    intermediate_size=128,
    num_layers=4,
    num_heads=TINY_MLA.num_heads,
    num_kv_heads=TINY_MLA.num_heads,
    head_dim=TINY_MLA.qk_head_dim,
    rms_norm_eps=1e-6,
    rope_theta=TINY_MLA.rope_theta,
    rope_scaling=TINY_MLA.rope_scaling,
    qk_norm=False,
    tie_word_embeddings=False,
    sliding_window=None,
    max_position_embeddings=128,
    moe=MoeConfig(
        num_experts=TINY_ROUTING.num_experts,
        top_k=TINY_ROUTING.top_k,
        expert_intermediate_size=32,
        renormalize=TINY_ROUTING.renormalize,
        shared_expert_intermediate_size=32,
        mlp_only_layers=(0,),
        routing=TINY_ROUTING,
    ),
    mla=TINY_MLA,
)
add_presets({"tiny-deepseek-v3": TINY})
