"""RoPE frequency scalings a config may name (Hugging Face `rope_type`: llama3, linear, yarn)."""

from __future__ import annotations

import dataclasses
import math


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(factor) + 1` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN RoPE scaling (Hugging Face `rope_type: "yarn"`), with DeepSeek's magnitude factors.

    Frequencies whose wavelength fits the original context are kept, long ones are divided by
    `factor`, with a linear ramp between the two bands (in rotation counts `beta_fast` and
    `beta_slow`). cos and sin are multiplied by `attention_factor`, so the rotated part of
    every score gains its square.

    Attributes:
      factor: Divisor of the interpolated (low) frequencies (> 0).
      original_max_position_embeddings: The context length the model was pre-trained with.
      beta_fast: Rotations that bound the extrapolated band (HF default 32).
      beta_slow: Rotations that bound the interpolated band (HF default 1).
      mscale: DeepSeek's `mscale` (numerator of the cos/sin factor), or None.
      mscale_all_dim: DeepSeek's `mscale_all_dim`: the denominator of the cos/sin factor, and
        DeepSeek attention multiplies its softmax scale by `yarn_mscale(factor,
        mscale_all_dim) ** 2` (`softmax_scale_factor`); None or 0 for neither.
      explicit_attention_factor: The config's `attention_factor`, or None to derive it.
      truncate: Round the correction band's bounds outwards to whole dimensions (HF default).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    explicit_attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if not self.factor > 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(
                "YaRN RoPE scaling needs a positive factor and original context; got "
                f"{self.factor=}, {self.original_max_position_embeddings=}"
            )

    @property
    def attention_factor(self) -> float:
        """The factor of cos and sin: the explicit one, else `yarn_mscale(factor, mscale) /
        yarn_mscale(factor, mscale_all_dim)` where both are set, else `yarn_mscale(factor)`."""
        if self.explicit_attention_factor is not None:
            return self.explicit_attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """DeepSeek attention's extra factor of the softmax scale: `yarn_mscale(factor,
        mscale_all_dim) ** 2`, or 1 without `mscale_all_dim`."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


RopeScaling = Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling
