"""The shapes and constants of the gated delta rule's mixers: Gated DeltaNet (Qwen3-Next's and
Qwen3.5's `linear_attention` layers) and Kimi Delta Attention (Kimi-Linear's); static and
hashable."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

import jax.numpy as jnp


class DeltaProjections(enum.Enum):
    """How a checkpoint holds a Gated DeltaNet's input projections.

    PER_KEY_HEAD: Qwen3-Next's fused `in_proj_qkvz` [k_heads * (2 k_dim + 2 r v_dim), hidden]
      and `in_proj_ba` [k_heads * 2 r, hidden], blocks per key head (r = v_heads / k_heads):
      q, k, that head's r values, their r gates; then its r betas and r gate inputs.
    SEPARATE: Qwen3.5's `in_proj_qkv` [2 key_dim + value_dim, hidden] (all q, all k, all v),
      `in_proj_z` [value_dim, hidden], `in_proj_b` and `in_proj_a` [v_heads, hidden].
    """

    PER_KEY_HEAD = "per_key_head"
    SEPARATE = "separate"


def check_chunk_storage(storage: str | None) -> None:
    """Raises ValueError unless `storage` is None or a float dtype name of at most 32 bits."""
    if storage is None:
        return
    try:
        dtype = jnp.dtype(storage)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize > 4:
        raise ValueError(
            f"chunk_storage must be None or a float dtype name of at most 32 bits, such as "
            f"'bfloat16'; got {storage!r}"
        )


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetSpec:
    """The shapes and constants of one Gated DeltaNet mixer.

    Attributes:
      hidden_size: Model width (the projections' input, out_proj's output).
      num_k_heads: Query / key heads (HF `linear_num_key_heads`).
      num_v_heads: Value heads (`linear_num_value_heads`), a multiple of num_k_heads: value
        head h reads key head h // (num_v_heads // num_k_heads).
      k_dim: Channels per query / key head (`linear_key_head_dim`); the state is
        [k_dim, v_dim] per value head.
      v_dim: Channels per value head (`linear_value_head_dim`).
      conv_kernel: Width of the causal depthwise convolution over q, k, v
        (`linear_conv_kernel_dim`).
      chunk_size: Rows per chunk of the prefill's chunked form.
      chunk_storage: The dtype name in which the chunked form stores its row-sized terms
        between matmuls (`gated_delta_rule_chunked`'s `storage`): None for the activations'
        dtype (bf16 in a bf16 model, as flash-linear-attention), or "float32" (twice the bytes,
        a tenth of bf16's error).
      eps: Epsilon of the gated output RMSNorm (`rms_norm_eps`).
      projections: How the checkpoint holds the input projections.
    """

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int = 4
    chunk_size: int = 64
    chunk_storage: str | None = None
    eps: float = 1e-6
    projections: DeltaProjections = DeltaProjections.PER_KEY_HEAD

    def __post_init__(self):
        sizes = {
            name: getattr(self, name)
            for name in (
                "hidden_size",
                "num_k_heads",
                "num_v_heads",
                "k_dim",
                "v_dim",
                "conv_kernel",
                "chunk_size",
            )
        }
        if min(sizes.values()) < 1:
            raise ValueError(f"Gated DeltaNet sizes must be positive; got {sizes}")
        check_chunk_storage(self.chunk_storage)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads "
                f"({self.num_k_heads}): each key head serves a whole number of value heads"
            )

    @property
    def values_per_key(self) -> int:
        """Value heads per key head (r)."""
        return self.num_v_heads // self.num_k_heads

    @property
    def key_size(self) -> int:
        """Channels of q (and of k): num_k_heads * k_dim."""
        return self.num_k_heads * self.k_dim

    @property
    def value_size(self) -> int:
        """Channels of v (and of the gate z and the output): num_v_heads * v_dim."""
        return self.num_v_heads * self.v_dim

    @property
    def key_head_width(self) -> int:
        """Columns of one key head's block of Qwen3-Next's `in_proj_qkvz`: q, k, r v, r z."""
        return 2 * self.k_dim + 2 * self.values_per_key * self.v_dim

    @property
    def conv_rows(self) -> dict[str, tuple[int, int]]:
        """The channel range of q, k and v in Hugging Face's `conv1d` [2 key + value, 1, K]."""
        key, value = self.key_size, self.value_size
        return {"q": (0, key), "k": (key, 2 * key), "v": (2 * key, 2 * key + value)}

    @classmethod
    def from_hf_config(
        cls, config: Mapping, projections: DeltaProjections, *, chunk_size: int = 64
    ) -> GatedDeltaNetSpec:
        """The spec of a Hugging Face Qwen3-Next / Qwen3.5 text config (config.json as a dict).

        Raises:
          NotImplementedError: An activation other than SiLU.
        """
        if config.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(
                f"the Gated DeltaNet conv activation is silu; got {config['hidden_act']!r}"
            )
        return cls(
            hidden_size=config["hidden_size"],
            num_k_heads=config["linear_num_key_heads"],
            num_v_heads=config["linear_num_value_heads"],
            k_dim=config["linear_key_head_dim"],
            v_dim=config["linear_value_head_dim"],
            conv_kernel=config.get("linear_conv_kernel_dim", 4),
            chunk_size=chunk_size,
            eps=float(config.get("rms_norm_eps", 1e-6)),
            projections=projections,
        )


@dataclasses.dataclass(frozen=True)
class KimiDeltaSpec:
    """The shapes and constants of one Kimi Delta Attention mixer.

    Attributes:
      hidden_size: Model width.
      num_heads: Heads (HF `linear_attn_config.num_heads`); q, k and v have as many.
      head_dim: Channels per head (`head_dim`); the state is [head_dim, head_dim] per head.
      conv_kernel: Width of the causal depthwise convolution (`short_conv_kernel_size`).
      chunk_size: Rows per chunk of the prefill's chunked form.
      chunk_storage: As `GatedDeltaNetSpec`'s.
      eps: Epsilon of the gated output RMSNorm (`rms_norm_eps`).
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    chunk_size: int = 64
    chunk_storage: str | None = None
    eps: float = 1e-5

    def __post_init__(self):
        check_chunk_storage(self.chunk_storage)

    @property
    def width(self) -> int:
        """Channels of each of q, k, v, the gates and the output: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    def cache_spec(self) -> GatedDeltaNetSpec:
        """The Gated DeltaNet shapes whose `DeltaCache` this mixer's decode state takes."""
        return GatedDeltaNetSpec(
            hidden_size=self.hidden_size,
            num_k_heads=self.num_heads,
            num_v_heads=self.num_heads,
            k_dim=self.head_dim,
            v_dim=self.head_dim,
            conv_kernel=self.conv_kernel,
            chunk_size=self.chunk_size,
            chunk_storage=self.chunk_storage,
            eps=self.eps,
        )


@dataclasses.dataclass(frozen=True)
class LinearAttentionLayers:
    """Which layers of a decoder mix tokens by linear attention (the gated delta rule) instead of
    attention.

    Attributes:
      spec: Every linear-attention mixer's shapes: Gated DeltaNet's, or Kimi Delta
        Attention's.
      layers: Per layer, True where its token mixer is linear attention (`linear_attention`),
        False where it is full attention.
    """

    spec: GatedDeltaNetSpec | KimiDeltaSpec
    layers: tuple[bool, ...]

    def __post_init__(self):
        if not isinstance(self.layers, tuple) or not all(isinstance(x, bool) for x in self.layers):
            raise TypeError(f"layers must be a tuple of bools; got {self.layers!r}")
