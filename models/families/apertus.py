"""Apertus (Hugging Face `ApertusForCausalLM`): grouped-query attention with a q/k RMSNorm per
head and llama3 RoPE scaling, and an ungated MLP, `down(xielu(up(x)))`, whose xIELU activation
has trainable coefficients per layer; its layer norms are `attention_layernorm` and
`feedforward_layernorm` in the checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from ..config import Activation, DecoderConfig, Llama3RopeScaling
from ..config.hf import attention_bias, plain_decoder, plain_decoder_json, read_activation
from ..config.registry import add_presets, register
from ..config.tensors import (
    UNGATED_MLP_TENSORS,
    HFTensor,
    attention_tensors,
    decoder_tensor_names,
)
from ..decoder.model import CausalLM
from ..layers.activations import Xielu
from ..layers.ungated_mlp import UngatedMlp

NORM_TENSORS = {
    "input_norm.weight": HFTensor("attention_layernorm.weight"),
    "post_attn_norm.weight": HFTensor("feedforward_layernorm.weight"),
}
"""The pre-norm layer's two norms under Apertus's names."""
XIELU_TENSORS = {
    f"mlp.act_fn.{name}": HFTensor(f"mlp.act_fn.{name}")
    for name in ("alpha_p", "alpha_n", "beta", "eps")
}
"""Each layer's xIELU coefficients (`layers.activations.Xielu`): the alphas [1], beta and eps
[] (buffers in transformers, saved with the weights)."""


@register
class ApertusForCausalLM(CausalLM):
    """Apertus: per-head q/k norms, llama3 RoPE, an ungated xIELU MLP.

    FP8 is refused (`quantizable`): its ungated MLP's projections do not take the model's
    `linears`.
    """

    architectures = ("ApertusForCausalLM",)
    model_type = "apertus"
    # transformers' ApertusConfig defaults: a key config.json leaves out reads as there.
    config_defaults = {
        "attention_bias": False,
        "hidden_act": "xielu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 65536,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 12000000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        "rope_theta": 12000000.0,
        "tie_word_embeddings": False,
        "vocab_size": 131072,
        "pad_token_id": 3,
    }
    lora = True
    quantizable = False

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        """Reads the plain decoder's keys with per-head q/k norms, xIELU and `attention_bias`.

        Raises:
          ValueError: A `hidden_act` other than xielu, a RoPE type outside `RopeType`, or a
            missing key.
        """
        architecture = cls.architectures[0]
        activation = read_activation(hf_config, Activation.XIELU)
        return plain_decoder(
            hf_config,
            architecture,
            **attention_bias(hf_config),
            qk_norm=True,
            activation=activation,
        )

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        return plain_decoder_json(config, cls.model_type)

    @classmethod
    def check_config(cls, config: DecoderConfig) -> None:
        """Raises unless `config` has per-head q/k norms and xIELU, q/k/v and o biases alike
        (`attention_bias`) or none, and no window (what the family builds).

        Raises:
          ValueError: Another activation, no q/k norm or one over the whole projection, q/k/v
            biases without the o bias (or the reverse), or a sliding window.
        """
        super().check_config(config)
        if (
            config.activation is not Activation.XIELU
            or not config.qk_norm
            or config.qk_norm_whole
            or config.qkv_bias != config.o_bias
            or config.sliding_window is not None
        ):
            raise ValueError(
                "an ApertusForCausalLM config has xIELU, per-head q/k norms, q/k/v/o biases alike "
                f"and no window; got {config.activation=}, {config.qk_norm=}, "
                f"{config.qk_norm_whole=}, {config.qkv_bias=}, {config.o_bias=}, "
                f"{config.sliding_window=}"
            )

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        dense = NORM_TENSORS | attention_tensors(config) | UNGATED_MLP_TENSORS | XIELU_TENSORS
        return decoder_tensor_names(config, scan_layers=scan_layers, dense=dense)

    def make_mlp(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> UngatedMlp:
        """Layer `index`'s ungated MLP with its own xIELU (transformers' starting values)."""
        del index
        config = self.config
        return UngatedMlp(
            config.hidden_size,
            config.intermediate_size,
            activation=Xielu(dtype=dtype),
            topology=self.topology,
            dtype=dtype,
            init_std=config.initializer_range,
            lora=self.options.lora,
            rngs=rngs,
        )


add_presets(
    {
        # About 0.4M parameters: Apertus-8B's shape (llama3 RoPE, q/k norms) made small.
        "tiny-apertus": DecoderConfig(
            architecture="ApertusForCausalLM",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            head_dim=8,
            rms_norm_eps=1e-5,
            rope_theta=12e6,
            rope_scaling=Llama3RopeScaling(
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=256,
            ),
            qk_norm=True,
            tie_word_embeddings=False,
            sliding_window=None,
            max_position_embeddings=2048,
            activation=Activation.XIELU,
        )
    }
)
