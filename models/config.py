"""Frozen decoder configurations: presets and a reader for Hugging Face `config.json` files.

Dense decoders (Qwen3, Llama, Mistral, Qwen2), post-norm and sandwich-norm decoders (EXAONE 4.0,
OLMo 2, Gemma 3 text) and mixture-of-experts decoders (Qwen3-MoE, Mixtral, Qwen2-MoE) read into
one `DecoderConfig`; the sparse FFN's facts sit in its `moe` field, and what differs between the
attention of one layer and another (window, RoPE) is `DecoderConfig.layer_attention`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any, NamedTuple


class Architecture(enum.StrEnum):
    """The Hugging Face model classes a `DecoderConfig` can describe."""

    QWEN3 = "Qwen3ForCausalLM"
    LLAMA = "LlamaForCausalLM"
    MISTRAL = "MistralForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    QWEN3_MOE = "Qwen3MoeForCausalLM"
    MIXTRAL = "MixtralForCausalLM"
    QWEN2_MOE = "Qwen2MoeForCausalLM"
    EXAONE4 = "Exaone4ForCausalLM"
    OLMO2 = "Olmo2ForCausalLM"
    GEMMA3 = "Gemma3ForCausalLM"


_MOE_ARCHITECTURES = (Architecture.QWEN3_MOE, Architecture.MIXTRAL, Architecture.QWEN2_MOE)


class ResidualDesign(enum.Enum):
    """Where a decoder layer's norms sit around each stage.

    PRE_NORM: each stage reads `norm(residual)`; the update is `residual + output`.
    POST_NORM: each stage reads the residual as is; the update is `residual + norm(output)`
      (EXAONE 4.0, OLMo 2).
    SANDWICH: pre-norm read, and a norm of the complete output before the plain update (Gemma 3).
    """

    PRE_NORM = "pre-norm"
    POST_NORM = "post-norm"
    SANDWICH = "sandwich"


_RESIDUAL_DESIGNS = {
    Architecture.EXAONE4: ResidualDesign.POST_NORM,
    Architecture.OLMO2: ResidualDesign.POST_NORM,
    Architecture.GEMMA3: ResidualDesign.SANDWICH,
}


class AttentionKind(enum.StrEnum):
    """The attention of one layer, by Hugging Face's `layer_types` names."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"


class Activation(enum.StrEnum):
    """The gate activation of the gated MLP (Hugging Face `hidden_act` / `hidden_activation`)."""

    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"


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
class LinearRopeScaling:
    """Linear RoPE position interpolation (Hugging Face `rope_type: "linear"`): every inverse
    frequency is divided by `factor`.

    Attributes:
      factor: The divisor (> 0).
    """

    factor: float

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"linear RoPE scaling needs a positive factor; got {self.factor=}")


RopeScaling = Llama3RopeScaling | LinearRopeScaling


class LayerBlock(NamedTuple):
    """Consecutive layers a model holds as one block (`DecoderConfig.layer_blocks`).

    Attributes:
      layers: The model layer indices of the block.
      scanned: The block is a scanned run (`boundary_jax.StackedLayers`, its parameters
        stacked on a leading layer axis); else it is one layer held plainly.
    """

    layers: range
    scanned: bool


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """What the attention of one layer uses: its window and its rotary embedding.

    Attributes:
      sliding_window: A row at position p attends to positions p - sliding_window < q <= p;
        None for full causal attention.
      rope_theta: RoPE base; None for no rotary embedding (EXAONE 4.0's global layers).
      rope_scaling: Frequency scaling of the RoPE, or None.
    """

    sliding_window: int | None
    rope_theta: float | None
    rope_scaling: RopeScaling | None = None


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
      layer_types: Per layer, full or sliding-window attention; None: every layer slides when
        `sliding_window` is set, none otherwise.
      rope_local_theta: RoPE base of the sliding-window layers (Gemma 3's local base, without
        `rope_scaling`); None: they use `rope_theta` and `rope_scaling` like the others.
      nope_full_layers: The full-attention layers apply no RoPE (EXAONE 4.0 with a window).
      qk_norm_whole: The q/k norms span the whole projection (all heads; OLMo 2) instead of each
        head; needs `qk_norm`.
      query_pre_attn_scalar: Attention scores are scaled by its inverse square root (Gemma 3);
        None: by `head_dim ** -0.5`.
      activation: The gated MLP's activation (SiLU: SwiGLU; GELU tanh: Gemma's GeGLU).
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
    rope_scaling: RopeScaling | None
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    max_position_embeddings: int
    qkv_bias: bool = False
    moe: MoeConfig | None = None
    layer_types: tuple[AttentionKind, ...] | None = None
    rope_local_theta: float | None = None
    nope_full_layers: bool = False
    qk_norm_whole: bool = False
    query_pre_attn_scalar: float | None = None
    activation: Activation = Activation.SILU

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
        kinds = self.layer_types
        if kinds is not None:
            if not isinstance(kinds, tuple) or any(
                not isinstance(kind, AttentionKind) for kind in kinds
            ):
                raise TypeError(f"layer_types must be a tuple of AttentionKind; got {kinds!r}")
            if len(kinds) != self.num_layers:
                raise ValueError(
                    f"layer_types must name one attention kind per layer ({self.num_layers}); "
                    f"got {len(kinds)}"
                )
            if AttentionKind.SLIDING in kinds and self.sliding_window is None:
                raise ValueError(
                    "layer_types marks sliding-window layers but sliding_window is None; give "
                    "the window or mark every layer full_attention"
                )
        if self.qk_norm_whole and not self.qk_norm:
            raise ValueError("qk_norm_whole=True (norm over all heads) needs qk_norm=True")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(
                f"query_pre_attn_scalar must be positive or None; got {self.query_pre_attn_scalar}"
            )

    @property
    def residual_design(self) -> ResidualDesign:
        """Where the architecture's norms sit around each stage."""
        return _RESIDUAL_DESIGNS.get(self.architecture, ResidualDesign.PRE_NORM)

    @property
    def gemma_norms(self) -> bool:
        """Every RMSNorm (q/k norms and the final norm too) scales by `1 + weight` (Gemma)."""
        return self.architecture is Architecture.GEMMA3

    @property
    def embedding_scale(self) -> float | None:
        """The factor the embedding's output is multiplied by (Gemma: sqrt(hidden_size), in the
        embedding's dtype), or None."""
        return math.sqrt(self.hidden_size) if self.architecture is Architecture.GEMMA3 else None

    def layer_kind(self, layer: int) -> AttentionKind:
        """Whether layer `layer` (0-based) attends fully or within the sliding window."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}); got {layer}")
        if self.layer_types is not None:
            return self.layer_types[layer]
        return AttentionKind.FULL if self.sliding_window is None else AttentionKind.SLIDING

    def layer_attention(self, layer: int) -> LayerAttention:
        """The window and RoPE of layer `layer`'s attention."""
        if self.layer_kind(layer) is AttentionKind.SLIDING:
            if self.rope_local_theta is not None:
                return LayerAttention(self.sliding_window, self.rope_local_theta)
            return LayerAttention(self.sliding_window, self.rope_theta, self.rope_scaling)
        if self.nope_full_layers:
            return LayerAttention(None, None)
        return LayerAttention(None, self.rope_theta, self.rope_scaling)

    def layer_blocks(self, scan_layers: bool) -> tuple[LayerBlock, ...]:
        """The blocks a model of this config holds its layers in, in order: one unscanned layer
        each without `scan_layers`; with it, the stack entry and the terminal layer alone
        (unscanned) and the layers between in scanned runs of one structure
        (`boundary_jax.StackedLayers`), split where the FFN (sparse or dense) or the attention
        (window, RoPE) changes, and after a change of FFN (a layer's attention input binds to
        what the previous FFN's exit hands on)."""
        count = self.num_layers
        if not scan_layers or count < 3:
            return tuple(LayerBlock(range(i, i + 1), False) for i in range(count))
        blocks = [LayerBlock(range(0, 1), False)]
        start = 1
        for index in range(2, count):
            if index == count - 1 or self._layer_structure(index) != self._layer_structure(start):
                blocks.append(LayerBlock(range(start, index), True))
                start = index
        blocks.append(LayerBlock(range(count - 1, count), False))
        return tuple(blocks)

    def _layer_structure(self, layer: int) -> tuple:
        sparse = self.sparse_layers
        return sparse[layer - 1], sparse[layer], self.layer_attention(layer)

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its FFN is the sparse (MoE) one; all False for a dense decoder."""
        return tuple(
            self.moe is not None and self.moe.is_sparse(layer) for layer in range(self.num_layers)
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DecoderConfig:
        """Reads a Hugging Face `config.json` (as a dict) of a supported decoder.

        Accepts both RoPE formats: the legacy top-level `rope_theta` + `rope_scaling` (Gemma 3:
        also `rope_local_base_freq`) and the transformers-5 `rope_parameters` (Gemma 3: one
        entry per layer type); both spellings of the expert count (`num_experts`, as the Qwen
        hub checkpoints, and `num_local_experts`, as Mixtral and transformers 5's Qwen3-MoE
        write it); and per-layer attention from `layer_types` (or the family's default pattern).

        Raises:
          ValueError: The architecture, RoPE type, activation, biases, layer pattern or a
            Gemma 3 option (softcapping, bidirectional attention) is not supported, or a
            required key is missing.
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
        gemma = architecture is Architecture.GEMMA3
        if gemma:
            _check_gemma3(config)
        activation = _read_activation(config, architecture)
        theta, scaling, local_theta = (_read_gemma3_rope if gemma else _read_rope_global)(config)
        hidden = _required(config, "hidden_size")
        heads = _required(config, "num_attention_heads")
        layers = _required(config, "num_hidden_layers")
        window, kinds = _read_layer_types(config, architecture, layers)
        return cls(
            architecture=architecture,
            vocab_size=_required(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(config, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            rms_norm_eps=float(_required(config, "rms_norm_eps")),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=architecture in _QK_NORM_ARCHITECTURES,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
            sliding_window=window,
            max_position_embeddings=_required(config, "max_position_embeddings"),
            qkv_bias=_read_qkv_bias(config, architecture),
            moe=_read_moe(config, architecture),
            layer_types=kinds,
            rope_local_theta=local_theta,
            nope_full_layers=architecture is Architecture.EXAONE4 and window is not None,
            qk_norm_whole=architecture is Architecture.OLMO2,
            query_pre_attn_scalar=(
                float(_required(config, "query_pre_attn_scalar")) if gemma else None
            ),
            activation=activation,
        )


_QK_NORM_ARCHITECTURES = (
    Architecture.QWEN3,
    Architecture.QWEN3_MOE,
    Architecture.EXAONE4,
    Architecture.OLMO2,
    Architecture.GEMMA3,
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


def _read_rope_global(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None, None]:
    theta, scaling = _read_rope(config)
    return theta, scaling, None


def _read_rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    parameters = config.get("rope_parameters")
    if parameters is not None:
        if "rope_theta" not in parameters:
            raise ValueError(f"rope_parameters has no 'rope_theta'; got {parameters!r}")
        theta, scaling = parameters["rope_theta"], parameters
    else:
        theta, scaling = _required(config, "rope_theta"), config.get("rope_scaling") or {}
    return float(theta), _rope_scaling(scaling)


def _rope_scaling(scaling: Mapping[str, Any]) -> RopeScaling | None:
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        if "factor" not in scaling:
            raise ValueError(f"linear RoPE scaling has no 'factor'; got {dict(scaling)!r}")
        return LinearRopeScaling(float(scaling["factor"]))
    if rope_type != "llama3":
        raise ValueError(
            f"RoPE type {rope_type!r} is not supported; supported: 'default', 'linear' and 'llama3'"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [key for key in keys if key not in scaling]
    if missing:
        raise ValueError(f"llama3 RoPE scaling is missing {missing}; got {dict(scaling)!r}")
    return Llama3RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _read_gemma3_rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None, float]:
    """Gemma 3's global RoPE (base and scaling) and its local base: transformers 5 writes one
    `rope_parameters` entry per layer type; hub files say `rope_theta`, `rope_scaling` (global)
    and `rope_local_base_freq`."""
    parameters = config.get("rope_parameters")
    if parameters is None:
        theta = float(config.get("rope_theta", 1_000_000.0))
        scaling = _rope_scaling(config.get("rope_scaling") or {})
        return theta, scaling, float(config.get("rope_local_base_freq", 10_000.0))
    full = parameters.get(AttentionKind.FULL.value)
    local = parameters.get(AttentionKind.SLIDING.value)
    if full is None or local is None or "rope_theta" not in full or "rope_theta" not in local:
        raise ValueError(
            "Gemma 3's rope_parameters needs 'full_attention' and 'sliding_attention' entries "
            f"with a rope_theta each; got {parameters!r}"
        )
    if _rope_scaling(local) is not None:
        raise ValueError(
            f"RoPE scaling on Gemma 3's sliding-window layers is not supported; got {local!r}"
        )
    return float(full["rope_theta"]), _rope_scaling(full), float(local["rope_theta"])


def _check_gemma3(config: Mapping[str, Any]) -> None:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            raise ValueError(
                f"Gemma3ForCausalLM with {key}={config[key]!r} is not supported (Gemma 3 "
                "checkpoints set it null); use a config without softcapping"
            )
    if config.get("use_bidirectional_attention", False):
        raise ValueError(
            "Gemma3ForCausalLM with use_bidirectional_attention=true is not supported: the "
            "decoders here attend causally"
        )


def _read_activation(config: Mapping[str, Any], architecture: Architecture) -> Activation:
    if architecture is Architecture.GEMMA3:
        name = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if name != Activation.GELU_TANH:
            raise ValueError(
                "Gemma 3's gated MLP is supported with the tanh GELU only; got "
                f"hidden_activation={name!r}"
            )
        return Activation.GELU_TANH
    name = config.get("hidden_act", "silu")
    if name != Activation.SILU:
        raise ValueError(f"only the SiLU gated MLP is supported; got hidden_act={name!r}")
    return Activation.SILU


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


def _read_layer_types(
    config: Mapping[str, Any], architecture: Architecture, layers: int
) -> tuple[int | None, tuple[AttentionKind, ...] | None]:
    """The sliding window and, where layers differ, each layer's attention kind."""
    if architecture in (Architecture.LLAMA, Architecture.OLMO2):
        return None, None
    window = config.get("sliding_window")
    if architecture in (Architecture.MISTRAL, Architecture.MIXTRAL) or not window:
        return window or None, None
    qwen = architecture not in (Architecture.EXAONE4, Architecture.GEMMA3)
    if qwen and not config.get("use_sliding_window", False):
        return None, None
    if architecture is Architecture.QWEN3_MOE:
        return window, None
    names = config.get("layer_types")
    if not names:
        if architecture is Architecture.EXAONE4:
            default = _pattern_layers(config.get("sliding_window_pattern"), layers, "EXAONE 4.0")
        elif architecture is Architecture.GEMMA3:
            default = _pattern_layers(config.get("sliding_window_pattern", 6), layers, "Gemma 3")
        else:
            # Qwen3, Qwen2, Qwen2-MoE: by default the layers from `max_window_layers` on slide
            # (every other one below it for Qwen2-MoE).
            first = config.get("max_window_layers", layers)
            if architecture is Architecture.QWEN2_MOE:
                default = [bool((i + 1) % 2) and i < first for i in range(layers)]
            else:
                default = [i >= first for i in range(layers)]
        names = [(AttentionKind.SLIDING if s else AttentionKind.FULL).value for s in default]
    known = {kind.value for kind in AttentionKind}
    if len(names) != layers or not set(names) <= known:
        raise ValueError(
            f"layer_types must name one of {sorted(known)} for each of the {layers} layers; got "
            f"{names!r}"
        )
    kinds = tuple(AttentionKind(name) for name in names)
    if AttentionKind.SLIDING not in kinds:
        return None, None
    if set(kinds) == {AttentionKind.SLIDING}:
        return window, None
    return window, kinds


def _pattern_layers(pattern: Any, layers: int, family: str) -> list[bool]:
    """Which layers slide by an integer `sliding_window_pattern` (every pattern-th is full), as
    transformers derives `layer_types` when config.json has none."""
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise ValueError(
            f"{family} config.json without layer_types needs an integer sliding_window_pattern; "
            f"got {pattern!r}. Give layer_types"
        )
    return [bool((i + 1) % pattern) for i in range(layers)]


PRESETS: dict[str, DecoderConfig] = {
    "tiny-qwen3": DecoderConfig(
        architecture=Architecture.QWEN3,
        vocab_size=256,
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
        vocab_size=256,
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
"""Named configurations for demos and tests; none needs a checkpoint. Every vocabulary holds at
least the 256 byte values, so any preset trains on byte-level text."""
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
