"""Arcee AFM (Hugging Face `ArceeForCausalLM`): grouped-query attention with YaRN RoPE where
the config asks for it (its cos/sin factor included), and an ungated MLP, `down(relu(up(x))^2)`,
with biases where `mlp_bias` asks for them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from ..config import Activation, DecoderConfig, YarnRopeScaling
from ..config.hf import (
    attention_bias,
    plain_decoder,
    plain_decoder_json,
    read_activation,
)
from ..config.registry import add_presets, register
from ..config.rope_scaling import read_rope
from ..config.tensors import (
    NORM_TENSORS,
    UNGATED_MLP_BIAS_TENSORS,
    UNGATED_MLP_TENSORS,
    HFTensor,
    attention_tensors,
    decoder_tensor_names,
)
from ..decoder.model import CausalLM
from ..layers.activations import relu2
from ..layers.ungated_mlp import UngatedMlp


@register
class ArceeForCausalLM(CausalLM):
    """Arcee AFM: grouped-query attention, YaRN RoPE, an ungated relu^2 MLP.

    FP8 is refused (`quantizable`): its ungated MLP's projections do not take the model's
    `linears`.
    """

    architectures = ("ArceeForCausalLM",)
    model_type = "arcee"
    # transformers' ArceeConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": False,
        "hidden_act": "relu2",
        "hidden_size": 2560,
        "initializer_range": 0.02,
        "intermediate_size": 18432,
        "max_position_embeddings": 4096,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
    }
    lora = True
    quantizable = False
    mlp_biases = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        """Reads the plain decoder's keys with relu^2 (and YaRN RoPE, as AFM-4.5B asks for).

        Raises:
          ValueError: A `hidden_act` other than relu2, another RoPE type, or a missing key.
        """
        activation = read_activation(hf_config, Activation.RELU2)
        return plain_decoder(
            hf_config,
            cls.architectures[0],
            **attention_bias(hf_config),
            mlp_bias=bool(hf_config.get("mlp_bias", False)),
            rope=read_rope(hf_config),
            activation=activation,
        )

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return plain_decoder_json(config, cls.model_type) | {"mlp_bias": config.mlp_bias}

    @classmethod
    def check_config(cls, config: DecoderConfig) -> None:
        """Raises unless `config` has relu^2 and plain grouped-query attention (no q/k norm or
        window; q/k/v and o biases alike, `attention_bias`, or none).

        Raises:
          ValueError: Another activation, q/k norms, q/k/v biases without the o bias (or the
            reverse), or a sliding window.
        """
        super().check_config(config)
        if (
            config.activation is not Activation.RELU2
            or config.qk_norm
            or config.qkv_bias != config.o_bias
            or config.sliding_window is not None
        ):
            raise ValueError(
                "an ArceeForCausalLM config has relu^2, q/k/v/o biases alike and no q/k norm or "
                "window; got "
                f"{config.activation=}, {config.qk_norm=}, {config.qkv_bias=}, {config.o_bias=}, "
                f"{config.sliding_window=}"
            )

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        dense = NORM_TENSORS[config.residual_design] | attention_tensors(config)
        dense |= UNGATED_MLP_TENSORS | (UNGATED_MLP_BIAS_TENSORS if config.mlp_bias else {})
        return decoder_tensor_names(config, scan_layers=scan_layers, dense=dense)

    def make_mlp(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> UngatedMlp:
        """Layer `index`'s ungated relu^2 MLP."""
        del index
        config = self.config
        return UngatedMlp(
            config.hidden_size,
            config.intermediate_size,
            activation=relu2,
            topology=self.topology,
            bias=config.mlp_bias,
            dtype=dtype,
            init_std=config.initializer_range,
            lora=self.options.lora,
            rngs=rngs,
        )


TINY = DecoderConfig(
    architecture="ArceeForCausalLM",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=1e4,
    rope_scaling=YarnRopeScaling(factor=4.0, original_max_position_embeddings=512),
    qk_norm=False,
    tie_word_embeddings=False,
    sliding_window=None,
    max_position_embeddings=2048,
    activation=Activation.RELU2,
)
# About 0.4M parameters: AFM-4.5B's shape (YaRN over 4x its pre-training context) made small.
add_presets({"tiny-arcee": TINY})
