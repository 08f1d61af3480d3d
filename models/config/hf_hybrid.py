"""Hugging Face `NemotronHConfig` files read into `DecoderConfig` (with its `hybrid` field), and
written back from one.

transformers 5 writes the layers as `layers_block_type` (a list of `linear_attention`,
`full_attention`, `mlp`, `moe`) and no `num_hidden_layers`; older files give a
`hybrid_override_pattern` string (M, *, -, E). Both are read; what the model here does not
compute (projection biases, a latent MoE projection, a sliding window, an activation other than
relu^2) is rejected with the key and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .hybrid import HybridConfig, HybridLayer, HybridMoeConfig, Mamba2Spec, parse_pattern
from .types import Architecture, DecoderConfig

NO_ROPE_THETA = 10_000.0
"""The `rope_theta` a hybrid config holds: its attention applies no positional encoding
(`nope_full_layers`), so the value is never read."""
SHARED_EXPERT_DEFAULT = 7688
"""`NemotronHConfig`'s shared-expert width where config.json has no key for it."""


def read_nemotron_h(config: Mapping[str, Any]) -> DecoderConfig:
    """Reads a `NemotronHForCausalLM` `config.json` (as a dict).

    Raises:
      ValueError: A layer list and pattern that disagree, unknown layer types, a missing key.
      NotImplementedError: Biases (`attention_bias`, `mlp_bias`, `use_bias`), a latent MoE
        projection (`moe_latent_size`), a sliding window, multi-token-prediction layers in the
        checkpoint, or an MLP activation other than relu^2.
    """
    layers = _read_layers(config)
    for key in ("attention_bias", "mlp_bias", "use_bias"):
        if config.get(key, False):
            raise NotImplementedError(
                f"NemotronHForCausalLM with {key}=true is not supported: the projections here "
                "have no bias"
            )
    unsupported = {
        "moe_latent_size": config.get("moe_latent_size"),
        "sliding_window": config.get("sliding_window"),
    }
    unsupported = {key: value for key, value in unsupported.items() if value is not None}
    if config.get("num_nextn_predict_layers", 0):
        unsupported["num_nextn_predict_layers"] = config["num_nextn_predict_layers"]
    if unsupported:
        raise NotImplementedError(
            f"NemotronHForCausalLM with {unsupported} is not supported; use a checkpoint "
            "without these keys (null, or 0 prediction layers)"
        )
    activation = config.get("mlp_hidden_act", "relu2")
    if activation != "relu2":
        raise NotImplementedError(
            f"the Nemotron-H MLP and experts compute relu^2; got mlp_hidden_act={activation!r}"
        )
    hidden = _required(config, "hidden_size")
    heads = _required(config, "num_attention_heads")
    mamba = Mamba2Spec.from_hf_config(config) if HybridLayer.MAMBA2 in layers else None
    moe = _read_moe(config) if HybridLayer.MOE in layers else None
    return DecoderConfig(
        architecture=Architecture.NEMOTRON_H,
        vocab_size=_required(config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_required(config, "intermediate_size"),
        num_layers=len(layers),
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        rms_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        rope_theta=NO_ROPE_THETA,
        rope_scaling=None,
        qk_norm=False,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=None,
        max_position_embeddings=_required(config, "max_position_embeddings"),
        nope_full_layers=True,
        hybrid=HybridConfig(layers, mamba, moe),
    )


def _required(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ValueError(f"config.json has no {key!r}; it is required to build the decoder")
    return config[key]


def _read_layers(config: Mapping[str, Any]) -> tuple[HybridLayer, ...]:
    """The layers from `layers_block_type`, else `hybrid_override_pattern`; both must agree."""
    names = config.get("layers_block_type")
    pattern = config.get("hybrid_override_pattern")
    if names is None and pattern is None:
        raise ValueError(
            "a NemotronHForCausalLM config.json names its layers in layers_block_type (or the "
            "older hybrid_override_pattern); it has neither"
        )
    from_pattern = None if pattern is None else parse_pattern(pattern)
    if names is None:
        return from_pattern
    known = {layer.value for layer in HybridLayer}
    if not isinstance(names, list) or not names or not set(names) <= known:
        raise ValueError(
            f"layers_block_type must be a non-empty list over {sorted(known)}; got {names!r}"
        )
    layers = tuple(HybridLayer(name) for name in names)
    if from_pattern is not None and from_pattern != layers:
        raise ValueError(
            f"layers_block_type {names} and hybrid_override_pattern {pattern!r} disagree; give one"
        )
    count = config.get("num_hidden_layers")
    if count is not None and count != len(layers):
        raise ValueError(
            f"num_hidden_layers ({count}) differs from the {len(layers)} layers of "
            "layers_block_type; drop num_hidden_layers (transformers 5 derives it)"
        )
    return layers


def _read_moe(config: Mapping[str, Any]) -> HybridMoeConfig:
    # As transformers: an absent width is the class default, a null one the MLP's width.
    shared = config.get("moe_shared_expert_intermediate_size", SHARED_EXPERT_DEFAULT)
    return HybridMoeConfig(
        num_experts=_required(config, "n_routed_experts"),
        top_k=_required(config, "num_experts_per_tok"),
        expert_intermediate_size=_required(config, "moe_intermediate_size"),
        shared_expert_intermediate_size=shared or _required(config, "intermediate_size"),
        num_groups=config.get("n_group") or 1,
        topk_groups=config.get("topk_group") or 1,
        renormalize=bool(config.get("norm_topk_prob", True)),
        scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
    )


def write_nemotron_h(config: DecoderConfig) -> dict[str, Any]:
    """The `NemotronHForCausalLM` `config.json` (as a dict, in transformers 5's keys) of a
    hybrid `config`; `read_nemotron_h` reads it back to `config`."""
    hybrid = config.hybrid
    if hybrid is None:
        raise ValueError(f"write_nemotron_h takes a hybrid config; got {config.architecture}")
    out: dict[str, Any] = {
        "architectures": [config.architecture.value],
        "model_type": "nemotron_h",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "layers_block_type": [layer.value for layer in hybrid.layers],
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "layer_norm_epsilon": config.rms_norm_eps,
        "mlp_hidden_act": "relu2",
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "use_bias": False,
        "num_nextn_predict_layers": 0,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
    }
    mamba = hybrid.mamba
    if mamba is not None:
        out |= {
            "mamba_num_heads": mamba.num_heads,
            "mamba_head_dim": mamba.head_dim,
            "n_groups": mamba.n_groups,
            "ssm_state_size": mamba.state_size,
            "conv_kernel": mamba.conv_kernel,
            "chunk_size": mamba.chunk_size,
            "time_step_min": mamba.time_step_limit[0],
            "use_conv_bias": mamba.conv_bias,
            "mamba_hidden_act": "silu",
        }
    moe = hybrid.moe
    if moe is not None:
        out |= {
            "n_routed_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.expert_intermediate_size,
            "moe_shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
            "n_group": moe.num_groups,
            "topk_group": moe.topk_groups,
            "norm_topk_prob": moe.renormalize,
            "routed_scaling_factor": moe.scaling_factor,
            "moe_latent_size": None,
        }
    return out
