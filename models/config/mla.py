"""Multi-head latent attention's shapes and RoPE (`MlaConfig`): static and hashable."""

from __future__ import annotations

import dataclasses

from .rope_scaling import RopeScaling, YarnRopeScaling


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
      rotary: The rope dimensions are rotated by position; False: they stay as projected
        (Kimi-Linear's latent attention, without positional encoding, still shares the one
        "rope" key across heads).
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
    rotary: bool = True

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
