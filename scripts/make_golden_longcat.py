"""Golden fixture for LongCat-Flash (shortcut-connected MoE with zero-computation experts, MLA).

A sibling of ``make_golden.py`` with the same conventions and files (``config.json``,
``generation_config.json``, float32 ``model.safetensors``, ``prompts.json``, ``reference.npz``
with the same keys), for one tiny random ``LongcatFlashForCausalLM`` checkpoint in
``tests/golden/longcat_flash``: 2 layers, each (as transformers' ``LongcatFlashDecoderLayer``)

    x1 = x + attn[0](input_layernorm[0](x))
    h = post_attention_layernorm[0](x1)
    shortcut = moe(h)                                  # routed + zero-computation experts
    x2 = x1 + mlps[0](h)                               # the dense branch reads the MoE's input
    x3 = x2 + attn[1](input_layernorm[1](x2))
    out = x3 + mlps[1](post_attention_layernorm[1](x3)) + shortcut

with LongCat's latent attention (q LoRA always, the queries scaled by ``sqrt(hidden /
q_lora_rank)`` and the normed kv latent by ``sqrt(hidden / kv_lora_rank)``, interleaved RoPE
pairs) and LongCat's router: a softmax over the ``n_routed_experts + zero_expert_num`` experts,
``e_score_correction_bias`` added for the choice only, the chosen scores (not renormalized)
times ``routed_scaling_factor``. A choice of expert ``e >= n_routed_experts`` is a
zero-computation (identity) expert: it returns its input times its weight.

Every parameter is random as in ``make_golden.py`` (linear weights N(0, 1/fan_in), embeddings
N(0, 1), norms 1 + 0.2 N(0, 1)); the correction bias is N(0, BIAS_STD^2). After writing, the
script re-loads the checkpoint, checks logits and greedy tokens against ``reference.npz``,
checks the logits against an independent float64 NumPy forward pass (``numpy_forward``), that
the router really chooses the zero-computation experts (``MIN_ZERO_SHARE`` of all choices at
least, in every layer), that no token sits near a routing tie, and that each detail of the math
changes the logits.

``save_pretrained`` writes ``mlp.experts.{e}.{gate,up}_proj.weight`` for the zero-computation
experts too (transformers 5 holds ``gate_up_proj`` for all ``n_routed + zero`` experts and never
reads those rows); they stay in the file, as a loader must skip them.

Run (from the repository root; needs the Python 3.11 CPU-torch venv, see tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_golden_longcat.py
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file
from transformers import LongcatFlashConfig, LongcatFlashForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as base  # noqa: E402

GOLDEN = base.GOLDEN
NAME = "longcat_flash"
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the RMSNorm default, not rms_norm_eps
BIAS_STD = 0.03  # of the order of the softmax scores' spread (1/12), so it moves some choices
MIN_ROUTING_MARGIN = 1e-4  # between the k-th and (k+1)-th choice score
MIN_ZERO_SHARE = 0.15  # of all (token, choice) pairs in each layer: zero-computation experts
MAX_WEIGHT_TRIES = 20

CONFIG = {
    "vocab_size": base.VOCAB,
    "hidden_size": 32,
    "num_layers": 2,  # transformers' num_hidden_layers is 2 * num_layers (two attentions each)
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "ffn_hidden_size": 32,  # the dense mlps[0] and mlps[1]
    "expert_ffn_hidden_size": 8,
    "n_routed_experts": 8,
    "zero_expert_num": 4,
    "moe_topk": 3,
    "routed_scaling_factor": 6.0,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "head_dim": 8,  # the RoPE's dimension in transformers' LongcatFlashRotaryEmbedding
    "v_head_dim": 12,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, resid_gain: float = 1.0) -> None:
    """Every parameter as `make_golden.randomize_` draws it (LongCat's names: the norms are
    `input_layernorm.{0,1}.weight`, the experts `experts.gate_up_proj` [E + Z, 2I, H] and
    `experts.down_proj` [E, H, I], the router `router.classifier.weight`), and every router's
    `e_score_correction_bias` (a buffer) N(0, BIAS_STD^2)."""
    del resid_gain
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if "norm" in name and p.ndim == 1:
            p.copy_(1.0 + 0.2 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        elif p.ndim == 2:
            p.copy_(noise / math.sqrt(p.shape[1]))
        elif p.ndim == 3 and ".experts." in name:
            p.copy_(noise / math.sqrt(p.shape[2]))
        else:
            raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(BIAS_STD * torch.randn(buffer.shape, generator=gen))


SPEC = {
    "config_cls": LongcatFlashConfig,
    "model_cls": LongcatFlashForCausalLM,
    "randomize": randomize,
    "seed": 1031,
    "prompt_seed": 2031,
    "resid_gain": 1.0,
    "shard_size": None,
    "legacy_config": False,
    "config": CONFIG,
}


# --------------------------------------------------------------------------------------------
# Independent NumPy forward pass (float64), with one detail broken at a time
# --------------------------------------------------------------------------------------------

VARIANTS = (
    "latent-norm-skipped",
    "no-q-lora-scale",
    "no-kv-lora-scale",
    "rope-not-interleaved",
    "zero-experts-output-zero",
    "bias-in-weights",
    "no-bias",
    "no-routed-scaling",
    "renormalized",
    "shortcut-added-early",
    "dense-branch-renormed",
)


def route(cfg: dict, w: dict, p: str, h: np.ndarray, variant: str, stats: dict | None):
    """Per token: (experts, weights) of LongCat's router; records margins and zero choices."""
    logits = h @ w[p + "router.classifier.weight"].T  # [T, E + Z]
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    bias = 0.0 if variant == "no-bias" else w[p + "router.e_score_correction_bias"]
    choice = scores + bias
    k = cfg["moe_topk"]
    out = []
    for t in range(len(h)):
        ranked = np.argsort(-choice[t], kind="stable")
        chosen = ranked[:k]
        weights = (choice if variant == "bias-in-weights" else scores)[t, chosen]
        if variant == "renormalized":
            weights = weights / weights.sum()
        if variant != "no-routed-scaling":
            weights = weights * cfg["routed_scaling_factor"]
        if stats is not None:
            stats["margins"].append(choice[t, ranked[k - 1]] - choice[t, ranked[k]])
            stats["zero"].append(int(np.sum(chosen >= cfg["n_routed_experts"])))
            stats["choices"].append(k)
        out.append((chosen, weights))
    return out


def numpy_forward(ckpt: Path, ids: list[int], variant: str = "", stats=None) -> np.ndarray:
    """Float64 logits [T, vocab] of one prompt, written from transformers' LongCat code;
    `stats` (a dict of lists, per layer) collects routing margins and zero-expert choices."""
    cfg = json.loads((ckpt / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    rank, eps, routed = cfg["kv_lora_rank"], cfg["rms_norm_eps"], cfg["n_routed_experts"]
    q_scale = 1.0 if variant == "no-q-lora-scale" else math.sqrt(hidden / cfg["q_lora_rank"])
    kv_scale = 1.0 if variant == "no-kv-lora-scale" else math.sqrt(hidden / rank)

    def rms(x, g, e=eps):
        return g * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + e))

    def swiglu(x, gate, up, down):
        g = x @ gate.T
        return ((g / (1 + np.exp(-g))) * (x @ up.T)) @ down.T

    T = len(ids)
    theta = cfg["rope_parameters"]["rope_theta"]
    dim = cfg["head_dim"]
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.arange(T)[:, None] * inv[None, :]
    cos, sin = np.cos(angles), np.sin(angles)

    def rotate(x):  # [T, H, rope]: interleaved pairs (2i, 2i+1), one frequency each
        if variant == "rope-not-interleaved":
            x1, x2 = x[..., : rope // 2], x[..., rope // 2 :]
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    causal = np.tril(np.ones((T, T), dtype=bool))

    def mla(h, a):
        q = rms(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], LATENT_NORM_EPS)
        q = (q @ w[a + "q_b_proj.weight"].T).reshape(T, heads, nope + rope) * q_scale
        compressed = h @ w[a + "kv_a_proj_with_mqa.weight"].T
        c, k_rope = compressed[:, :rank], compressed[:, rank:]
        if variant != "latent-norm-skipped":
            c = rms(c, w[a + "kv_a_layernorm.weight"], LATENT_NORM_EPS)
        kv = (c * kv_scale @ w[a + "kv_b_proj.weight"].T).reshape(T, heads, nope + vd)
        k_rope = rotate(k_rope[:, None, :])
        q_full = np.concatenate([q[..., :nope], rotate(q[..., nope:])], axis=-1)
        k_full = np.concatenate([kv[..., :nope], np.repeat(k_rope, heads, axis=1)], axis=-1)
        s = np.einsum("thd,shd->hts", q_full, k_full) * (nope + rope) ** -0.5
        s = np.where(causal[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        out = np.einsum("hts,shd->thd", s, kv[..., nope:]).reshape(T, heads * vd)
        return out @ w[a + "o_proj.weight"].T

    def moe(h, m, layer_stats):
        out = np.zeros_like(h)
        for t, (chosen, weights) in enumerate(route(cfg, w, m, h, variant, layer_stats)):
            for e, weight in zip(chosen, weights, strict=True):
                if e >= routed:  # zero-computation expert: the identity
                    if variant != "zero-experts-output-zero":
                        out[t] += weight * h[t]
                    continue
                names = (f"{m}experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down"))
                out[t] += weight * swiglu(h[t], *(w[n] for n in names))
        return out

    def dense(h, m):
        return swiglu(h, *(w[f"{m}{n}_proj.weight"] for n in ("gate", "up", "down")))

    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    for i in range(cfg["num_layers"]):
        p = f"model.layers.{i}."
        layer_stats = None
        if stats is not None:
            layer_stats = stats.setdefault(i, {"margins": [], "zero": [], "choices": []})
        x = x + mla(rms(x, w[p + "input_layernorm.0.weight"]), p + "self_attn.0.")
        h = rms(x, w[p + "post_attention_layernorm.0.weight"])
        shortcut = moe(h, p + "mlp.", layer_stats)
        if variant == "dense-branch-renormed":  # mlps[0] normalizing its input again
            h = rms(h, w[p + "post_attention_layernorm.0.weight"])
        x = x + dense(h, p + "mlps.0.")
        if variant == "shortcut-added-early":
            x = x + shortcut
        x = x + mla(rms(x, w[p + "input_layernorm.1.weight"]), p + "self_attn.1.")
        x = x + dense(rms(x, w[p + "post_attention_layernorm.1.weight"]), p + "mlps.1.")
        if variant != "shortcut-added-early":
            x = x + shortcut
    x = rms(x, w["model.norm.weight"])
    return x @ w["lm_head.weight"].T


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def routing_stats(out: Path, prompts: list[list[int]], generated: list[list[int]]) -> dict:
    """Per layer: margins and zero-expert choices over the prompts and their continuations."""
    stats: dict = {}
    for prompt, gen in zip(prompts, generated, strict=True):
        numpy_forward(out, prompt + gen[:-1], stats=stats)
    return stats


def routing_ok(stats: dict) -> bool:
    """No near-tie, and every layer routes MIN_ZERO_SHARE of its choices to zero experts."""
    return all(
        min(s["margins"]) > MIN_ROUTING_MARGIN
        and sum(s["zero"]) >= MIN_ZERO_SHARE * sum(s["choices"])
        for s in stats.values()
    )


@torch.no_grad()
def make() -> dict:
    """Writes the fixture, drawing the weights again (next seed) until routing is off ties and
    chooses the zero-computation experts often enough."""
    out = GOLDEN / NAME
    for attempt in range(MAX_WEIGHT_TRIES):
        trial = SPEC | {"seed": SPEC["seed"] + attempt}
        summary, ref, _ = base.write_reference(NAME, trial)
        assert ref.config.model_type == NAME, ref.config.model_type
        prompts = json.loads((out / "prompts.json").read_text())
        generated = np.load(out / "reference.npz")["generated"].tolist()
        if routing_ok(routing_stats(out, prompts, generated)):
            break
    else:
        raise AssertionError(f"no weight seed keeps routing {MIN_ROUTING_MARGIN} off ties")
    summary["seed"] = trial["seed"]
    return summary


@torch.no_grad()
def verify() -> dict:
    """Re-load from disk and compare against reference.npz and the NumPy forward."""
    out, ref, prompts, model = base.reloaded(NAME)
    max_np_err = 0.0
    for b, p in enumerate(prompts):
        n = int(ref["lengths"][b])
        assert n == len(p) and ref["input_ids"][b, :n].tolist() == p
        got = base.logits_alone(model, p)
        assert np.abs(got - ref["logits"][b, :n]).max() <= 1e-6
        max_np_err = max(max_np_err, float(np.abs(numpy_forward(out, p) - got).max()))
        gen, _ = base.greedy_no_cache(model, p)
        assert gen == ref["generated"][b].tolist(), b
    assert max_np_err < 1e-3, max_np_err
    stats = routing_stats(out, prompts, ref["generated"].tolist())
    assert routing_ok(stats), stats
    longest = max(prompts, key=len)
    exact = numpy_forward(out, longest)
    effects = {}
    for variant in VARIANTS:
        effects[variant] = float(np.abs(numpy_forward(out, longest, variant) - exact).max())
        assert effects[variant] > 1e-2, (variant, effects[variant])  # the detail matters
    files = sorted(f for f in out.iterdir() if f.is_file())
    return {
        "numpy_max_err": max_np_err,
        "router_margin": min(min(s["margins"]) for s in stats.values()),
        "zero_share": {
            layer: f"{sum(s['zero'])}/{sum(s['choices'])}" for layer, s in stats.items()
        },
        "effects": effects,
        "files": {f.name: f.stat().st_size for f in files},
        "n_params": sum(p.numel() for p in model.parameters()),
    }


def main() -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}  transformers {transformers.__version__}")
    made = make()
    checked = verify()
    size = sum(checked["files"].values())
    print(f"\n== {NAME}: {checked['n_params']} params, {size / 1e3:.1f} kB")
    for fname, sz in checked["files"].items():
        print(f"   {fname:30s} {sz:>9d} B")
    print(
        f"   max|logit| {made['max_abs_logit']:.3f}   min top-2 gap {made['min_gap']:.4f}"
        f"   weight seed {made['seed']}   prompt seed {made['prompt_seed']}"
    )
    print(
        f"   bf16 max|dlogit| {made['bf16_max_err']:.4f}   bf16 greedy == fp32 greedy: "
        f"{made['bf16_greedy_same']}"
    )
    print(f"   numpy float64 re-implementation max|dlogit| {checked['numpy_max_err']:.2e}")
    print(
        f"   smallest routing margin {checked['router_margin']:.2e}; choices of a "
        f"zero-computation expert per layer {checked['zero_share']}"
    )
    print(f"   max|dlogit| with one detail broken: {checked['effects']}")
    assert size < 500_000, size
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
