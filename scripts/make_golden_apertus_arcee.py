"""Golden fixtures for the ungated-MLP decoders: Apertus (xIELU) and Arcee AFM (relu^2, YaRN).

A sibling of ``make_golden.py`` with the same conventions and files (``config.json``,
``generation_config.json``, float32 ``model.safetensors``, ``prompts.json``, ``reference.npz``
with the same keys), for two tiny random checkpoints in ``tests/golden/{apertus,arcee}``:

* ``apertus``: ``ApertusForCausalLM``; per-head q/k norms, llama3 RoPE scaling with the three
  bands of ``make_golden.py``'s Llama (head_dim 8, original context 100), norms named
  ``attention_layernorm`` / ``feedforward_layernorm``, and the MLP ``down(xielu(up(x)))`` with
  each layer's own xIELU coefficients off transformers' starting values: the raw ``alpha_p``
  and ``alpha_n`` N(0, 0.7^2) each, the ``beta`` buffer 0.5 + 0.1 N(0, 1) (``eps`` stays
  -1e-6). About half of the up projection's outputs are negative, so the negative branch
  ``(expm1(min(x, eps)) - x) * alpha_n`` carries as much as the positive one.
* ``arcee``: ``ArceeForCausalLM``; Llama attention with head_dim 16 (8 heads x 16 != hidden
  64), the MLP ``down(relu(up(x))^2)``, YaRN RoPE with factor 4 over an original context of 32
  (``max_position_embeddings`` 128): frequency 0 kept, frequency 1 on the ramp, the other six
  divided by 4, and cos/sin multiplied by ``0.1 ln 4 + 1`` (every score by its square, 1.30).

Every other parameter is random as in ``make_golden.py`` (``randomize_``). After writing, the
script re-loads each checkpoint, checks the logits and greedy tokens against ``reference.npz``
and the logits against an independent float64 NumPy forward pass (``numpy_forward``), and
checks that each detail the fixtures exist for changes the logits (the alphas swapped, the
negative branch dropped, beta at its default; YaRN's cos/sin factor left out, its frequencies
unscaled).

Run (from the repository root; needs the Python 3.11 CPU-torch venv, see tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_golden_apertus_arcee.py [apertus arcee]
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
    ApertusConfig,
    ApertusForCausalLM,
    ArceeConfig,
    ArceeForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as base  # noqa: E402

GOLDEN = base.GOLDEN
VOCAB = base.VOCAB
YARN_ORIGINAL = 32

SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "attention_bias": False,
}


@torch.no_grad()
def randomize_apertus_(model: torch.nn.Module, seed: int, resid_gain: float = 1.0) -> None:
    """`make_golden.randomize_` for everything but the xIELU coefficients (each layer's
    `mlp.act_fn` is out of the model while it runs); then, from a generator of their own, the
    raw alphas N(0, 0.7^2) each and the beta buffer 0.5 + 0.1 N(0, 1)."""
    mlps = [layer.mlp for layer in model.model.layers]
    activations = [mlp.act_fn for mlp in mlps]
    for mlp in mlps:
        mlp.act_fn = torch.nn.Identity()
    base.randomize_(model, seed, resid_gain)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    for mlp, act in zip(mlps, activations, strict=True):
        mlp.act_fn = act
        for value in (act.alpha_p, act.alpha_n):
            value.copy_(0.7 * torch.randn(value.shape, generator=gen, dtype=torch.float32))
        act.beta.copy_(0.5 + 0.1 * torch.randn(act.beta.shape, generator=gen, dtype=torch.float32))


MODELS: dict[str, dict] = {
    "apertus": {
        "config_cls": ApertusConfig,
        "model_cls": ApertusForCausalLM,
        "seed": 1031,
        "prompt_seed": 2031,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "randomize": randomize_apertus_,
        "config": SMALL
        | {
            "hidden_act": "xielu",
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": base.LLAMA3_ORIGINAL_MAX_POS,
            },
        },
    },
    "arcee": {
        "config_cls": ArceeConfig,
        "model_cls": ArceeForCausalLM,
        "seed": 1032,
        "prompt_seed": 2032,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "config": SMALL
        | {
            "head_dim": 16,
            "hidden_act": "relu2",
            "mlp_bias": False,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": YARN_ORIGINAL,
            },
        },
    },
}


# --------------------------------------------------------------------------------------------
# Independent NumPy forward pass (float64)
# --------------------------------------------------------------------------------------------


def yarn(rp: dict, head_dim: int, variant: str) -> tuple[np.ndarray, float]:
    """YaRN's inverse frequencies and cos/sin factor (transformers' `_compute_yarn_parameters`
    with its defaults: beta_fast 32, beta_slow 1, truncated bounds, attention factor
    `0.1 ln(factor) + 1`)."""
    base_, factor, original = rp["rope_theta"], rp["factor"], rp["original_max_position_embeddings"]
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    extrapolated = 1.0 / base_**exponents
    interpolated = extrapolated / factor

    def bound(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base_))

    low, high = max(math.floor(bound(32)), 0), min(math.ceil(bound(1)), head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2) - low) / max(high - low, 1e-3), 0, 1)
    keep = 1 - ramp  # 1: extrapolated (high frequencies), 0: interpolated
    inv = interpolated * (1 - keep) + extrapolated * keep
    attention = 0.1 * math.log(factor) + 1
    if variant == "no-yarn-frequencies":
        inv = extrapolated
    if variant == "no-yarn-factor":
        attention = 1.0
    return inv, attention


def xielu(x: np.ndarray, w: dict, prefix: str, variant: str) -> np.ndarray:
    """transformers' `XIELUActivation._xielu_python`; `variant` breaks one detail."""
    softplus = lambda v: np.log1p(np.exp(v))  # noqa: E731
    raw_p, raw_n = w[prefix + "alpha_p"][0], w[prefix + "alpha_n"][0]
    if variant == "alphas-swapped":
        raw_p, raw_n = raw_n, raw_p
    beta, eps = float(w[prefix + "beta"]), float(w[prefix + "eps"])
    if variant == "beta-default":
        beta = 0.5
    alpha_p, alpha_n = softplus(raw_p), beta + softplus(raw_n)
    positive = alpha_p * x * x + beta * x
    if variant == "no-negative-branch":
        return positive
    return np.where(x > 0, positive, (np.expm1(np.minimum(x, eps)) - x) * alpha_n + beta * x)


def numpy_forward(
    ckpt: Path, ids: list[int], variant: str = "", ups: list | None = None
) -> np.ndarray:
    """Float64 logits [T, vocab] of one prompt; `variant` breaks one detail on purpose (see
    `VARIANTS`), to show the fixture depends on it; each layer's up projection (the MLP
    activation's input) is appended to `ups` when given."""
    cfg = json.loads((ckpt / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in base.load_np_weights(ckpt).items()}
    apertus = cfg["model_type"] == "apertus"
    hs, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or hs // nh
    eps = cfg["rms_norm_eps"]

    def rms(x, g):
        return g * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    rp = cfg["rope_parameters"]
    if rp["rope_type"] == "yarn":
        inv, attention = yarn(rp, hd, variant)
    else:
        inv, attention = base.rope_inv_freq(cfg, hd), 1.0
    T = len(ids)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(ang) * attention, np.sin(ang) * attention

    def rope(x):  # x [T, H, D]; rotate_half convention
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos[:, None, :] + np.concatenate([-x2, x1], axis=-1) * sin[:, None, :]

    def proj(h, name):  # nn.Linear, with its bias where the checkpoint has one
        y = h @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    norms = ("attention_layernorm", "feedforward_layernorm") if apertus else None
    norms = norms or ("input_layernorm", "post_attention_layernorm")
    causal = np.tril(np.ones((T, T), dtype=bool))
    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + norms[0] + ".weight"])
        q = proj(h, p + "self_attn.q_proj").reshape(T, nh, hd)
        k = proj(h, p + "self_attn.k_proj").reshape(T, nkv, hd)
        v = proj(h, p + "self_attn.v_proj").reshape(T, nkv, hd)
        if apertus:  # per-head RMSNorm over head_dim, before RoPE
            q = rms(q, w[p + "self_attn.q_norm.weight"])
            k = rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        s = np.where(causal[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, nh * hd)
        x = x + proj(o, p + "self_attn.o_proj")
        h = rms(x, w[p + norms[1] + ".weight"])
        up = proj(h, p + "mlp.up_proj")
        if ups is not None:
            ups.append(up)
        relu2 = np.square(np.maximum(up, 0))
        act = xielu(up, w, p + "mlp.act_fn.", variant) if apertus else relu2
        x = x + proj(act, p + "mlp.down_proj")
    x = rms(x, w["model.norm.weight"])
    return x @ w["lm_head.weight"].T


def negative_share(ckpt: Path, ids: list[int]) -> float:
    """The share of the MLP activation's inputs (every layer's up projection) below 0, where
    xIELU takes its negative branch."""
    ups: list = []
    numpy_forward(ckpt, ids, ups=ups)
    return float(np.mean(np.concatenate(ups) < 0))


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

VARIANTS = {
    "apertus": ("alphas-swapped", "no-negative-branch", "beta-default"),
    "arcee": ("no-yarn-factor", "no-yarn-frequencies"),
}


@torch.no_grad()
def verify(name: str) -> dict:
    """Re-load from disk and compare everything against reference.npz and the NumPy forward."""
    out = GOLDEN / name
    model, prompts, max_np_err = base.check_reloaded(name, MODELS[name]["model_cls"], numpy_forward)
    longest = max(prompts, key=len)
    exact = numpy_forward(out, longest)
    effects = {}
    for variant in VARIANTS[name]:
        effects[variant] = float(np.abs(numpy_forward(out, longest, variant) - exact).max())
        assert effects[variant] > 1e-1, (name, variant, effects[variant])  # the detail matters
    files = sorted(f for f in out.iterdir() if f.is_file())
    return {
        "numpy_max_err": max_np_err,
        "effects": effects,
        "negative_share": negative_share(out, longest) if name == "apertus" else None,
        "files": {f.name: f.stat().st_size for f in files},
        "n_params": sum(p.numel() for p in model.parameters()),
    }


def main() -> int:
    for name in base.begin(MODELS):
        made, ref, _ = base.write_reference(name, MODELS[name])
        assert type(ref) is MODELS[name]["model_cls"], type(ref)
        checked = verify(name)
        size = sum(checked["files"].values())
        base.summarize(name, made, checked["n_params"], size, checked["numpy_max_err"])
        print(f"   max|dlogit| with one detail broken: {checked['effects']}")
        if checked["negative_share"] is not None:
            print(f"   xIELU inputs below 0: {checked['negative_share']:.2f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
