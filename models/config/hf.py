"""What every family's `config.json` reader and writer share: required keys, the keys of a plain
decoder (sizes, heads, norms, RoPE), per-layer attention kinds, the plain softmax-routed MoE,
and the refusals of keys no layer computes.

A family file composes these (`models.families`); what only one family reads stays in its file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .rope_scaling import RopeScaling, read_rope, rope_parameters
from .types import Activation, AttentionKind, DecoderConfig, MoeConfig


def required(config: Mapping[str, Any], key: str) -> Any:
    """`config[key]`.

    Raises:
      ValueError: The key is absent or null.
    """
    if config.get(key) is None:
        raise ValueError(f"config.json has no {key!r}; it is required to build the decoder")
    return config[key]


def refuse_true(config: Mapping[str, Any], architecture: str, keys: tuple[str, ...]) -> None:
    """Raises for each of `keys` set true: a bias or option the family's layers do not compute.

    Raises:
      ValueError: One of `keys` is true.
    """
    for key in keys:
        if config.get(key, False):
            raise ValueError(
                f"{architecture} with {key}=true is not supported (its layers do not compute "
                "it); use a checkpoint without it"
            )


ACTIVATION_ALIASES = {
    "swish": Activation.SILU.value,
    "gelu_new": Activation.GELU_TANH.value,
    "gelu_fast": Activation.GELU_TANH.value,
    "gelu_python_tanh": Activation.GELU_TANH.value,
}
"""transformers' other names (`ACT2FN`) of the same functions: tanh GELU written out three ways."""


def read_activation(config: Mapping[str, Any], supported: Activation, *keys: str) -> Activation:
    """The MLP's activation the first present of `keys` names (`hidden_act` by default),
    which must be `supported`.

    Raises:
      ValueError: Another activation.
    """
    keys = keys or ("hidden_act",)
    name = next((config[key] for key in keys if config.get(key)), supported.value)
    if ACTIVATION_ALIASES.get(name, name) != supported.value:
        raise ValueError(
            f"the {'gated ' if supported.gated else ''}MLP here computes {supported.label} "
            f"only; got {keys[0]}={name!r}"
        )
    return supported


def attention_bias(config: Mapping[str, Any]) -> dict[str, bool]:
    """`qkv_bias` and `o_bias` as `attention_bias` sets them, for the families whose
    transformers attention biases its q, k, v and o projections alike by that key; the o bias
    is counted once in its sum over attention TP."""
    bias = bool(config.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def plain_decoder(
    config: Mapping[str, Any],
    architecture: str,
    *,
    rope: tuple[float, RopeScaling | None] | None = None,
    tie_word_embeddings: bool = False,
    **options: Any,
) -> DecoderConfig:
    """The `DecoderConfig` of a decoder of attention + FFN layers: the keys every such
    `config.json` holds (sizes, heads, head width, norms' epsilon, context, initializer,
    tied embeddings, RoPE by `read_rope` unless `rope` is given), with the family's own
    fields in `options` (its window, q/k norms, biases, MoE, residual design...).

    Raises:
      ValueError: A required key is missing, or a value the config refuses.
    """
    hidden = required(config, "hidden_size")
    heads = required(config, "num_attention_heads")
    theta, scaling = read_rope(config) if rope is None else rope
    fields = {
        "architecture": architecture,
        "vocab_size": required(config, "vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": required(config, "intermediate_size"),
        "num_layers": required(config, "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or hidden // heads,
        "rms_norm_eps": float(required(config, "rms_norm_eps")),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "qk_norm": False,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", tie_word_embeddings)),
        "sliding_window": None,
        "max_position_embeddings": required(config, "max_position_embeddings"),
        "initializer_range": float(config.get("initializer_range", 0.02)),
    }
    return DecoderConfig(**(fields | options))


def plain_decoder_json(config: DecoderConfig, model_type: str) -> dict[str, Any]:
    """The `config.json` keys `plain_decoder` reads, in transformers 5's format (RoPE as
    `rope_parameters`, the activation as `hidden_act`, no window), for a family's writer to
    extend."""
    return {
        "architectures": [config.architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
        "rope_parameters": rope_parameters(config.rope_theta, config.rope_scaling),
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.o_bias,
        "hidden_act": config.activation.value,
        "sliding_window": None,
        "use_sliding_window": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
    }


def window_json(config: DecoderConfig, *, layer_types: bool = True) -> dict[str, Any]:
    """The window keys of `config`: `sliding_window`, `use_sliding_window` and (with
    `layer_types`) each layer's attention kind."""
    if config.sliding_window is None:
        return {"sliding_window": None, "use_sliding_window": False}
    keys: dict[str, Any] = {"sliding_window": config.sliding_window, "use_sliding_window": True}
    if layer_types:
        keys["layer_types"] = [config.layer_kind(i).value for i in range(config.num_layers)]
    return keys


def layer_windows(
    config: Mapping[str, Any], layers: int, default: list[bool] | None
) -> tuple[int | None, tuple[AttentionKind, ...] | None]:
    """The sliding window and, where layers differ, each layer's attention kind: from
    `layer_types`, else from `default` (per layer, whether it slides; None: every layer).

    Raises:
      ValueError: `layer_types` does not name one known kind per layer.
    """
    window = config.get("sliding_window")
    if not window:
        return None, None
    names = config.get("layer_types")
    if not names:
        if default is None:
            return window, None
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


def opt_in_windows(
    config: Mapping[str, Any], layers: int, default: list[bool] | None
) -> tuple[int | None, tuple[AttentionKind, ...] | None]:
    """`layer_windows` of a config whose window applies only with `use_sliding_window`."""
    if not config.get("use_sliding_window", False):
        return None, None
    return layer_windows(config, layers, default)


def every_nth_full(pattern: Any, layers: int, family: str) -> list[bool]:
    """Which layers slide by an integer `sliding_window_pattern` (every pattern-th is full), as
    transformers derives `layer_types` when config.json has none.

    Raises:
      ValueError: The pattern is not a positive integer.
    """
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise ValueError(
            f"{family} config.json without layer_types needs an integer sliding_window_pattern; "
            f"got {pattern!r}. Give layer_types"
        )
    return [bool((i + 1) % pattern) for i in range(layers)]


_PLAIN_ROUTER = {
    "topk_method": ("greedy",),
    "n_group": (1,),
    "topk_group": (1,),
    "routed_scaling_factor": (1, 1.0),
}
"""Router keys of other MoE families, and the values that leave a plain softmax top-k."""


def plain_moe(
    config: Mapping[str, Any],
    architecture: str,
    *,
    expert_width: str = "moe_intermediate_size",
    **options: Any,
) -> MoeConfig:
    """The sparse FFN of a softmax top-k router's `config.json`: the experts (`num_experts` or
    `num_local_experts`), `num_experts_per_tok`, the expert width (key `expert_width`),
    `norm_topk_prob`, `mlp_only_layers` and `decoder_sparse_step`; `options` overrides fields
    (a family that always renormalizes, a shared expert).

    Raises:
      ValueError: No expert count, another router (`scoring_func`, grouped top-k, scaled
        weights), or a missing key.
    """
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts is None:
        raise ValueError(
            f"{architecture} config.json has neither 'num_experts' nor 'num_local_experts'; one "
            "is required to build the sparse FFN"
        )
    scoring = config.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise ValueError(
            f"unsupported router: {architecture} routes by a softmax over all experts, then "
            f"top-k; got scoring_func={scoring!r}. Use a softmax-routed checkpoint"
        )
    grouped = {
        key: config[key]
        for key, plain in _PLAIN_ROUTER.items()
        if config.get(key) is not None and config[key] not in plain
    }
    if grouped:
        raise ValueError(
            f"unsupported router: {architecture} takes a plain top-k of the softmax; got "
            f"{grouped}. Remove these keys or use a checkpoint routed that way"
        )
    fields = {
        "num_experts": experts,
        "top_k": required(config, "num_experts_per_tok"),
        "expert_intermediate_size": required(config, expert_width),
        "renormalize": bool(config.get("norm_topk_prob", False)),
        "mlp_only_layers": tuple(sorted(config.get("mlp_only_layers") or ())),
        "decoder_sparse_step": config.get("decoder_sparse_step") or 1,
    }
    return MoeConfig(**(fields | options))


def plain_moe_json(config: DecoderConfig) -> dict[str, Any]:
    """The `config.json` keys `plain_moe` reads; `num_experts: 0` for a config without experts
    (transformers' Qwen MoE families build every FFN dense then)."""
    moe = config.moe
    if moe is None:
        return {"num_experts": 0}
    out = {
        "num_experts_per_tok": moe.top_k,
        "num_local_experts": moe.num_experts,
        "num_experts": moe.num_experts,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "norm_topk_prob": moe.renormalize,
        "mlp_only_layers": list(moe.mlp_only_layers),
        "decoder_sparse_step": moe.decoder_sparse_step,
    }
    if moe.shared_expert_intermediate_size is not None:
        out["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
    return out


def integral(value: float) -> int | float:
    """`value` as an int where it is one (transformers types some float keys int)."""
    return int(value) if float(value).is_integer() else value
