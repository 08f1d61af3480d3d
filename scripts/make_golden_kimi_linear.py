"""Golden fixtures for Kimi-Linear (Kimi Delta Attention and NoPE latent-attention layers, a dense
first layer and DeepSeek-style MoE layers).

A sibling of ``make_golden.py`` with the same conventions and files (``config.json``,
``generation_config.json``, float32 ``model.safetensors``, ``prompts.json``, ``reference.npz``
with the same keys), for a tiny random ``KimiLinearForCausalLM`` checkpoint:

* ``kimi_linear`` = layers ``K+D, K+E, M+E, M+E, K+E`` (K Kimi Delta Attention, M latent
  attention without positional encoding, D the dense first layer, E the MoE: sigmoid scores with
  a correction bias, a grouped top-k, scaled weights, a shared expert): each mixer's layer after
  each mixer's (KK, KM, MM, MK), Kimi Delta Attention before a dense MLP and an MoE, latent
  attention before an MoE; 4 heads of each kind (split at attention TP 4), q LoRA.

Every parameter is random: linear weights N(0, 1/fan_in), embeddings N(0, 1), RMSNorm weights
1 + 0.2 N(0, 1), conv kernels N(0, 1/K), A_log = log U(0.5, 4), dt_bias U(-2, 0), the router's
correction bias N(0, 0.3^2). After writing, the script re-loads the checkpoint and checks the
logits and greedy tokens (by full recomputation) against ``reference.npz``.

Run (from the repository root; needs the Python 3.11 CPU-torch venv, see tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_golden_kimi_linear.py
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch
import transformers
from transformers import KimiLinearConfig, KimiLinearForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as base  # noqa: E402
import make_golden_qwen3_next as qwen3_next  # noqa: E402

LINEAR, FULL = "linear_attention", "full_attention"


@torch.no_grad()
def randomize_kimi_linear_(model: torch.nn.Module, seed: int, resid_gain: float = 1.0) -> None:
    """Overwrites every parameter and the router's correction bias (module docstring)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors = dict(model.named_parameters()) | {
        name: b for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")
    }
    for name, p in sorted(tensors.items()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        uniform = torch.rand(p.shape, generator=gen, dtype=torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        elif leaf == "A_log":
            p.copy_(torch.log(0.5 + 3.5 * uniform))
        elif leaf == "dt_bias":
            p.copy_(-2.0 + 2.0 * uniform)
        elif leaf == "e_score_correction_bias":
            p.copy_(0.3 * noise)
        elif name.endswith("conv1d.weight"):
            p.copy_(noise / math.sqrt(p.shape[-1]))
        elif p.ndim == 2:
            p.copy_(noise / math.sqrt(p.shape[1]))
        elif p.ndim == 3 and ".experts." in name:
            p.copy_(noise / math.sqrt(p.shape[2]))
        else:
            raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")


MODELS: dict[str, dict] = {
    "kimi_linear": {
        "config_cls": KimiLinearConfig,
        "model_cls": KimiLinearForCausalLM,
        "seed": 1201,
        "prompt_seed": 2201,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "randomize": randomize_kimi_linear_,
        "config": {
            "vocab_size": base.VOCAB,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 5,
            "layer_types": [LINEAR, LINEAR, FULL, FULL, LINEAR],
            "first_k_dense_replace": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "linear_num_heads": 4,
            "linear_head_dim": 8,
            "linear_conv_kernel_dim": 4,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 128,
            "tie_word_embeddings": False,
        },
    },
}


def main() -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}  transformers {transformers.__version__}")
    for name, spec in MODELS.items():
        summary, ref, _ = base.write_reference(name, spec)
        assert type(ref) is KimiLinearForCausalLM, type(ref)
        checked = qwen3_next.verify(name)
        size = sum(checked["files"].values())
        print(f"\n== {name}: {checked['n_params']} params, {size / 1e3:.1f} kB {checked['files']}")
        print(
            f"   max|logit| {summary['max_abs_logit']:.3f}   min top-2 gap {summary['min_gap']:.4f}"
            f"   prompt seed {summary['prompt_seed']}"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
