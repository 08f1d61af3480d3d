"""RoPE frequency scalings a config may name (Hugging Face `rope_type`: llama3, linear, yarn,
dynamic), and the one reader and writer of a `config.json`'s RoPE keys every family shares."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any


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


@dataclasses.dataclass(frozen=True)
class DynamicNtkRopeScaling:
    """Dynamic NTK RoPE scaling (Hugging Face `rope_type: "dynamic"`): the base grows once a
    sequence passes `max_position_embeddings`, and not before, so within the context, which
    every runtime here holds inputs to, the frequencies are the unscaled ones. Kept to write
    the config back as it was read.

    Attributes:
      factor: The growth factor past the context (> 0).
    """

    factor: float

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"dynamic RoPE scaling needs a positive factor; got {self.factor=}")


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


RopeScaling = Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling | DynamicNtkRopeScaling


@dataclasses.dataclass(frozen=True)
class QueryScaling:
    """Llama 4's position-dependent query scale (Ministral 3's `llama_4_scaling_beta`): the
    query at position p is multiplied, after its RoPE, by `1 + beta * log(1 + floor(p /
    period))`, so it is unscaled within the first `period` positions.

    Attributes:
      beta: The scale's slope (`llama_4_scaling_beta`).
      period: The positions each step of the scale spans (`original_max_position_embeddings`).
    """

    beta: float
    period: int

    def __post_init__(self):
        if not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"QueryScaling.period must be a positive int; got {self.period!r}")


class RopeType(enum.StrEnum):
    """The RoPE kinds a `config.json` names (`rope_type`, or the legacy `type`)."""

    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"
    YARN = "yarn"
    DYNAMIC = "dynamic"


def read_rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """The RoPE base and frequency scaling of a `config.json` (as a dict).

    Reads transformers 5's `rope_parameters` and the legacy top-level `rope_theta` +
    `rope_scaling` (which wins where a file holds both). A YaRN `factor` defaults to
    `max_position_embeddings / original_max_position_embeddings`.

    Args:
      config: The config as a dict.

    Raises:
      ValueError: No `rope_theta`, a kind outside `RopeType`, a scaling missing a key, or a
        file holding both forms with another base in `rope_parameters` than at the top level
        (transformers then reads the top level's, or its default, and drops `rope_parameters`).
    """
    parameters = config.get("rope_parameters") or {}
    theta = parameters.get("rope_theta", config.get("rope_theta"))
    if config.get("rope_scaling") and theta != config.get("rope_theta"):
        raise ValueError(
            f"config.json holds rope_scaling beside rope_parameters, whose rope_theta ({theta}) "
            f"is not the top-level rope_theta ({config.get('rope_theta')}): transformers reads "
            "rope_scaling with the top-level base and drops rope_parameters. Keep one of the two "
            "forms (the scaling inside rope_parameters, or rope_theta at the top level)"
        )
    if theta is None:
        raise ValueError(
            "config.json names no rope_theta (at the top level or in rope_parameters); it is "
            "required to build the decoder"
        )
    scaling = config.get("rope_scaling") or parameters
    return float(theta), rope_scaling(scaling, config)


def read_latent_rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """`read_rope` of a latent attention (DeepSeek, LongCat-Flash), whose softmax scale
    transformers multiplies by `yarn_mscale(factor, mscale_all_dim) ** 2` under any scaling:
    here only YaRN carries that factor.

    Raises:
      ValueError: As `read_rope`, or an `mscale_all_dim` that scales under another RoPE type.
    """
    theta, scaling = read_rope(config)
    entry = config.get("rope_scaling") or config.get("rope_parameters") or {}
    factor = entry.get("factor") or 1
    if entry.get("mscale_all_dim") and factor > 1 and not isinstance(scaling, YarnRopeScaling):
        kind = entry.get("rope_type", entry.get("type"))
        raise ValueError(
            f"mscale_all_dim={entry['mscale_all_dim']!r} under {kind!r} RoPE scaling "
            "(transformers then scales the latent attention's softmax) is not built; it is "
            "read with yarn scaling"
        )
    return theta, scaling


def rope_scaling(
    scaling: Mapping[str, Any], config: Mapping[str, Any] | None = None
) -> RopeScaling | None:
    """The frequency scaling one RoPE entry names (None for `default`).

    As transformers does, a llama3 or YaRN entry without `original_max_position_embeddings`
    takes the config's top-level one, else its `max_position_embeddings`; a YaRN entry without
    `factor` (which transformers refuses) takes `max_position_embeddings /
    original_max_position_embeddings`.

    Raises:
      ValueError: A kind outside `RopeType` (dynamic NTK, longrope...), or a scaling missing a
        key.
    """
    name = scaling.get("rope_type", scaling.get("type", RopeType.DEFAULT.value))
    if name == "mrope":  # a legacy name of M-RoPE (multimodal RoPE), the default RoPE on text
        name = RopeType.DEFAULT.value
    if name not in {kind.value for kind in RopeType}:
        supported = ", ".join(repr(kind.value) for kind in RopeType)
        raise ValueError(f"RoPE type {name!r} is not supported; supported: {supported}")
    kind = RopeType(name)
    if kind is RopeType.DEFAULT:
        return None
    config = config or {}
    original = config.get("original_max_position_embeddings") or scaling.get(
        "original_max_position_embeddings", config.get("max_position_embeddings")
    )
    required = {
        RopeType.LINEAR: ("factor",),
        RopeType.LLAMA3: ("factor", "low_freq_factor", "high_freq_factor"),
        RopeType.YARN: (),
        RopeType.DYNAMIC: ("factor",),
    }[kind]
    missing = [key for key in required if key not in scaling]
    if kind in (RopeType.LLAMA3, RopeType.YARN) and original is None:
        missing.append("original_max_position_embeddings")
    if missing:
        raise ValueError(f"{kind.value} RoPE scaling is missing {missing}; got {dict(scaling)!r}")
    if kind is RopeType.LINEAR:
        return LinearRopeScaling(float(scaling["factor"]))
    if kind is RopeType.DYNAMIC:
        return DynamicNtkRopeScaling(float(scaling["factor"]))
    if kind is RopeType.LLAMA3:
        return Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    original = int(original)
    factor = scaling.get("factor")
    if factor is None:
        if config.get("max_position_embeddings") is None:
            raise ValueError(f"yarn RoPE scaling has no factor; got {dict(scaling)!r}")
        factor = config["max_position_embeddings"] / original
    return YarnRopeScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        mscale=scaling.get("mscale"),
        mscale_all_dim=scaling.get("mscale_all_dim"),
        explicit_attention_factor=scaling.get("attention_factor"),
        truncate=bool(scaling.get("truncate", True)),
    )


def rope_parameters(theta: float | None, scaling: RopeScaling | None) -> dict[str, Any]:
    """transformers 5's `rope_parameters` of a RoPE base and scaling (`read_rope` reads it
    back)."""
    rope: dict[str, Any] = {"rope_theta": theta, "rope_type": RopeType.DEFAULT.value}
    if isinstance(scaling, YarnRopeScaling):
        yarn = {
            "rope_type": RopeType.YARN.value,
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
        rope |= {"rope_type": RopeType.LINEAR.value, "factor": scaling.factor}
    elif isinstance(scaling, DynamicNtkRopeScaling):
        rope |= {"rope_type": RopeType.DYNAMIC.value, "factor": scaling.factor}
    elif isinstance(scaling, Llama3RopeScaling):
        rope |= dataclasses.asdict(scaling) | {"rope_type": RopeType.LLAMA3.value}
    return rope
