"""DeepSeek-V2 / V3 configurations: the latent attention's shapes (`MlaConfig`), the router's rule
(`DeepseekRouting`), and the reader and writer of their Hugging Face `config.json` files.

What transformers 5 reads from a DeepSeek `config.json` (`DeepseekV2Config`, `DeepseekV3Config`):
multi-head latent attention (`q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`,
`qk_rope_head_dim`, `v_head_dim`, YaRN RoPE with DeepSeek's `mscale`), the first
`first_k_dense_replace` layers dense (width `intermediate_size`), the rest sparse: routed experts
of width `moe_intermediate_size` under DeepSeek's router, and `n_shared_experts` shared experts
(one ungated SwiGLU of width `n_shared_experts * moe_intermediate_size`). Multi-token-prediction
layers (V3's `num_nextn_predict_layers`) are not part of the causal LM.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from .rope_scaling import LinearRopeScaling, Llama3RopeScaling, RopeScaling, YarnRopeScaling
from .types import Architecture, DecoderConfig, MoeConfig

MODEL_TYPES = {Architecture.DEEPSEEK_V2: "deepseek_v2", Architecture.DEEPSEEK_V3: "deepseek_v3"}
"""The `model_type` of each DeepSeek architecture."""


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """The shapes and RoPE of one multi-head latent attention layer: static and hashable.

    Attributes:
      hidden_size: Width of the input rows and of the output.
      num_heads: Attention heads (HF `num_attention_heads`).
      q_lora_rank: Width of the query latent (q_a -> norm -> q_b), or None for a plain q_proj.
      kv_lora_rank: Width of the kv latent `c`.
      qk_nope_head_dim: Per-head query/key dimensions without position.
      qk_rope_head_dim: Per-head rotated query dimensions; the one rotated key is shared.
      v_head_dim: Per-head value dimensions.
      rope_theta: RoPE base.
      rope_scaling: YaRN (DeepSeek's), linear or llama3 scaling, or None.
      rope_interleaved: The rope dimensions come in interleaved pairs (DeepSeek-V2 always;
        V3 unless `rope_interleave` is false); else NeoX halves.
      lora_scaled: LongCat-Flash's scales: the queries (both parts) times
        `q_lora_scale = sqrt(hidden_size / q_lora_rank)` and the normed kv latent times
        `kv_lora_scale = sqrt(hidden_size / kv_lora_rank)` (before it is cached). Needs q LoRA.
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    rope_interleaved: bool = True
    lora_scaled: bool = False

    def __post_init__(self):
        for name in (
            "hidden_size",
            "num_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MlaConfig.{name} must be a positive int; got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be positive or None; got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"RoPE rotates pairs of dimensions; qk_rope_head_dim must be even, got "
                f"{self.qk_rope_head_dim}"
            )
        if self.lora_scaled and self.q_lora_rank is None:
            raise ValueError(
                "lora_scaled (LongCat-Flash's query and latent scales) needs q LoRA; got "
                "q_lora_rank=None"
            )

    @property
    def q_lora_scale(self) -> float:
        """The queries' factor: `sqrt(hidden_size / q_lora_rank)` when `lora_scaled`, else 1."""
        return (self.hidden_size / self.q_lora_rank) ** 0.5 if self.lora_scaled else 1.0

    @property
    def kv_lora_scale(self) -> float:
        """The normed kv latent's factor: `sqrt(hidden_size / kv_lora_rank)` when
        `lora_scaled`, else 1."""
        return (self.hidden_size / self.kv_lora_rank) ** 0.5 if self.lora_scaled else 1.0

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Cached values per token and layer: the kv latent and the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim ** -0.5`, times DeepSeek's `yarn_mscale(factor, mscale_all_dim) ** 2`
        under YaRN scaling."""
        scale = self.qk_head_dim**-0.5
        if isinstance(self.rope_scaling, YarnRopeScaling):
            scale *= self.rope_scaling.softmax_scale_factor
        return scale

    @property
    def rope_attention_factor(self) -> float:
        """The factor of RoPE's cos and sin (YaRN's `attention_factor`; 1 otherwise)."""
        if isinstance(self.rope_scaling, YarnRopeScaling):
            return self.rope_scaling.attention_factor
        return 1.0

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> MlaConfig:
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
                f"MlaConfig.from_hf reads deepseek_v2 / deepseek_v3 configs; got {model_type=}"
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
        theta, scaling = read_deepseek_rope(config)
        return cls(
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


def read_deepseek_rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling of a DeepSeek-style config (top level or `rope_parameters`)."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or parameters
    theta = parameters.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise ValueError("the config names no rope_theta (top level or in rope_parameters)")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), LinearRopeScaling(float(scaling["factor"]))
    if kind == "llama3":
        return float(theta), Llama3RopeScaling(
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    if kind == "yarn":
        original = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or config["max_position_embeddings"] / original
        return float(theta), YarnRopeScaling(
            factor=float(factor),
            original_max_position_embeddings=original,
            beta_fast=float(scaling.get("beta_fast") or 32),
            beta_slow=float(scaling.get("beta_slow") or 1),
            mscale=scaling.get("mscale"),
            mscale_all_dim=scaling.get("mscale_all_dim"),
            explicit_attention_factor=scaling.get("attention_factor"),
            truncate=bool(scaling.get("truncate", True)),
        )
    raise ValueError(f"RoPE type {kind!r} is not supported; use default, linear, llama3 or yarn")


class ExpertScoring(enum.Enum):
    """How router logits become expert scores.

    SOFTMAX: over all experts (DeepSeek-V2).
    SIGMOID: each expert on its own (DeepSeek-V3).
    """

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class GroupScore(enum.Enum):
    """How a group of experts is scored for the grouped top-k.

    MAX: its best expert's choice score (DeepSeek-V2's `group_limited_greedy`).
    TOP2_SUM: the sum of its two best choice scores (DeepSeek-V3).
    """

    MAX = "max"
    TOP2_SUM = "top2-sum"


@dataclasses.dataclass(frozen=True)
class DeepseekRouting:
    """DeepSeek's routing rule: static and hashable.

    Attributes:
      num_experts: Routed experts (HF `n_routed_experts`).
      top_k: Experts per token (HF `num_experts_per_tok`).
      scoring: Softmax (V2) or sigmoid (V3) scores.
      num_groups: Equal groups the experts form (HF `n_group`); 1: no grouped selection.
      topk_groups: Groups whose experts a token may choose (HF `topk_group`).
      group_score: How a group is scored.
      correction_bias: The choice adds `e_score_correction_bias` to the scores (V3); the
        weights never do.
      renormalize: The k weights are divided by their sum (+ 1e-20) (V3's `norm_topk_prob`).
      scaling_factor: The weights' factor (HF `routed_scaling_factor`).
      zero_experts: Zero-computation (identity) experts after the routed ones (LongCat-Flash's
        `zero_expert_num`): the router scores `num_experts + zero_experts` experts, and a
        choice of an id >= `num_experts` returns its input times its weight, with no weights
        and no matmul. Not combined with grouped selection.
    """

    num_experts: int
    top_k: int
    scoring: ExpertScoring
    num_groups: int = 1
    topk_groups: int = 1
    group_score: GroupScore = GroupScore.MAX
    correction_bias: bool = False
    renormalize: bool = False
    scaling_factor: float = 1.0
    zero_experts: int = 0

    def __post_init__(self):
        for name in ("num_experts", "top_k", "num_groups", "topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DeepseekRouting.{name} must be a positive int; got {value!r}")
        if not isinstance(self.zero_experts, int) or self.zero_experts < 0:
            raise ValueError(
                "DeepseekRouting.zero_experts must be a non-negative int; got "
                f"{self.zero_experts!r}"
            )
        if self.zero_experts and self.num_groups > 1:
            raise NotImplementedError(
                "zero-computation experts with grouped selection are not supported (no model "
                f"has both); got {self.zero_experts=}, {self.num_groups=}"
            )
        if self.top_k > self.total_experts:
            raise ValueError(
                f"top_k ({self.top_k}) must not exceed the experts the router scores "
                f"({self.total_experts})"
            )
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(
                "the experts must form num_groups equal groups, of which topk_groups are kept; "
                f"got {self.num_experts=}, {self.num_groups=}, {self.topk_groups=}"
            )
        per_group = self.total_experts // self.num_groups
        if self.top_k > self.topk_groups * per_group:
            raise ValueError(
                f"top_k ({self.top_k}) must not exceed the experts of the kept groups "
                f"({self.topk_groups} x {per_group})"
            )
        if self.group_score is GroupScore.TOP2_SUM and self.num_groups > 1 and per_group < 2:
            raise ValueError(
                f"a group scored by its best two experts needs two; got {per_group} per group"
            )

    @property
    def total_experts(self) -> int:
        """The experts the router scores: the routed ones, then the zero-computation ones."""
        return self.num_experts + self.zero_experts

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DeepseekRouting:
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
                return cls(experts, top_k, ExpertScoring.SOFTMAX, scaling_factor=scaling)
            if method == "group_limited_greedy":
                return cls(
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
            return cls(
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
        raise ValueError(f"DeepseekRouting.from_hf reads deepseek_v2 / v3 configs; {model_type=}")


def read_deepseek_config(config: Mapping[str, Any]) -> DecoderConfig:
    """Reads a DeepSeek-V2 / V3 `config.json` (as a dict) into a `DecoderConfig` with its `mla`
    attention and its `moe.routing` rule; `head_dim` is the query/key head width (nope + rope).

    Raises:
      ValueError: The architecture and `model_type` disagree, a required key is missing, or
        the config asks for what transformers does not run (see `MlaConfig.from_hf`,
        `DeepseekRouting.from_hf`; a hidden activation other than SiLU, MLP biases, a
        `moe_layer_freq` other than 1).
    """
    architecture = Architecture(config["architectures"][0])
    if config.get("model_type") != MODEL_TYPES[architecture]:
        raise ValueError(
            f"{architecture.value} needs model_type {MODEL_TYPES[architecture]!r}; got "
            f"{config.get('model_type')!r}"
        )
    for key, default in (("hidden_act", "silu"), ("mlp_bias", False), ("moe_layer_freq", 1)):
        if config.get(key, default) != default:
            raise ValueError(
                f"{architecture.value} with {key}={config[key]!r} is not supported (transformers "
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
    mla = MlaConfig.from_hf(config)
    routing = DeepseekRouting.from_hf(config)
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
    v2 = config.architecture is Architecture.DEEPSEEK_V2
    out: dict[str, Any] = {
        "architectures": [config.architecture.value],
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
        "rope_parameters": mla_rope_parameters(mla),
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


def mla_rope_parameters(mla: MlaConfig) -> dict[str, Any]:
    """transformers 5's `rope_parameters` of a latent attention's RoPE."""
    rope: dict[str, Any] = {"rope_theta": mla.rope_theta, "rope_type": "default"}
    scaling = mla.rope_scaling
    if isinstance(scaling, YarnRopeScaling):
        yarn = {
            "rope_type": "yarn",
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow,
            "mscale": scaling.mscale,
            "mscale_all_dim": scaling.mscale_all_dim,
            "attention_factor": scaling.explicit_attention_factor,
            "truncate": scaling.truncate,
        }
        rope |= {key: value for key, value in yarn.items() if value is not None}
    elif isinstance(scaling, LinearRopeScaling):
        rope |= {"rope_type": "linear", "factor": scaling.factor}
    elif scaling is not None:
        rope |= dataclasses.asdict(scaling) | {"rope_type": "llama3"}
    return rope
