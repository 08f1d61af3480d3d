"""What a family's class says about itself before any module is built: its Hugging Face form
(config reader and writer, tensor names, the tensors it never reads) and what it builds (the
options and meshes it refuses). `CausalLM` inherits it; each family file overrides what differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import boundary_jax as bj

from ..config import DecoderConfig, ResidualDesign
from ..config.tensors import HFTensor, decoder_tensor_names, dense_layer_tensors
from ..layers.attention.context_parallel import CpAttentionMode
from ..layers.lora import ATTENTION_TARGETS
from ..options import BuildOptions


class FamilyBase:
    """The class-level half of a decoder family: everything `models.config.registry` and the
    builders ask before a model exists.

    Attributes:
      architectures: The `config.json` `architectures` names the class builds.
      model_type: Its `config.json` `model_type`.
      config_defaults: transformers' config-class defaults of keys a sparse `config.json`
        leaves out (as the text configs of released image-text checkpoints do); the file's own
        keys win.
      image_text_defaults: Per image-text architecture, its text config class's defaults
        where they differ from `config_defaults`.
      text_tie_architectures: Its image-text architectures whose config ties the LM head where
        their `text_config` says so and their own `tie_word_embeddings` is false (transformers'
        reading of files saved before v5).
      config_aliases: transformers' `attribute_map` for its config class: pairs of names a
        `config.json` may give one key under (`read_hf_config` fills the other from the one
        present, before the defaults).
      image_text_architectures: The image-text (`...ForConditionalGeneration`) architectures
        whose language model it is: their checkpoints load as its model, on text
        (`models.config.multimodal`).
      has_experts: Its configs hold a sparse FFN (`DecoderConfig.moe`), and it takes the MoE
        options.
      experts_optional: A family with experts whose transformers model builds every layer's
        FFN dense where `num_experts` is 0: a config without `moe` is one it builds too.
      quantizable: It builds with FP8 projections (`BuildOptions.quantization`).
      context_parallel: It builds under attention CP (`attn_cp > 1`).
      cp_attention_modes: It takes `BuildOptions.cp_attention` other than the all-gather.
      hyper_connections: It builds with MHC hyper-connections.
      dense_ffn_dp: It takes `BuildOptions.dense_ffn_dp`.
      captures_hidden_states: Its layers capture the residual entering them
        (`models.decoder.captures`).
      lora: It builds LoRA adapter stacks (`BuildOptions.lora`) on its attention and MLP
        projections (a family with experts: on its attention only).
      mlp_biases: Its dense MLP adds the biases `DecoderConfig.mlp_bias` asks for.
      query_scaling: It builds `DecoderConfig.query_scaling` (Ministral 3).
      ties_head: transformers ties its LM head to the embeddings where `tie_word_embeddings`
        says so; a family whose transformers model never does refuses a tied config
        (`DecoderConfig`).
      embedding_padding: transformers' embedding takes `pad_token_id` as its `padding_idx`
        (`DecoderConfig.padding_id`, read by `read_hf_config`).
    """

    architectures: ClassVar[tuple[str, ...]] = ()
    model_type: ClassVar[str] = ""
    image_text_architectures: ClassVar[tuple[str, ...]] = ()
    config_defaults: ClassVar[Mapping[str, Any]] = {}
    image_text_defaults: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    text_tie_architectures: ClassVar[tuple[str, ...]] = ()
    config_aliases: ClassVar[Mapping[str, str]] = {}
    has_experts: ClassVar[bool] = False
    experts_optional: ClassVar[bool] = False
    quantizable: ClassVar[bool] = True
    context_parallel: ClassVar[bool] = True
    cp_attention_modes: ClassVar[bool] = True
    hyper_connections: ClassVar[bool] = True
    dense_ffn_dp: ClassVar[bool] = False
    captures_hidden_states: ClassVar[bool] = True
    lora: ClassVar[bool] = False
    mlp_biases: ClassVar[bool] = False
    query_scaling: ClassVar[bool] = False
    ties_head: ClassVar[bool] = True
    embedding_padding: ClassVar[bool] = True

    @classmethod
    def read_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        """The `DecoderConfig` of a `config.json` (as a dict) of this family."""
        raise NotImplementedError(f"{cls.__name__} reads no config.json")

    @classmethod
    def write_config(cls, config: DecoderConfig) -> dict[str, Any]:
        """The `config.json` (as a dict) of `config`, in transformers 5's keys."""
        raise NotImplementedError(f"{cls.__name__} writes no config.json")

    @classmethod
    def check_config(cls, config: DecoderConfig) -> None:
        """Raises unless `config` is one this family builds (run on every `DecoderConfig` of
        its architectures): a sparse FFN only when the family has experts, and always unless
        they are optional; MLP biases only where it builds them.

        Raises:
          ValueError: The config holds what the family does not build.
        """
        if (config.moe is not None) != cls.has_experts and not (
            config.moe is None and cls.experts_optional
        ):
            raise ValueError(
                f"{config.architecture} {'needs' if config.moe is None else 'takes no'} MoE "
                f"settings; got moe={config.moe!r}"
            )
        if config.query_scaling is not None and not cls.query_scaling:
            raise ValueError(
                f"{config.architecture} builds no position-dependent query scale; got "
                f"query_scaling={config.query_scaling}. Leave it None"
            )
        if config.mlp_bias and not cls.mlp_biases:
            raise ValueError(
                f"{config.architecture} builds its MLPs without biases; got mlp_bias=True. Set "
                "it False (its transformers model has no MLP biases either)"
            )

    @classmethod
    def tensor_names(cls, config: DecoderConfig, *, scan_layers: bool) -> dict[str, HFTensor]:
        """`{parameter path: HFTensor}` of a model of `config` (`config.tensors.
        decoder_tensor_names` of grouped-query attention and a gated MLP by default)."""
        return decoder_tensor_names(
            config, scan_layers=scan_layers, dense=dense_layer_tensors(config)
        )

    @classmethod
    def unread_tensors(
        cls, config: DecoderConfig, names: Iterable[str]
    ) -> tuple[tuple[str, ...], str | None]:
        """The checkpoint tensors among `names` the causal LM never reads, and a one-line notice
        (none by default)."""
        del config, names
        return (), None

    @classmethod
    def check_builds_lora(cls) -> None:
        """Raises `NotImplementedError` unless this family builds LoRA adapter stacks."""
        if not cls.lora:
            raise NotImplementedError(
                f"{cls.__name__} builds its layers without LoRA adapter stacks; LoRA is built "
                "for the grouped-query decoders whose family sets `FamilyBase.lora`"
            )

    @classmethod
    def check_lora(cls, options: BuildOptions) -> None:
        """Raises unless this family builds LoRA adapter stacks with `options`.

        Raises:
          NotImplementedError: MLP targets in a model with experts, a family whose projections
            take no adapters, or an option the adapters are not built with (FP8, scanned
            layers, two-batch overlap).
        """
        name = cls.__name__
        mlp = sorted(t.value for t in options.lora.targets if t not in ATTENTION_TARGETS)
        if cls.has_experts and mlp:
            raise NotImplementedError(
                f"LoRA adapters on MoE experts are not built; {name} has experts, and the "
                f"adapters target {mlp}. Adapt its attention projections (q, k, v, o) only"
            )
        cls.check_builds_lora()
        for option in ("quantization", "scan_layers", "two_batch_overlap"):
            if getattr(options, option):
                raise NotImplementedError(
                    f"LoRA adapters are not built with {option}; got "
                    f"{option}={getattr(options, option)!r}. Leave it unset to serve adapters"
                )

    @classmethod
    def check_build(
        cls, config: DecoderConfig, topology: bj.Topology, options: BuildOptions
    ) -> None:
        """Raises for an option or mesh this family does not build, naming it and the fix.

        Raises:
          NotImplementedError: A valid option the family does not compute (FP8, hyper-
            connections, context parallelism, a MoE dispatch, ...).
          ValueError: An option that means nothing for the family (MoE options without
            experts, `dense_ffn_dp` where it does not apply).
        """
        name = cls.__name__
        design = config.residual_design
        if topology.attn_cp > 1 and not cls.context_parallel:
            raise NotImplementedError(
                f"context parallelism is built for dense decoders; {name} has experts (or SSM "
                f"mixers) and is not supported under it yet; got attn_cp={topology.attn_cp}. "
                "Use a mesh with attn_cp=1"
            )
        if options.cp_attention is not CpAttentionMode.ALL_GATHER and not cls.cp_attention_modes:
            raise NotImplementedError(
                f"{name} takes no cp_attention option yet (only the plain dense decoders do); "
                f"got cp_attention={options.cp_attention}. Leave it at CpAttentionMode.ALL_GATHER"
            )
        if options.quantization is not None and not (
            cls.quantizable and design is ResidualDesign.PRE_NORM
        ):
            raise NotImplementedError(
                "FP8 quantization is built for the pre-norm families whose projections take "
                f"`linears` (dense and plain MoE decoders); {name} builds its layers otherwise. "
                "Build it without quantization"
            )
        if options.hyper_connections is not None and not (
            cls.hyper_connections and design is ResidualDesign.PRE_NORM
        ):
            raise NotImplementedError(
                f"{name} has its own residual design ({design.value}); MHC hyper-connections "
                "replace it and are built for the pre-norm families only. Leave "
                "hyper_connections unset"
            )
        if options.lora is not None:
            cls.check_lora(options)
        if options.dense_ffn_dp and not cls.dense_ffn_dp:
            raise ValueError(
                f"dense_ffn_dp (a fully data-parallel dense FFN) is a DeepSeek option; got a "
                f"{config.architecture} config. Leave it unset"
            )
        if not cls.has_experts or config.moe is None and cls.experts_optional:
            if options.moe_dispatch is not None or topology.moe_ep != 1:
                raise ValueError(
                    f"{config.architecture} has no experts; got moe_dispatch="
                    f"{options.moe_dispatch} and moe_ep={topology.moe_ep}. Leave the MoE "
                    "options unset"
                )
            return
