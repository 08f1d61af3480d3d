"""Golden fixture for Ministral 3 (``Ministral3ForCausalLM``): Mistral's layers with YaRN RoPE and
Llama 4's position-dependent query scale.

A sibling of ``make_golden.py`` with its conventions and files (``config.json``,
``generation_config.json``, float32 ``model.safetensors``, ``prompts.json``, ``reference.npz``)
in ``tests/golden/ministral3``: the query scale's period (``original_max_position_embeddings``)
is 4 and its ``llama_4_scaling_beta`` 0.5, so the prompts' positions 4-11 and the greedy steps'
4-17 are scaled by 1.35 to 1.80; YaRN stretches the RoPE by 4 over that original context.

After writing, the script re-loads the checkpoint, checks its logits and greedy tokens against
``reference.npz``, and checks that the query scale is what changes them: the same weights as a
``MistralForCausalLM`` with the same RoPE give the same logits before position 4 and logits
more than 0.1 apart after it.

Run (from the repository root; needs the Python 3.11 CPU-torch venv, see tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_golden_ministral3.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import Ministral3Config, Ministral3ForCausalLM, MistralForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as base  # noqa: E402

PERIOD = 4
MODELS: dict[str, dict] = {
    "ministral3": {
        "config_cls": Ministral3Config,
        "model_cls": Ministral3ForCausalLM,
        "seed": 1041,
        "prompt_seed": 2041,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "config": {
            "vocab_size": base.VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 128,
            "tie_word_embeddings": False,
            "sliding_window": None,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": PERIOD,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5,
            },
        },
    }
}


@torch.no_grad()
def verify(name: str) -> dict:
    """Re-load from disk, compare against reference.npz, and against the unscaled Mistral."""
    out, ref, prompts, model = base.reloaded(name)
    assert type(model) is Ministral3ForCausalLM, type(model)
    plain = MistralForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    before, after = 0.0, 0.0
    for b, p in enumerate(prompts):
        n = int(ref["lengths"][b])
        got = base.logits_alone(model, p)
        assert np.abs(got - ref["logits"][b, :n]).max() <= 1e-6, (name, b)
        assert base.greedy_generate(model, p)[0] == ref["generated"][b].tolist(), (name, b)
        longer = p + ref["generated"][b].tolist()
        gap = np.abs(base.logits_alone(model, longer) - base.logits_alone(plain, longer)).max(-1)
        before = max(before, float(gap[:PERIOD].max()))
        after = max(after, float(gap[PERIOD:].max()))
    assert before <= 1e-5 and after > 1e-1, (before, after)
    files = sorted(f for f in out.iterdir() if f.is_file())
    return {
        "before": before,
        "after": after,
        "files": {f.name: f.stat().st_size for f in files},
        "n_params": sum(p.numel() for p in model.parameters()),
    }


def main() -> int:
    for name in base.begin(MODELS):
        made, ref, _ = base.write_reference(name, MODELS[name])
        assert type(ref) is Ministral3ForCausalLM, type(ref)
        checked = verify(name)
        print(f"\n== {name}: {checked['n_params']} params")
        print(f"   max|logit| {made['max_abs_logit']:.3f}   min top-2 gap {made['min_gap']:.4f}")
        print(f"   bf16 max|dlogit| {made['bf16_max_err']:.4f}")
        print(
            f"   max|dlogit| against Mistral without the query scale: positions < {PERIOD} "
            f"{checked['before']:.1e}, after {checked['after']:.3f}"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
