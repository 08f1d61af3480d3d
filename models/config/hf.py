"""Hugging Face `config.json` files read into `DecoderConfig`, and written back from one.

Accepts both RoPE formats (the legacy top-level `rope_theta` + `rope_scaling`, and the
transformers-5 `rope_parameters`), both spellings of the expert count, and per-layer attention
from `layer_types` (or the family's default pattern); rejects, with the key and the fix, what the
models here do not compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .deepseek import read_deepseek_config, write_deepseek_config
from .hf_hybrid import read_nemotron_h, write_nemotron_h
from .longcat import read_longcat_config, write_longcat_config
from .rope_scaling import LinearRopeScaling, Llama3RopeScaling, RopeScaling
from .types import (
    MLA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    Activation,
    Architecture,
    AttentionKind,
    DecoderConfig,
    MoeConfig,
)


def read_hf_config(config: Mapping[str, Any]) -> DecoderConfig:
    """Reads a Hugging Face `config.json` (as a dict) of a supported decoder.

    Accepts both RoPE formats: the legacy top-level `rope_theta` + `rope_scaling` (Gemma 3:
    also `rope_local_base_freq`) and the transformers-5 `rope_parameters` (Gemma 3: one
    entry per layer type); both spellings of the expert count (`num_experts`, as the Qwen
    hub checkpoints, and `num_local_experts`, as Mixtral and transformers 5's Qwen3-MoE
    write it); and per-layer attention from `layer_types` (or the family's default pattern).
    A `NemotronHForCausalLM` config is read by `hf_hybrid.read_nemotron_h`.
    DeepSeek-V2 / V3 configs are read by `config.deepseek.read_deepseek_config`, LongCat-Flash
    ones by `config.longcat.read_longcat_config`.

    Raises:
      ValueError: The architecture, RoPE type, activation, biases, layer pattern or a
        Gemma 3 option (softcapping, bidirectional attention) is not supported, or a
        required key is missing.
      NotImplementedError: A Nemotron-H option the hybrid model does not compute.
    """
    architectures = config.get("architectures") or []
    supported = [a.value for a in Architecture]
    if len(architectures) != 1 or architectures[0] not in supported:
        raise ValueError(
            f"config.json must name exactly one architecture among {supported}; got "
            f"architectures={architectures!r}"
        )
    architecture = Architecture(architectures[0])
    if architecture is Architecture.NEMOTRON_H:
        return read_nemotron_h(config)
    if architecture is Architecture.LONGCAT_FLASH:
        return read_longcat_config(config)
    if architecture in MLA_ARCHITECTURES:
        return read_deepseek_config(config)
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
    return DecoderConfig(
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
        initializer_range=float(config.get("initializer_range", 0.02)),
    )


_QK_NORM_ARCHITECTURES = (
    Architecture.QWEN3,
    Architecture.QWEN3_MOE,
    Architecture.EXAONE4,
    Architecture.OLMO2,
    Architecture.GEMMA3,
)


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
    if architecture not in MOE_ARCHITECTURES:
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


_MODEL_TYPES = {
    Architecture.QWEN3: "qwen3",
    Architecture.LLAMA: "llama",
    Architecture.MISTRAL: "mistral",
    Architecture.QWEN2: "qwen2",
    Architecture.QWEN3_MOE: "qwen3_moe",
    Architecture.MIXTRAL: "mixtral",
    Architecture.QWEN2_MOE: "qwen2_moe",
    Architecture.EXAONE4: "exaone4",
    Architecture.OLMO2: "olmo2",
    Architecture.GEMMA3: "gemma3_text",
}


def write_hf_config(config: DecoderConfig) -> dict[str, Any]:
    """The Hugging Face `config.json` (as a dict) of `config`, in transformers 5's format, for
    every architecture `read_hf_config` reads; `read_hf_config` reads it back to `config`.

    Raises:
      ValueError: `config` has no Hugging Face form (a combination its architecture's
        config.json cannot say, e.g. a sliding window on Llama).
    """
    if config.hybrid is not None:
        return write_nemotron_h(config)
    if config.architecture is Architecture.LONGCAT_FLASH:
        return write_longcat_config(config)
    if config.mla is not None:
        return write_deepseek_config(config)
    architecture = config.architecture
    out: dict[str, Any] = {
        "architectures": [architecture.value],
        "model_type": _MODEL_TYPES[architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
        "rope_parameters": _rope_parameters(config.rope_theta, config.rope_scaling),
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
        **_attention_keys(config),
    }
    if architecture is Architecture.GEMMA3:
        out |= {
            "hidden_activation": config.activation.value,
            "query_pre_attn_scalar": _integral(config.query_pre_attn_scalar),
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "rope_parameters": {
                AttentionKind.FULL.value: out["rope_parameters"],
                AttentionKind.SLIDING.value: _rope_parameters(config.rope_local_theta, None),
            },
        }
    else:
        out["hidden_act"] = config.activation.value
    if architecture is Architecture.QWEN2_MOE:  # Qwen2 always has q/k/v biases, and no key
        out["qkv_bias"] = config.qkv_bias
    out |= _moe_keys(config)
    if read_hf_config(out) != config:
        raise ValueError(
            f"{architecture.value}'s config.json cannot say this configuration (it would read "
            f"back as another): {config}"
        )
    return out


def _integral(value: float) -> int | float:
    """`value` as an int where it is one (transformers types `query_pre_attn_scalar` int)."""
    return int(value) if float(value).is_integer() else value


def _rope_parameters(theta: float | None, scaling: RopeScaling | None) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": theta, "rope_type": "default"}
    if isinstance(scaling, Llama3RopeScaling):
        rope |= dataclasses.asdict(scaling) | {"rope_type": "llama3"}
    elif isinstance(scaling, LinearRopeScaling):
        rope |= {"factor": scaling.factor, "rope_type": "linear"}
    return rope


def _attention_keys(config: DecoderConfig) -> dict[str, Any]:
    """The window keys: `sliding_window`, and `layer_types` where the family reads them."""
    window = config.sliding_window
    if window is None:
        return {"sliding_window": None, "use_sliding_window": False}
    keys: dict[str, Any] = {"sliding_window": window, "use_sliding_window": True}
    if config.architecture not in (Architecture.MISTRAL, Architecture.MIXTRAL):
        kinds = [config.layer_kind(layer).value for layer in range(config.num_layers)]
        keys["layer_types"] = kinds
    return keys


def _moe_keys(config: DecoderConfig) -> dict[str, Any]:
    moe = config.moe
    if moe is None:
        return {}
    out: dict[str, Any] = {"num_experts_per_tok": moe.top_k, "num_local_experts": moe.num_experts}
    if config.architecture is Architecture.MIXTRAL:
        return out
    out |= {
        "num_experts": moe.num_experts,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "norm_topk_prob": moe.renormalize,
        "mlp_only_layers": list(moe.mlp_only_layers),
        "decoder_sparse_step": moe.decoder_sparse_step,
    }
    if moe.shared_expert_intermediate_size is not None:
        out["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
    return out
