"""Frozen decoder configurations: the types every family, reader and preset builds.

Every family reads its Hugging Face config into one `DecoderConfig`: dense, post-norm and
sandwich-norm decoders, mixture-of-experts decoders and hybrid stacks of single-stage layers; the
sparse FFN's facts sit in its `moe` field, a hybrid stack's in its `hybrid` field, and what
differs between the attention of one layer and another (window, RoPE) is
`DecoderConfig.layer_attention`.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

from . import registry
from .hybrid import HybridConfig, HybridLayer
from .linear_attention import LinearAttentionLayers
from .mla import MlaConfig
from .rope_scaling import QueryScaling, RopeScaling
from .routing import DeepseekRouting


class ResidualDesign(enum.Enum):
    """Where a decoder layer's norms sit around each stage.

    PRE_NORM: each stage reads `norm(residual)`; the update is `residual + output`.
    POST_NORM: each stage reads the residual as is; the update is `residual + norm(output)`
    SANDWICH: pre-norm read, and a norm of the complete output before the plain update.
    """

    PRE_NORM = "pre-norm"
    POST_NORM = "post-norm"
    SANDWICH = "sandwich"


class AttentionKind(enum.StrEnum):
    """The attention of one layer, by Hugging Face's `layer_types` names."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"


class Activation(enum.StrEnum):
    """The dense MLP's activation (Hugging Face `hidden_act` / `hidden_activation`): of the gate
    in a gated MLP (SiLU: SwiGLU; tanh GELU: GeGLU), or of the up projection in an ungated one
    (relu^2, xIELU)."""

    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"
    RELU2 = "relu2"
    XIELU = "xielu"

    @property
    def label(self) -> str:
        """The activation's name in messages."""
        return {
            Activation.SILU: "SiLU",
            Activation.GELU_TANH: "tanh GELU",
            Activation.RELU2: "relu^2",
            Activation.XIELU: "xIELU",
        }[self]

    @property
    def gated(self) -> bool:
        """The MLP multiplies the activated gate by an up projection (`layers.mlp.SwiGLU`);
        else it activates the up projection alone (`layers.ungated_mlp.UngatedMlp`)."""
        return self in (Activation.SILU, Activation.GELU_TANH)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The sparse FFN of a mixture-of-experts decoder: static and hashable.

    Attributes:
      num_experts: Routed experts per sparse layer (HF `num_experts` / `num_local_experts`).
      top_k: Experts each token is sent to (HF `num_experts_per_tok`).
      expert_intermediate_size: Width of one routed expert's SwiGLU (HF `moe_intermediate_size`;
        the `intermediate_size` of a family whose every layer is sparse).
      renormalize: The top-k router probabilities are divided by their sum (HF
        `norm_topk_prob`, or always for some families); otherwise they are the softmax over all
        experts as is.
      shared_expert_intermediate_size: Width of the shared expert every token also goes
        through, or None without one.
      shared_expert_gate: The shared expert's output is scaled by
        `sigmoid(x @ shared_expert_gate)` per token.
      mlp_only_layers: Layers whose FFN is dense (HF `mlp_only_layers`).
      decoder_sparse_step: Layer i is sparse when (i + 1) % decoder_sparse_step == 0 and it is
        not in `mlp_only_layers`; the others run the dense FFN of width `intermediate_size`.
      routing: DeepSeek's router (`config.deepseek.DeepseekRouting`: grouped top-k, scaled
        weights, a correction bias) in place of the plain softmax top-k; its experts, top-k
        and renormalization are the fields above.
      router_bias: The router's logits add a learned bias per expert.
      expert_bias: Each routed expert's gate/up and down projections add a bias.
      swiglu_limit: The routed experts compute the clamped SwiGLU `(up + 1) * gate *
        sigmoid(swiglu_alpha * gate)`, gate clamped above at the limit and up to +-limit;
        None for the plain SwiGLU.
      swiglu_alpha: The clamped SwiGLU's sigmoid gain.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    routing: DeepseekRouting | None = None
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be positive or None; got {self.swiglu_limit}")
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
        rule = self.routing
        if rule is not None and (rule.num_experts, rule.top_k, rule.renormalize) != (
            self.num_experts,
            self.top_k,
            self.renormalize,
        ):
            raise ValueError(
                "the routing rule must route the MoE's experts, top-k and renormalization; got "
                f"{rule=} for {self.num_experts=}, {self.top_k=}, {self.renormalize=}"
            )
        if rule is not None and self.shared_expert_gate:
            raise ValueError("DeepSeek's shared experts are ungated; got shared_expert_gate=True")

    @property
    def zero_experts(self) -> int:
        """Zero-computation (identity) experts the router scores after the routed ones
        (`routing.zero_experts`; LongCat-Flash), 0 for a MoE without them."""
        return 0 if self.routing is None else self.routing.zero_experts

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) runs the sparse FFN, by HF's rule."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


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
      rope_theta: RoPE base; None for no rotary embedding.
      rope_scaling: Frequency scaling of the RoPE, or None.
    """

    sliding_window: int | None
    rope_theta: float | None
    rope_scaling: RopeScaling | None = None


class QkNorm(enum.Enum):
    """Where the RMSNorm of the queries and keys (before RoPE) runs.

    PER_HEAD: over each head, one [head_dim] weight.
    WHOLE_PROJECTION: over all heads of the q or k projection, one weight per column.
    """

    PER_HEAD = "per-head"
    WHOLE_PROJECTION = "whole-projection"


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What one layer's self-attention uses (`DecoderConfig.attention_spec`): static, hashable.

    Attributes:
      hidden_size: Width of the rows the projections read and write.
      num_heads: Query heads.
      num_kv_heads: Key/value heads; query head j uses kv head j // (num_heads // num_kv_heads).
      head_dim: Width of one head.
      sliding_window: A row at position p attends to positions p - sliding_window < q <= p;
        None for full causal attention.
      rope_theta: RoPE base; None for no rotary embedding.
      rope_scaling: Frequency scaling of the RoPE, or None.
      qk_norm: Where the q/k RMSNorms run, or None for none.
      norm_eps: The q/k norms' epsilon.
      unit_offset_norms: The q/k norms scale by `1 + weight`.
      scale: The factor of the attention scores (`head_dim ** -0.5`, or
        `query_pre_attn_scalar ** -0.5`).
      qkv_bias: The q, k and v projections add a bias.
      init_std: The standard deviation the projections are drawn with (HF `initializer_range`).
      o_bias: The o projection adds a bias (counted once in the sum over attention TP).
      sinks: Each head has a learned sink logit in its softmax's denominator.
      rotary_dim: The RoPE rotates each head's first `rotary_dim` channels (partial RoPE);
        None: all of them.
      output_gate: q_proj also gives, per head, a gate: the attention output is multiplied by
        its sigmoid before o_proj (Qwen3-Next's gated attention).
      query_scaling: The queries' position-dependent scale after RoPE, or None.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    rope_theta: float | None
    rope_scaling: RopeScaling | None
    qk_norm: QkNorm | None
    norm_eps: float
    unit_offset_norms: bool
    scale: float
    qkv_bias: bool
    init_std: float
    o_bias: bool = False
    sinks: bool = False
    rotary_dim: int | None = None
    output_gate: bool = False
    query_scaling: QueryScaling | None = None


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The architecture of a decoder, as its family read it from a Hugging Face `config.json`:
    static and hashable. Every fact is a layer option (a norm's `1 + w`, the residual design,
    the embedding scale), so the layers never ask which family they are in.

    Attributes:
      architecture: The Hugging Face class the weights come from (`config.json`'s
        `architectures` entry, e.g. "DeepseekV3ForCausalLM"): the registered family that builds it
        (`models.config.registry`) checks the config on construction.
      vocab_size: Number of token ids (unpadded).
      hidden_size: Width of the residual stream.
      intermediate_size: Width of the dense FFN (in an MoE decoder, that of its dense layers; a
        family without dense layers may repeat its expert width here, as its config.json does).
      num_layers: Number of decoder layers.
      num_heads: Query heads.
      num_kv_heads: Key/value heads; query head j uses kv head j // (num_heads // num_kv_heads).
      head_dim: Width of one head (may differ from hidden_size // num_heads).
      rms_norm_eps: Epsilon of every RMSNorm, q/k norms included.
      rope_theta: RoPE base.
      rope_scaling: Frequency scaling of the RoPE, or None for plain RoPE.
      qk_norm: An RMSNorm of the queries and keys before RoPE (per head, or with
        `qk_norm_whole` over the whole projection).
      tie_word_embeddings: The LM head reuses the embedding table.
      sliding_window: A row at position p attends to positions p - sliding_window < q <= p;
        None for full causal attention.
      max_position_embeddings: Longest context the model supports.
      qkv_bias: The q, k and v projections add a bias.
      moe: The sparse FFN of an MoE decoder, or None for a dense decoder.
      layer_types: Per layer, full or sliding-window attention; None: every layer slides when
        `sliding_window` is set, none otherwise.
      rope_local_theta: RoPE base of the sliding-window layers (a local base, without
        `rope_scaling`); None: they use `rope_theta` and `rope_scaling` like the others.
      nope_full_layers: The full-attention layers apply no RoPE.
      qk_norm_whole: The q/k norms span the whole projection (all heads) instead of each head;
        needs `qk_norm`.
      query_pre_attn_scalar: Attention scores are scaled by its inverse square root; None: by
        `head_dim ** -0.5`.
      activation: The dense MLP's activation (SiLU: SwiGLU; GELU tanh: GeGLU; relu^2 or xIELU:
        an ungated MLP, which the family builds).
      initializer_range: The standard deviation of a fresh model's projections, embeddings and
        experts (HF `initializer_range`; norms start at ones, `1 + w` norms at zeros).
      hybrid: A hybrid stack's layer pattern and the facts of its Mamba2 and MoE layers (one
        stage per layer; `intermediate_size` is the relu^2 MLP's width, and attention applies
        no positional encoding), or None for a decoder of attention + FFN layers.
      mla: The multi-head latent attention of every layer (`config.mla.MlaConfig`), or None
        for grouped-query attention; with it, `num_heads` is its heads, `num_kv_heads` the
        same, `head_dim` its query/key width and the RoPE its RoPE.
      residual_design: Where each layer's norms sit around its stages.
      unit_offset_norms: Every RMSNorm (q/k norms and the final norm too) scales by
        `1 + weight`.
      embedding_scale: The factor the embedding's output is multiplied by (in the embedding's
        dtype), or None.
      o_bias: The attention's o projection adds a bias.
      mlp_bias: The dense MLP's projections add biases (the down projection's counted once in
        its sum over full TP); built by the families that read `mlp_bias`
        (`FamilyBase.mlp_biases`).
      attention_sinks: Each attention head has a learned sink logit in its softmax's
        denominator.
      rotary_dim: The RoPE rotates each head's first `rotary_dim` channels; None: all.
      attention_output_gate: Attention's q_proj also gives a per-head output gate.
      linear_attention: The layers whose token mixer is Gated DeltaNet, or None.
      query_scaling: Grouped-query attention's position-dependent query scale, or None.
      padding_id: The token whose embedding row takes no gradient from lookups (transformers'
        `nn.Embedding(padding_idx=pad_token_id)`), or None.
    """

    architecture: str
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
    initializer_range: float = 0.02
    hybrid: HybridConfig | None = None
    mla: MlaConfig | None = None
    residual_design: ResidualDesign = ResidualDesign.PRE_NORM
    unit_offset_norms: bool = False
    embedding_scale: float | None = None
    o_bias: bool = False
    mlp_bias: bool = False
    attention_sinks: bool = False
    rotary_dim: int | None = None
    attention_output_gate: bool = False
    linear_attention: LinearAttentionLayers | None = None
    query_scaling: QueryScaling | None = None
    padding_id: int | None = None

    def __post_init__(self):
        if not isinstance(self.architecture, str) or not self.architecture:
            raise TypeError(
                "DecoderConfig.architecture is the Hugging Face class name, e.g. "
                f"'DeepseekV3ForCausalLM'; got {self.architecture!r}"
            )
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
        if not self.initializer_range > 0:
            raise ValueError(f"initializer_range must be positive; got {self.initializer_range}")
        if self.embedding_scale is not None and not self.embedding_scale > 0:
            raise ValueError(
                f"embedding_scale must be positive or None; got {self.embedding_scale}"
            )
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError(
                f"rotary_dim must be even and in (0, head_dim={self.head_dim}]; got "
                f"{self.rotary_dim}"
            )
        linear = self.linear_attention
        if linear is not None and (
            len(linear.layers) != self.num_layers or linear.spec.hidden_size != self.hidden_size
        ):
            raise ValueError(
                f"linear_attention must name one layer kind per layer ({self.num_layers}) and "
                f"mixers of the model's hidden size ({self.hidden_size}); got {linear!r}"
            )
        self._check_hybrid()
        self._check_mla()
        if self.padding_id is not None and not 0 <= self.padding_id < self.vocab_size:
            raise ValueError(f"padding_id must be a token id; got {self.padding_id!r}")
        family = registry.family_named(self.architecture)
        if self.padding_id is not None and not family.embedding_padding:
            raise ValueError(f"{self.architecture}'s embedding takes no padding id")
        if self.tie_word_embeddings and not family.ties_head:
            raise ValueError(
                f"{self.architecture} has its own LM head (transformers never ties it to the "
                "embeddings); got tie_word_embeddings=True"
            )
        family.check_config(self)

    def _check_hybrid(self) -> None:
        hybrid = self.hybrid
        if hybrid is None:
            return
        if len(hybrid.layers) != self.num_layers:
            raise ValueError(
                f"the hybrid pattern {hybrid.pattern!r} names {len(hybrid.layers)} layers; "
                f"num_layers is {self.num_layers}"
            )
        if hybrid.mamba is not None and hybrid.mamba.hidden_size != self.hidden_size:
            raise ValueError(
                f"the Mamba2 mixers' hidden_size ({hybrid.mamba.hidden_size}) must be the "
                f"model's ({self.hidden_size})"
            )
        if not self.nope_full_layers or self.sliding_window is not None:
            raise ValueError(
                "a hybrid stack's attention applies no positional encoding over the whole "
                f"sequence: it needs nope_full_layers=True and no sliding window; got "
                f"{self.nope_full_layers=}, {self.sliding_window=}"
            )

    def _check_mla(self) -> None:
        """The latent attention's shapes and RoPE are those of the decoder."""
        mla = self.mla
        if mla is None:
            return
        shapes = (mla.hidden_size, mla.num_heads, mla.num_heads, mla.qk_head_dim)
        rope = (mla.rope_theta, mla.rope_scaling)
        if shapes != (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim) or (
            rope != (self.rope_theta, self.rope_scaling)
        ):
            raise ValueError(
                "the latent attention's hidden size, heads, head width and RoPE must be the "
                f"decoder's (num_kv_heads = num_heads, head_dim = nope + rope); got {mla=} in "
                f"a config of hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
            )

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

    def attention_spec(self, layer: int) -> AttentionSpec:
        """What layer `layer`'s self-attention uses: heads, its window and RoPE, q/k norms,
        score scale, biases and initializer."""
        attention = self.layer_attention(layer)
        qk_norm = None
        if self.qk_norm:
            qk_norm = QkNorm.WHOLE_PROJECTION if self.qk_norm_whole else QkNorm.PER_HEAD
        scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return AttentionSpec(
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            sliding_window=attention.sliding_window,
            rope_theta=attention.rope_theta,
            rope_scaling=attention.rope_scaling,
            qk_norm=qk_norm,
            norm_eps=self.rms_norm_eps,
            unit_offset_norms=self.unit_offset_norms,
            scale=scalar**-0.5,
            qkv_bias=self.qkv_bias,
            init_std=self.initializer_range,
            o_bias=self.o_bias,
            sinks=self.attention_sinks,
            rotary_dim=self.rotary_dim,
            output_gate=self.attention_output_gate,
            query_scaling=self.query_scaling,
        )

    def layer_blocks(self, scan_layers: bool) -> tuple[LayerBlock, ...]:
        """The blocks a model of this config holds its layers in, in order: one unscanned layer
        each without `scan_layers`; with it, the stack entry and the terminal layer alone
        (unscanned) and the layers between in scanned runs of one structure
        (`boundary_jax.StackedLayers`), split where the FFN (sparse or dense) or the attention
        (window, RoPE) changes, and after a change of FFN (a layer's attention input binds to
        what the previous FFN's exit hands on)."""
        count = self.num_layers
        if scan_layers and self.linear_attention is not None:
            raise NotImplementedError(
                "scanned runs of a stack with linear-attention (delta rule) layers are not "
                "supported: build it without scan_layers"
            )
        if scan_layers and self.hybrid is not None:
            raise NotImplementedError(
                f"scanned runs of a hybrid stack ({self.hybrid.pattern!r}) are not supported: "
                "build it without scan_layers"
            )
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
        """Per layer, whether its FFN is the sparse (MoE) one; all False for a dense decoder. A
        hybrid stack's MoE layers are its sparse layers."""
        if self.hybrid is not None:
            return tuple(layer is HybridLayer.MOE for layer in self.hybrid.layers)
        return tuple(
            self.moe is not None and self.moe.is_sparse(layer) for layer in range(self.num_layers)
        )

    @property
    def num_experts(self) -> int | None:
        """Routed experts of each sparse layer (a hybrid stack's MoE layers' included), or None
        for a model without experts."""
        if self.hybrid is not None:
            return None if self.hybrid.moe is None else self.hybrid.moe.num_experts
        return None if self.moe is None else self.moe.num_experts


def padded_vocab(vocab: int, shards: int) -> int:
    """`vocab` rounded up to a multiple of `shards`, so a vocab-parallel table splits evenly."""
    if vocab < 1 or shards < 1:
        raise ValueError(f"vocab and shards must be positive; got {vocab=}, {shards=}")
    return -(-vocab // shards) * shards
