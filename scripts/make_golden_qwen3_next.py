"""Golden fixtures for Qwen3-Next (Gated DeltaNet and gated-attention layers, each with an MoE or
a dense MLP).

A sibling of ``make_golden.py`` with the same conventions and files (``config.json``,
``generation_config.json``, float32 ``model.safetensors``, ``prompts.json``, ``reference.npz``
with the same keys), for a tiny random ``Qwen3NextForCausalLM`` checkpoint:

* ``qwen3_next`` = layers ``L+E, L+D, A+E, A+D, L+E`` (L Gated DeltaNet, A gated full attention,
  E the MoE with its sigmoid-gated shared expert, D a dense MLP via ``mlp_only_layers``): each
  mixer before an MoE and a dense MLP, and each mixer's layer after each mixer's (LL, LA, AA,
  AL); 4 key heads with 2 value heads each (split at attention TP 4), partial RoPE over 4 of 16
  channels, 2 kv heads (shared by ranks at TP 4).

Every parameter is random (``randomize_qwen3_next_``), so that a mis-sharded or mis-named weight
shows: linear weights N(0, 1/fan_in), embeddings N(0, 1), the `1 + w` RMSNorm weights 0.2 N(0,
1), the Gated DeltaNet's gated norm 1 + 0.2 N(0, 1), conv kernels N(0, 1/K), A_log = log U(0.5,
4), dt_bias U(-2, 0). After writing, the script re-loads the checkpoint and checks the logits
and greedy tokens (by full recomputation) against ``reference.npz``.

Run (from the repository root; needs the Python 3.11 CPU-torch venv, see tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_golden_qwen3_next.py
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as base  # noqa: E402

GOLDEN = base.GOLDEN
LINEAR, FULL = "linear_attention", "full_attention"


@torch.no_grad()
def randomize_qwen3_next_(model: torch.nn.Module, seed: int, resid_gain: float = 1.0) -> None:
    """Overwrites every parameter (module docstring)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        uniform = torch.rand(p.shape, generator=gen, dtype=torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("linear_attn.norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("norm.weight"):  # Qwen3NextRMSNorm: scales by 1 + w
            p.copy_(0.2 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        elif leaf == "A_log":
            p.copy_(torch.log(0.5 + 3.5 * uniform))
        elif leaf == "dt_bias":
            p.copy_(-2.0 + 2.0 * uniform)
        elif name.endswith("conv1d.weight"):  # [channels, 1, K]
            p.copy_(noise / math.sqrt(p.shape[-1]))
        elif p.ndim == 2:  # nn.Linear weight [out, in], the router's too
            gain = resid_gain if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            p.copy_(noise * (gain / math.sqrt(p.shape[1])))
        elif p.ndim == 3 and ".experts." in name:  # [experts, out, in]
            p.copy_(noise / math.sqrt(p.shape[2]))
        else:
            raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")


MODELS: dict[str, dict] = {
    "qwen3_next": {
        "config_cls": Qwen3NextConfig,
        "model_cls": Qwen3NextForCausalLM,
        "seed": 1101,
        "prompt_seed": 2101,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "randomize": randomize_qwen3_next_,
        "config": {
            "vocab_size": base.VOCAB,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 5,
            "layer_types": [LINEAR, LINEAR, FULL, FULL, LINEAR],
            "mlp_only_layers": [1, 3],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10_000.0,
                "partial_rotary_factor": 0.25,
            },
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 128,
            "tie_word_embeddings": False,
        },
    },
}


QWEN3_5_COMMON = {
    key: MODELS["qwen3_next"]["config"][key]
    for key in (
        "vocab_size",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_parameters",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
    )
}
MODELS["qwen3_5"] = MODELS["qwen3_next"] | {
    "config_cls": Qwen3_5TextConfig,
    "model_cls": Qwen3_5ForCausalLM,
    "seed": 1102,
    "prompt_seed": 2102,
    "config": QWEN3_5_COMMON
    | {
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "layer_types": [LINEAR, FULL, FULL, LINEAR],
    },
}
MODELS["qwen3_5_moe"] = MODELS["qwen3_next"] | {
    "config_cls": Qwen3_5MoeTextConfig,
    "model_cls": Qwen3_5MoeForCausalLM,
    "seed": 1103,
    "prompt_seed": 2103,
    "config": QWEN3_5_COMMON
    | {
        "num_hidden_layers": 4,
        "layer_types": [LINEAR, FULL, FULL, LINEAR],
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
}


@torch.no_grad()
def verify(name: str) -> dict:
    """Re-loads the checkpoint and compares logits and greedy tokens with reference.npz."""
    out, ref, prompts, model = base.reloaded(name)
    for b, p in enumerate(prompts):
        n = int(ref["lengths"][b])
        assert n == len(p) and ref["input_ids"][b, :n].tolist() == p
        got = base.logits_alone(model, p)
        assert np.abs(got - ref["logits"][b, :n]).max() <= 1e-6, name
        gen, _ = base.greedy_no_cache(model, p)
        assert gen == ref["generated"][b].tolist(), (name, b)
    files = sorted(f for f in out.iterdir() if f.is_file())
    return {
        "files": {f.name: f.stat().st_size for f in files},
        "n_params": sum(p.numel() for p in model.parameters()),
    }


def main() -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}  transformers {transformers.__version__}")
    names = sys.argv[1:] or [*MODELS]
    unknown = sorted(set(names) - MODELS.keys())
    if unknown:
        raise SystemExit(f"unknown golden names {unknown}; choose among {[*MODELS]}")
    for name in names:
        summary, ref, _ = base.write_reference(name, MODELS[name])
        assert type(ref) is MODELS[name]["model_cls"], type(ref)
        checked = verify(name)
        size = sum(checked["files"].values())
        print(f"\n== {name}: {checked['n_params']} params, {size / 1e3:.1f} kB {checked['files']}")
        print(
            f"   max|logit| {summary['max_abs_logit']:.3f}   min top-2 gap {summary['min_gap']:.4f}"
            f"   prompt seed {summary['prompt_seed']}   bf16 greedy == fp32 greedy: "
            f"{summary['bf16_greedy_same']}"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
