"""Golden fixtures for the post-norm and sandwich-norm decoders: EXAONE 4.0, OLMo 2, Gemma 3 (text).

A sibling of ``make_golden.py`` with the same conventions and files (``config.json``,
``generation_config.json``, float32 ``model.safetensors``, ``prompts.json``, ``reference.npz``
with the same keys), for three tiny random checkpoints in ``tests/golden/{exaone4,olmo2,gemma3}``:

* ``exaone4``: post-norm, per-head q/k norm, layers sliding / sliding / full (window 4); the
  full layer applies no RoPE (the config has a window).
* ``olmo2``: post-norm, q/k norm over the whole projection, 2 kv heads (shared by two ranks
  under attention TP 4).
* ``gemma3``: sandwich norms (``1 + w``), embeddings scaled by sqrt(hidden), GeGLU (tanh),
  layers sliding / full / sliding (window 4), local RoPE base 1e3 on sliding layers, global
  base 1e4 with linear scaling (factor 4), ``query_pre_attn_scalar`` 24 != head_dim 16.

Every parameter is random as in ``make_golden.py`` (``randomize_``). After writing, the script
re-loads each checkpoint, checks the logits and greedy tokens against ``reference.npz`` and the
logits against an independent float64 NumPy forward pass (``numpy_forward``), and checks that
the sliding window, the RoPE choices and the norm placement each change the logits.

Run (from the repository root; needs the Python 3.11 CPU-torch venv, see tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_golden_norms.py [exaone4 olmo2 gemma3]
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import (
    Exaone4Config,
    Exaone4ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Olmo2Config,
    Olmo2ForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as base  # noqa: E402

GOLDEN = base.GOLDEN
VOCAB = base.VOCAB
WINDOW = 4

SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

MODELS: dict[str, dict] = {
    "exaone4": {
        "config_cls": Exaone4Config,
        "model_cls": Exaone4ForCausalLM,
        "seed": 1011,
        "prompt_seed": 2011,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "config": SMALL
        | {
            "num_key_value_heads": 4,
            "head_dim": 8,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_window": WINDOW,
            "sliding_window_pattern": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
    },
    "olmo2": {
        "config_cls": Olmo2Config,
        "model_cls": Olmo2ForCausalLM,
        "seed": 1012,
        "prompt_seed": 2012,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "config": SMALL
        | {
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    "gemma3": {
        "config_cls": Gemma3TextConfig,
        "model_cls": Gemma3ForCausalLM,
        "seed": 1013,
        "prompt_seed": 2013,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "config": SMALL
        | {
            "num_key_value_heads": 4,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 24,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        },
    },
}


# --------------------------------------------------------------------------------------------
# Independent NumPy forward pass (float64)
# --------------------------------------------------------------------------------------------


def layer_rope(cfg: dict, kind: str, head_dim: int) -> np.ndarray | None:
    """The inverse frequencies of a layer of `kind`, or None where it applies no RoPE."""
    model_type = cfg["model_type"]
    if model_type == "gemma3_text":
        rp = cfg["rope_parameters"][kind]
    else:
        rp = cfg["rope_parameters"]
        # EXAONE 4.0: "global NoPE" where the config has a window.
        if model_type == "exaone4" and cfg.get("sliding_window") and kind == "full_attention":
            return None
    inv = 1.0 / rp["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if rp.get("rope_type", "default") == "linear":
        inv = inv / rp["factor"]
    else:
        assert rp.get("rope_type", "default") == "default", rp
    return inv


def numpy_forward(ckpt: Path, ids: list[int], variant: str = "") -> np.ndarray:
    """Float64 logits [T, vocab] of one prompt. `variant` breaks one detail on purpose, to show
    the fixture depends on it: "no-window", "rope-everywhere", "no-rope-scaling", "plain-norms"
    (Gemma: `w`, not `1 + w`), "pre-norm" (post-norm models: norm the stage input instead of its
    output), "per-head-qk-norm" (OLMo 2: each head's mean square instead of the projection's)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in base.load_np_weights(ckpt).items()}
    model_type = cfg["model_type"]
    gemma = model_type == "gemma3_text"
    post_norm = model_type in ("exaone4", "olmo2")
    hs, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or hs // nh
    eps = cfg["rms_norm_eps"]
    kinds = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]

    def rms(x, g):
        normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        return normed * ((1 + g) if gemma and variant != "plain-norms" else g)

    def rope(x, inv):  # x [T, H, D]; rotate_half convention
        ang = np.arange(x.shape[0], dtype=np.float64)[:, None] * inv[None, :]
        ang = np.concatenate([ang, ang], axis=-1)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        rot = np.concatenate([-x2, x1], axis=-1)
        return x * np.cos(ang)[:, None, :] + rot * np.sin(ang)[:, None, :]

    def act(g):
        if gemma:
            return 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
        return g / (1 + np.exp(-g))

    T = len(ids)
    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    if gemma:
        x = x * math.sqrt(hs)
    scale = (cfg["query_pre_attn_scalar"] if gemma else hd) ** -0.5
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."

        def n(name: str, prefix: str = p) -> np.ndarray:
            return w[prefix + name + ".weight"]

        reads_norm = not post_norm or variant == "pre-norm"
        if gemma:
            h = rms(x, n("input_layernorm"))
        elif variant == "pre-norm":
            h = rms(x, n("post_attention_layernorm"))
        else:
            h = x
        q, k, v = (h @ n(f"self_attn.{name}_proj").T for name in ("q", "k", "v"))
        if model_type == "olmo2" and variant == "per-head-qk-norm":
            q = rms(q.reshape(T, nh, hd), n("self_attn.q_norm").reshape(nh, hd)).reshape(T, -1)
            k = rms(k.reshape(T, nkv, hd), n("self_attn.k_norm").reshape(nkv, hd)).reshape(T, -1)
        elif model_type == "olmo2":  # over the whole projection, before the split into heads
            q, k = rms(q, n("self_attn.q_norm")), rms(k, n("self_attn.k_norm"))
        q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        if model_type != "olmo2":  # per head
            q, k = rms(q, n("self_attn.q_norm")), rms(k, n("self_attn.k_norm"))
        inv = layer_rope(cfg, kinds[i], hd)
        if variant == "no-rope-scaling" and kinds[i] == "full_attention":
            inv = inv * cfg["rope_parameters"][kinds[i]]["factor"]
        if variant == "rope-everywhere" and inv is None:
            inv = layer_rope(cfg | {"sliding_window": None}, kinds[i], hd)
        if inv is not None:
            q, k = rope(q, inv), rope(k, inv)
        visible = np.tril(np.ones((T, T), dtype=bool))
        if kinds[i] == "sliding_attention" and variant != "no-window":
            visible &= np.arange(T)[:, None] - np.arange(T)[None, :] < cfg["sliding_window"]
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) * scale
        s = np.where(visible[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, nh * hd) @ n("self_attn.o_proj").T
        x = x + (o if reads_norm and not gemma else rms(o, n("post_attention_layernorm")))
        if gemma:
            h = rms(x, n("pre_feedforward_layernorm"))
        elif variant == "pre-norm":
            h = rms(x, n("post_feedforward_layernorm"))
        else:
            h = x
        m = (act(h @ n("mlp.gate_proj").T) * (h @ n("mlp.up_proj").T)) @ n("mlp.down_proj").T
        x = x + (m if reads_norm and not gemma else rms(m, n("post_feedforward_layernorm")))
    x = rms(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def make_one(name: str, spec: dict) -> dict:
    summary, ref, _ = base.write_reference(name, spec)
    assert type(ref) is spec["model_cls"], type(ref)
    return summary


VARIANTS = {
    "exaone4": ("no-window", "rope-everywhere", "pre-norm"),
    "olmo2": ("pre-norm", "per-head-qk-norm"),
    "gemma3": ("no-window", "no-rope-scaling", "plain-norms"),
}


@torch.no_grad()
def verify(name: str) -> dict:
    """Re-load from disk and compare everything against reference.npz and the NumPy forward."""
    out, ref, prompts, model = base.reloaded(name)
    max_np_err = 0.0
    for b, p in enumerate(prompts):
        n = int(ref["lengths"][b])
        assert n == len(p) and ref["input_ids"][b, :n].tolist() == p
        got = base.logits_alone(model, p)
        assert np.abs(got - ref["logits"][b, :n]).max() <= 1e-6, name
        max_np_err = max(max_np_err, float(np.abs(numpy_forward(out, p) - got).max()))
        gen, _ = base.greedy_no_cache(model, p)
        assert gen == ref["generated"][b].tolist(), (name, b)
    assert max_np_err < 1e-3, (name, max_np_err)
    longest = max(prompts, key=len)
    exact = numpy_forward(out, longest)
    effects = {}
    for variant in VARIANTS[name]:
        effects[variant] = float(np.abs(numpy_forward(out, longest, variant) - exact).max())
        assert effects[variant] > 1e-2, (name, variant, effects[variant])  # the detail matters
    files = sorted(f for f in out.iterdir() if f.is_file())
    return {
        "numpy_max_err": max_np_err,
        "effects": effects,
        "files": {f.name: f.stat().st_size for f in files},
        "n_params": sum(p.numel() for p in model.parameters()),
    }


def main() -> int:
    for name in base.begin(MODELS):
        made = make_one(name, MODELS[name])
        checked = verify(name)
        size = sum(checked["files"].values())
        base.summarize(name, made, checked["n_params"], size, checked["numpy_max_err"])
        print(f"   max|dlogit| with one detail broken: {checked['effects']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
