"""Hybrid stacks of single-stage layers (Nemotron-H): the layer pattern, the Mamba2 mixer's shapes
and the sigmoid-routed MoE's facts; static and hashable.

A hybrid layer is ONE stage: a Mamba2 mixer, an attention mixer (no positional encoding), a
relu^2 MLP or a mixture of relu^2 experts, each reading `norm(residual)` and adding its output.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping


class HybridLayer(enum.StrEnum):
    """The stage of one hybrid layer, by Hugging Face's `layers_block_type` names.

    MAMBA2: a Mamba2 mixer (`linear_attention`, pattern letter `M`).
    ATTENTION: grouped-query attention without positional encoding (`full_attention`, `*`).
    MLP: `down(relu(up(x))^2)` (`mlp`, `-`).
    MOE: sigmoid-routed relu^2 experts plus a shared relu^2 expert (`moe`, `E`).
    """

    MAMBA2 = "linear_attention"
    ATTENTION = "full_attention"
    MLP = "mlp"
    MOE = "moe"

    @property
    def letter(self) -> str:
        """The layer's letter in a `hybrid_override_pattern` string."""
        return _LETTERS[self]

    @property
    def is_mixer(self) -> bool:
        """A token mixer (Mamba2 or attention), as opposed to an FFN (MLP or MoE)."""
        return self in (HybridLayer.MAMBA2, HybridLayer.ATTENTION)


_LETTERS = {
    HybridLayer.MAMBA2: "M",
    HybridLayer.ATTENTION: "*",
    HybridLayer.MLP: "-",
    HybridLayer.MOE: "E",
}


def parse_pattern(pattern: str) -> tuple[HybridLayer, ...]:
    """The layers of a `hybrid_override_pattern` string, e.g. "M-M*-" (M Mamba2, * attention,
    - MLP, E MoE).

    Raises:
      ValueError: An empty pattern or a letter outside M, *, - and E.
    """
    by_letter = {letter: layer for layer, letter in _LETTERS.items()}
    bad = sorted(set(pattern) - set(by_letter))
    if not pattern or bad:
        raise ValueError(
            f"a hybrid pattern is a non-empty string over {sorted(by_letter)} (M Mamba2, * "
            f"attention, - MLP, E MoE); got {pattern!r}"
        )
    return tuple(by_letter[letter] for letter in pattern)


@dataclasses.dataclass(frozen=True)
class Mamba2Spec:
    """The shapes and constants of one Mamba2 mixer.

    Attributes:
      hidden_size: Model width (in_proj input, out_proj output).
      num_heads: SSM heads (Hugging Face `mamba_num_heads`).
      head_dim: Channels per head (`mamba_head_dim`).
      n_groups: Groups of B/C rows; head h uses group h // (num_heads // n_groups).
      state_size: SSM state per head channel (`ssm_state_size`).
      conv_kernel: Width of the causal depthwise convolution.
      chunk_size: Rows per chunk of the prefill's chunked scan.
      eps: Epsilon of the gated group RMSNorm (`layer_norm_epsilon`).
      time_step_limit: (min, max) the time step is clipped to after the softplus.
      conv_bias: Whether the convolution has a bias (`use_conv_bias`).
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int = 4
    chunk_size: int = 128
    eps: float = 1e-5
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    conv_bias: bool = True

    def __post_init__(self):
        sizes = {
            name: getattr(self, name)
            for name in ("hidden_size", "num_heads", "head_dim", "n_groups", "state_size")
        }
        sizes |= {"conv_kernel": self.conv_kernel, "chunk_size": self.chunk_size}
        if min(sizes.values()) < 1:
            raise ValueError(f"Mamba2 sizes must be positive; got {sizes}")
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of n_groups "
                f"({self.n_groups}): each group serves a whole number of heads"
            )
        low, high = self.time_step_limit
        if not 0 <= low <= high:
            raise ValueError(
                f"time_step_limit must be (min, max), 0 <= min <= max; got {low, high}"
            )

    @property
    def intermediate_size(self) -> int:
        """Channels of x, z and y: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def bc_width(self) -> int:
        """Channels of B (and of C): n_groups * state_size."""
        return self.n_groups * self.state_size

    @property
    def in_proj_rows(self) -> dict[str, tuple[int, int]]:
        """The row range of each projection in Hugging Face's fused `in_proj.weight`
        [2I + 2GN + H, hidden]: z, x, B, C, dt (I intermediate size, GN `bc_width`, H heads)."""
        inner, width = self.intermediate_size, self.bc_width
        starts = (0, inner, 2 * inner, 2 * inner + width, 2 * inner + 2 * width)
        stops = (*starts[1:], 2 * inner + 2 * width + self.num_heads)
        return dict(zip(("z", "x", "B", "C", "dt"), zip(starts, stops, strict=True), strict=True))

    @property
    def conv_rows(self) -> dict[str, tuple[int, int]]:
        """The channel range of x, B and C in Hugging Face's `conv1d` [I + 2GN, 1, K]."""
        inner, width = self.intermediate_size, self.bc_width
        return {
            "x": (0, inner),
            "B": (inner, inner + width),
            "C": (inner + width, inner + 2 * width),
        }

    @classmethod
    def from_hf_config(cls, config: Mapping) -> Mamba2Spec:
        """The spec of a Hugging Face `NemotronHConfig` (its config.json as a dict).

        Reads the legacy key names too (`mamba_n_groups`, `mamba_d_conv`, `mamba_dt_min`,
        `mamba_conv_bias`, `mamba_chunk_size`, taking precedence as in `NemotronHConfig`) and
        that class's defaults for absent keys. Hugging Face's mixer clips the time step to
        (time_step_min, inf); the config's own `time_step_limit` key is read by neither.

        Raises:
          NotImplementedError: The config asks for projection biases (`use_bias`) or an
            activation other than SiLU.
        """
        if config.get("use_bias", False):
            raise NotImplementedError("Mamba2 in_proj / out_proj biases are not supported")
        if config.get("mamba_hidden_act", "silu") != "silu":
            raise NotImplementedError(
                f"Mamba2 activation must be silu; got {config['mamba_hidden_act']!r}"
            )

        def read(key: str, legacy: str, default):
            return config.get(legacy, config.get(key, default))

        return cls(
            hidden_size=config["hidden_size"],
            num_heads=config.get("mamba_num_heads", 128),
            head_dim=config.get("mamba_head_dim", 64),
            n_groups=read("n_groups", "mamba_n_groups", 8),
            state_size=config.get("ssm_state_size", 128),
            conv_kernel=read("conv_kernel", "mamba_d_conv", 4),
            chunk_size=read("chunk_size", "mamba_chunk_size", 128),
            eps=config.get("layer_norm_epsilon", 1e-5),
            time_step_limit=(read("time_step_min", "mamba_dt_min", 1e-3), math.inf),
            conv_bias=read("use_conv_bias", "mamba_conv_bias", True),
        )


@dataclasses.dataclass(frozen=True)
class HybridMoeConfig:
    """The MoE layers of a hybrid stack (Nemotron-3): relu^2 experts chosen by a sigmoid router
    with a score-correction bias and a grouped top-k, plus a shared relu^2 expert.

    Attributes:
      num_experts: Routed experts (HF `n_routed_experts`).
      top_k: Experts per token (HF `num_experts_per_tok`).
      expert_intermediate_size: Width of one routed expert (HF `moe_intermediate_size`).
      shared_expert_intermediate_size: Width of the shared expert every token also goes
        through (HF `moe_shared_expert_intermediate_size`).
      num_groups: Equal groups the experts form (HF `n_group`); each is scored by the sum of
        its two best biased scores, and only the `topk_groups` best groups are chosen from.
      topk_groups: Groups a token may choose experts from (HF `topk_group`).
      renormalize: The k weights are divided by their sum + 1e-20 (HF `norm_topk_prob`).
      scaling_factor: The weights' factor (HF `routed_scaling_factor`).
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_expert_intermediate_size: int
    num_groups: int = 1
    topk_groups: int = 1
    renormalize: bool = True
    scaling_factor: float = 1.0

    def __post_init__(self):
        for name in (
            "num_experts",
            "top_k",
            "expert_intermediate_size",
            "shared_expert_intermediate_size",
            "num_groups",
            "topk_groups",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"HybridMoeConfig.{name} must be a positive int; got {value!r}")


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """The layers of a hybrid stack and the facts of its Mamba2 and MoE layers.

    Attributes:
      layers: One `HybridLayer` per decoder layer.
      mamba: The Mamba2 mixers' spec; None when no layer is Mamba2.
      moe: The MoE layers' facts; None when no layer is MoE.
    """

    layers: tuple[HybridLayer, ...]
    mamba: Mamba2Spec | None = None
    moe: HybridMoeConfig | None = None

    def __post_init__(self):
        if (
            not isinstance(self.layers, tuple)
            or not self.layers
            or any(not isinstance(layer, HybridLayer) for layer in self.layers)
        ):
            raise TypeError(
                f"HybridConfig.layers must be a non-empty tuple of HybridLayer; got {self.layers!r}"
            )
        for kind, facts, name in (
            (HybridLayer.MAMBA2, self.mamba, "mamba"),
            (HybridLayer.MOE, self.moe, "moe"),
        ):
            if (kind in self.layers) != (facts is not None):
                raise ValueError(
                    f"HybridConfig.{name} is needed exactly when a layer is {kind.value}; got "
                    f"pattern {self.pattern!r} and {name}={facts!r}"
                )

    @property
    def pattern(self) -> str:
        """The layers as a `hybrid_override_pattern` string, e.g. "M-M*-"."""
        return "".join(layer.letter for layer in self.layers)
