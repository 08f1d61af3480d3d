"""Frozen decoder configurations: presets and a reader for Hugging Face `config.json` files.

Dense decoders (Qwen3, Llama, Mistral, Qwen2) and mixture-of-experts decoders (Qwen3-MoE, Mixtral,
Qwen2-MoE) read into one `DecoderConfig`; the sparse FFN's facts sit in its `moe` field.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any


class Architecture(enum.StrEnum):
    """The Hugging Face model classes a `DecoderConfig` can describe."""

    QWEN3 = "Qwen3ForCausalLM"
    LLAMA = "LlamaForCausalLM"
    MISTRAL = "MistralForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    QWEN3_MOE = "Qwen3MoeForCausalLM"
    MIXTRAL = "MixtralForCausalLM"
    QWEN2_MOE = "Qwen2MoeForCausalLM"


_MOE_ARCHITECTURES = (Architecture.QWEN3_MOE, Architecture.MIXTRAL, Architecture.QWEN2_MOE)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The sparse FFN of a mixture-of-experts decoder: static and hashable.

    Attributes:
      num_experts: Routed experts per sparse layer (HF `num_experts` / `num_local_experts`).
      top_k: Experts each token is sent to (HF `num_experts_per_tok`).
      expert_intermediate_size: Width of one routed expert's SwiGLU (HF `moe_intermediate_size`;
        Mixtral's `intermediate_size`).
      renormalize: The top-k router probabilities are divided by their sum (Mixtral always;
        Qwen3-MoE and Qwen2-MoE where `norm_topk_prob`); otherwise they are the softmax over all
        experts as is.
      shared_expert_intermediate_size: Width of the shared expert every token also goes
        through, or None without one (Qwen2-MoE has one).
      shared_expert_gate: The shared expert's output is scaled by
        `sigmoid(x @ shared_expert_gate)` per token (Qwen2-MoE).
      mlp_only_layers: Layers whose FFN is dense (HF `mlp_only_layers`).
      decoder_sparse_step: Layer i is sparse when (i + 1) % decoder_sparse_step == 0 and it is
        not in `mlp_only_layers`; the others run the dense FFN of width `intermediate_size`.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1

    def __post_init__(self):
        for name in ("num_experts", "top_k", "expert_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoeConfig.{name} must be a positive int; got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                "top_k cannot exceed num_experts (a token picks distinct experts); got "
                f"{self.top_k=}, {self.num_experts=}"
            )
        shared = self.shared_expert_intermediate_size
        if shared is not None and (not isinstance(shared, int) or shared < 1):
            raise ValueError(
                f"shared_expert_intermediate_size must be positive or None; got {shared!r}"
            )
        if self.shared_expert_gate and shared is None:
            raise ValueError(
                "shared_expert_gate=True needs a shared expert; got "
                "shared_expert_intermediate_size=None"
            )
        if not isinstance(self.mlp_only_layers, tuple) or any(
            not isinstance(i, int) or i < 0 for i in self.mlp_only_layers
        ):
            raise TypeError(
                "mlp_only_layers must be a tuple of layer indices (hashable); got "
                f"{self.mlp_only_layers!r}"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) runs the sparse FFN, by HF's rule."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3 RoPE frequency scaling (Hugging Face `rope_type: "llama3"`).

    Attributes:
      factor: Divisor of the low frequencies.
      low_freq_factor: Wavelengths above `original_max_position_embeddings / low_freq_factor`
        are divided by `factor`.
      high_freq_factor: Wavelengths below `original_max_position_embeddings / high_freq_factor`
        are kept; those between the two bounds are interpolated.
      original_max_position_embeddings: The context length the model was pre-trained with.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                "llama3 RoPE scaling needs high_freq_factor > low_freq_factor > 0; got "
                f"{self.low_freq_factor=}, {self.high_freq_factor=}"
            )
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(
                "llama3 RoPE scaling needs a positive factor and original context; got "
                f"{self.factor=}, {self.original_max_position_embeddings=}"
            )


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The architecture of a decoder (Qwen3, Llama, Mistral, Qwen2 and the MoE ones): static and
    hashable.

    Attributes:
      architecture: The Hugging Face class the weights come from.
      vocab_size: Number of token ids (unpadded).
      hidden_size: Width of the residual stream.
      intermediate_size: Width of the dense SwiGLU FFN (in an MoE decoder, that of its dense
        layers; Mixtral has none and repeats its expert width here, as its config.json does).
      num_layers: Number of decoder layers.
      num_heads: Query heads.
      num_kv_heads: Key/value heads; query head j uses kv head j // (num_heads // num_kv_heads).
      head_dim: Width of one head (may differ from hidden_size // num_heads).
      rms_norm_eps: Epsilon of every RMSNorm, q/k norms included.
      rope_theta: RoPE base.
      rope_scaling: Llama 3 frequency scaling, or None for plain RoPE.
      qk_norm: Qwen3-style RMSNorm of every query and key head before RoPE.
      tie_word_embeddings: The LM head reuses the embedding table.
      sliding_window: A row at position p attends to positions p - sliding_window < q <= p;
        None for full causal attention.
      max_position_embeddings: Longest context the model supports.
      qkv_bias: The q, k and v projections add a bias (Qwen2, Qwen2-MoE); o has none.
      moe: The sparse FFN of an MoE decoder, or None for a dense decoder.
    """

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    max_position_embeddings: int
    qkv_bias: bool = False
    moe: MoeConfig | None = None

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DecoderConfig.{name} must be a positive int; got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                "num_heads must be a multiple of num_kv_heads (grouped-query attention); got "
                f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"RoPE rotates pairs of dimensions; head_dim must be even, got {self.head_dim}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or None; got {self.sliding_window}")
        if (self.moe is not None) != (self.architecture in _MOE_ARCHITECTURES):
            raise ValueError(
                f"{self.architecture.value} {'needs' if self.moe is None else 'takes no'} MoE "
                f"settings; got moe={self.moe!r}. Mixture-of-experts architectures are "
                f"{[a.value for a in _MOE_ARCHITECTURES]}"
            )
        if self.moe is not None and any(i >= self.num_layers for i in self.moe.mlp_only_layers):
            raise ValueError(
                f"mlp_only_layers must name layers below num_layers={self.num_layers}; got "
                f"{self.moe.mlp_only_layers}"
            )

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its FFN is the sparse (MoE) one; all False for a dense decoder."""
        return tuple(
            self.moe is not None and self.moe.is_sparse(layer) for layer in range(self.num_layers)
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DecoderConfig:
        """Reads a Hugging Face `config.json` (as a dict) of a supported decoder.

        Accepts both RoPE formats: the legacy top-level `rope_theta` + `rope_scaling` and the
        transformers-5 `rope_parameters`; and both spellings of the expert count
        (`num_experts`, as the Qwen hub checkpoints, and `num_local_experts`, as Mixtral and
        transformers 5's Qwen3-MoE write it).

        Raises:
          ValueError: The architecture, RoPE type, activation, biases or per-layer sliding
            windows are not supported, or a required key is missing.
        """
        architectures = config.get("architectures") or []
        supported = [a.value for a in Architecture]
        if len(architectures) != 1 or architectures[0] not in supported:
            raise ValueError(
                f"config.json must name exactly one architecture among {supported}; got "
                f"architectures={architectures!r}"
            )
        architecture = Architecture(architectures[0])
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key, False):
                raise ValueError(
                    f"{architecture.value} with {key}=true is not supported (the projections "
                    "here have no bias, except q/k/v of Qwen2 and Qwen2-MoE)"
                )
        activation = config.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"only the SiLU gated MLP is supported; got hidden_act={activation!r}")
        theta, scaling = _read_rope(config)
        hidden = _required(config, "hidden_size")
        heads = _required(config, "num_attention_heads")
        return cls(
            architecture=architecture,
            vocab_size=_required(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(config, "intermediate_size"),
            num_layers=_required(config, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            rms_norm_eps=float(_required(config, "rms_norm_eps")),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=architecture in (Architecture.QWEN3, Architecture.QWEN3_MOE),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=_read_sliding_window(config, architecture),
            max_position_embeddings=_required(config, "max_position_embeddings"),
            qkv_bias=_read_qkv_bias(config, architecture),
            moe=_read_moe(config, architecture),
        )


def padded_vocab(vocab: int, shards: int) -> int:
    """`vocab` rounded up to a multiple of `shards`, so a vocab-parallel table splits evenly."""
    if vocab < 1 or shards < 1:
        raise ValueError(f"vocab and shards must be positive; got {vocab=}, {shards=}")
    return -(-vocab // shards) * shards


def _required(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ValueError(f"config.json has no {key!r}; it is required to build the decoder")
    return config[key]


def _read_rope(config: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    parameters = config.get("rope_parameters")
    if parameters is not None:
        if "rope_theta" not in parameters:
            raise ValueError(f"rope_parameters has no 'rope_theta'; got {parameters!r}")
        theta, scaling = parameters["rope_theta"], parameters
    else:
        theta, scaling = _required(config, "rope_theta"), config.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(
            f"RoPE type {rope_type!r} is not supported; supported: 'default' and 'llama3'"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [key for key in keys if key not in scaling]
    if missing:
        raise ValueError(f"llama3 RoPE scaling is missing {missing}; got {dict(scaling)!r}")
    return float(theta), Llama3RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _read_qkv_bias(config: Mapping[str, Any], architecture: Architecture) -> bool:
    # Qwen2 always has q/k/v biases (its config has no key for them); Qwen2-MoE has them unless
    # transformers 5's `qkv_bias` says otherwise (the hub checkpoints predate that key).
    if architecture is Architecture.QWEN2:
        return True
    if architecture is Architecture.QWEN2_MOE:
        return bool(config.get("qkv_bias", True))
    return False


_PLAIN_ROUTER = {
    "topk_method": ("greedy",),
    "n_group": (1,),
    "topk_group": (1,),
    "routed_scaling_factor": (1, 1.0),
}
"""Router keys of other MoE families, and the values that leave a plain softmax top-k."""


def _read_moe(config: Mapping[str, Any], architecture: Architecture) -> MoeConfig | None:
    if architecture not in _MOE_ARCHITECTURES:
        return None
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts is None:
        raise ValueError(
            f"{architecture.value} config.json has neither 'num_experts' nor "
            "'num_local_experts'; one is required to build the sparse FFN"
        )
    top_k = _required(config, "num_experts_per_tok")
    scoring = config.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise ValueError(
            f"unsupported router: {architecture.value} routes by a softmax over all experts, "
            f"then top-k; got scoring_func={scoring!r}. Use a softmax-routed checkpoint"
        )
    # Router variants of other families (grouped top-k, scaled weights) the router here lacks.
    grouped = {
        key: config[key]
        for key, plain in _PLAIN_ROUTER.items()
        if config.get(key) is not None and config[key] not in plain
    }
    if grouped:
        raise ValueError(
            f"unsupported router: {architecture.value} takes a plain top-k of the softmax; got "
            f"{grouped}. Remove these keys or use a checkpoint routed that way"
        )
    if architecture is Architecture.MIXTRAL:
        return MoeConfig(
            num_experts=experts,
            top_k=top_k,
            expert_intermediate_size=_required(config, "intermediate_size"),
            renormalize=True,
        )
    shared = None
    if architecture is Architecture.QWEN2_MOE:
        shared = _required(config, "shared_expert_intermediate_size")
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=_required(config, "moe_intermediate_size"),
        renormalize=bool(config.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared,
        shared_expert_gate=shared is not None,
        mlp_only_layers=tuple(sorted(config.get("mlp_only_layers") or ())),
        decoder_sparse_step=config.get("decoder_sparse_step") or 1,
    )


def _read_sliding_window(config: Mapping[str, Any], architecture: Architecture) -> int | None:
    if architecture is Architecture.LLAMA:
        return None
    window = config.get("sliding_window")
    if architecture in (Architecture.MISTRAL, Architecture.MIXTRAL) or window is None:
        return window
    # The Qwen family: the window applies only where enabled. Qwen3-MoE then applies it to
    # every layer; the others to the layers `layer_types` marks sliding (by default those from
    # `max_window_layers` on, every other one below it for Qwen2-MoE). One window for all layers
    # is supported.
    if not config.get("use_sliding_window", False):
        return None
    if architecture is Architecture.QWEN3_MOE:
        return window
    layers = config["num_hidden_layers"]
    first = config.get("max_window_layers", layers)
    if architecture is Architecture.QWEN2_MOE:
        default = [bool((i + 1) % 2) and i < first for i in range(layers)]
    else:
        default = [i >= first for i in range(layers)]
    kinds = config.get("layer_types") or [
        "sliding_attention" if sliding else "full_attention" for sliding in default
    ]
    if set(kinds) == {"full_attention"}:
        return None
    if set(kinds) == {"sliding_attention"}:
        return window
    raise ValueError(
        "sliding windows on some layers only are not supported; got layer_types="
        f"{kinds!r}. Use a config whose layers all use the same attention."
    )


PRESETS: dict[str, DecoderConfig] = {
    "tiny-qwen3": DecoderConfig(
        architecture=Architecture.QWEN3,
        vocab_size=250,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling=None,
        qk_norm=True,
        tie_word_embeddings=True,
        sliding_window=None,
        max_position_embeddings=128,
    ),
    "tiny-mistral": DecoderConfig(
        architecture=Architecture.MISTRAL,
        vocab_size=250,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        rope_scaling=None,
        qk_norm=False,
        tie_word_embeddings=False,
        sliding_window=16,
        max_position_embeddings=128,
    ),
    # About 0.9M parameters (3.5 MB in float32).
    "small-llama": DecoderConfig(
        architecture=Architecture.LLAMA,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
        rope_scaling=Llama3RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
        qk_norm=False,
        tie_word_embeddings=False,
        sliding_window=None,
        max_position_embeddings=2048,
    ),
}
"""Named configurations for demos and tests; none needs a checkpoint."""
# Qwen3-MoE with a dense layer among three sparse ones (8 experts, top-2 of them).
PRESETS["tiny-qwen3-moe"] = dataclasses.replace(
    PRESETS["tiny-qwen3"],
    architecture=Architecture.QWEN3_MOE,
    tie_word_embeddings=False,
    moe=MoeConfig(
        num_experts=8,
        top_k=2,
        expert_intermediate_size=32,
        renormalize=True,
        mlp_only_layers=(1,),
    ),
)
