"""Golden fixtures for Nemotron-H (Mamba2, attention, MLP and MoE single-stage layers).

A sibling of ``make_golden.py`` with the same conventions and files (``config.json``,
``generation_config.json``, float32 ``model.safetensors``, ``prompts.json``, ``reference.npz``
with the same keys), for tiny random ``NemotronHForCausalLM`` checkpoints whose layer patterns
(``hybrid_override_pattern``: M Mamba2, * attention, - MLP, E MoE) together hold every
transition between single-stage layers:

* ``nemotron_h_mm_f_m_a_f`` = ``MM-M*-``: a Mamba2 layer at the start, MM, M-, -M, M*, *-;
  2 B/C groups (split at attention TP 2, shared by ranks at TP 4 and 8).
* ``nemotron_h_f_e_m_e_a`` = ``-EME*``: an FFN at the start, an FFN after an FFN (-E), EM, ME,
  E*; Nemotron-3 MoE layers (sigmoid router with the score-correction bias, grouped top-k,
  scaled weights, relu^2 experts and a shared expert); 1 B/C group (shared at any TP > 1).
* ``nemotron_h_a_e_f_m_e`` = ``*E-ME``: attention at the start, *E, E-, -M, ME, a MoE at the
  end; the MoE settings above with 16 experts in 4 groups (EP 8 divides them).

And one mixer alone, ``nemotron_h_mamba2_mixer/``: ``config.json`` and ``mixer.npz`` with
the weights of one ``NemotronHMamba2Mixer`` under their Hugging Face names, random input rows
of four sequences, each one's output run alone (``torch_forward``, the chunked scan), the
outputs of three decode steps after it (the cached conv and SSM state), and a prefill whose
time steps fall below ``time_step_min`` on one head (``dt_bias_clamped``, ``output_clamped``).

Every parameter is random (``randomize_nemotron_``), so that a mis-sharded or mis-named weight
shows: linear weights N(0, 1/fan_in), embeddings N(0, 1), every RMSNorm weight (the mixer's
gated norm too) 1 + 0.2 N(0, 1), conv kernels N(0, 1/K) and biases N(0, 1/4), A_log = log U(0.5,
4), dt_bias U(-3, -1), D 1 + 0.5 N(0, 1), the router's score-correction bias N(0, 0.3^2).
After writing, the script re-loads every checkpoint, checks logits and greedy tokens against
``reference.npz`` and the logits against an independent float64 NumPy forward pass
(``numpy_forward``), and checks that each detail of the math it states changes the logits.

Run (from the repository root; needs the Python 3.11 CPU-torch venv, see tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_golden_nemotron_h.py [names...]
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import NemotronHConfig, NemotronHForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as base  # noqa: E402

GOLDEN = base.GOLDEN

MAMBA = {
    "mamba_num_heads": 8,
    "mamba_head_dim": 8,
    "ssm_state_size": 8,
    "conv_kernel": 4,
    "chunk_size": 5,  # divides none of the prompts (7, 1, 12, 5 and their continuations) but 5
    "time_step_min": 1e-3,
    "use_conv_bias": True,
}
SMALL = {
    "vocab_size": base.VOCAB,
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 32,
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
} | MAMBA
MOE = {
    "n_routed_experts": 12,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 8,
    "moe_shared_expert_intermediate_size": 32,
    "n_group": 3,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}


@torch.no_grad()
def randomize_nemotron_(model: torch.nn.Module, seed: int, resid_gain: float = 1.0) -> None:
    """Overwrites every parameter and the router's score-correction bias (module docstring)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors = dict(model.named_parameters()) | {
        name: b for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")
    }
    for name, p in sorted(tensors.items()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        uniform = torch.rand(p.shape, generator=gen, dtype=torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith(("norm.weight", "norm_f.weight")):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("embeddings.weight"):
            p.copy_(noise)
        elif leaf == "A_log":
            p.copy_(torch.log(0.5 + 3.5 * uniform))
        elif leaf == "dt_bias":
            p.copy_(-3.0 + 2.0 * uniform)
        elif leaf == "D":
            p.copy_(1.0 + 0.5 * noise)
        elif name.endswith("conv1d.weight"):  # [channels, 1, K]
            p.copy_(noise / math.sqrt(p.shape[-1]))
        elif name.endswith("conv1d.bias"):
            p.copy_(0.5 * noise)
        elif name.endswith("e_score_correction_bias"):
            p.copy_(0.3 * noise)
        elif p.ndim == 2:  # nn.Linear weight [out, in], the router's [experts, hidden] too
            gain = resid_gain if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            p.copy_(noise * (gain / math.sqrt(p.shape[1])))
        elif p.ndim == 3 and name.endswith(("experts.up_proj", "experts.down_proj")):
            p.copy_(noise / math.sqrt(p.shape[2]))  # [experts, out, in]
        else:
            raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")


def model_spec(pattern: str, seed: int, extra: dict) -> dict:
    return {
        "config_cls": NemotronHConfig,
        "model_cls": NemotronHForCausalLM,
        "seed": seed,
        "prompt_seed": seed + 1000,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "randomize": randomize_nemotron_,
        "config": SMALL | {"hybrid_override_pattern": pattern} | extra,
    }


MODELS: dict[str, dict] = {
    "nemotron_h_mm_f_m_a_f": model_spec("MM-M*-", 1021, {"n_groups": 2}),
    "nemotron_h_f_e_m_e_a": model_spec("-EME*", 1022, {"n_groups": 1} | MOE),
    "nemotron_h_a_e_f_m_e": model_spec(
        "*E-ME", 1024, {"n_groups": 1} | MOE | {"n_routed_experts": 16, "n_group": 4}
    ),
}
MIXER = "nemotron_h_mamba2_mixer"
MIXER_CONFIG = (
    {"hidden_size": 32, "layers_block_type": ["linear_attention"]}
    | MAMBA
    | {
        "mamba_num_heads": 8,
        "mamba_head_dim": 4,
        "n_groups": 2,  # shared by 2 ranks at attention TP 4
        "ssm_state_size": 6,
    }
)
MIXER_LENGTHS = (9, 1, 13, 4)
DECODE_STEPS = 3


# --------------------------------------------------------------------------------------------
# Independent NumPy forward pass (float64)
# --------------------------------------------------------------------------------------------


def rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def numpy_mamba2(cfg: dict, w: dict, p: str, h: np.ndarray, variant: str = "") -> np.ndarray:
    """One Mamba2 mixer over one sequence h [T, hidden], the recurrence row by row."""
    heads, head_dim = cfg["mamba_num_heads"], cfg["mamba_head_dim"]
    groups, state, kernel = cfg["n_groups"], cfg["ssm_state_size"], cfg["conv_kernel"]
    inner, width = heads * head_dim, groups * state
    rows = h.shape[0]
    proj = h @ w[p + "in_proj.weight"].T
    z, xbc, dt = np.split(proj, [inner, 2 * inner + 2 * width], axis=-1)
    conv_w = w[p + "conv1d.weight"][:, 0]  # [channels, K]
    padded = np.concatenate([np.zeros((kernel - 1, xbc.shape[1])), xbc])
    conv = sum(padded[k : k + rows] * conv_w[:, k] for k in range(kernel))
    if variant != "no-conv-bias":
        conv = conv + w[p + "conv1d.bias"]
    conv = conv / (1 + np.exp(-conv))
    x, b, c = np.split(conv, [inner, inner + width], axis=-1)
    x = x.reshape(rows, heads, head_dim)
    b, c = b.reshape(rows, groups, state), c.reshape(rows, groups, state)
    group_of_head = np.arange(heads) // (heads // groups)
    if variant == "interleaved-groups":
        group_of_head = np.arange(heads) % groups
    dt = np.logaddexp(0, dt + w[p + "dt_bias"])
    dt = np.maximum(dt, cfg["time_step_min"])
    a = -np.exp(w[p + "A_log"])
    s = np.zeros((heads, head_dim, state))
    y = np.zeros((rows, heads, head_dim))
    for t in range(rows):
        bt, ct = b[t, group_of_head], c[t, group_of_head]  # [heads, state]
        s = np.exp(dt[t] * a)[:, None, None] * s + (dt[t, :, None] * x[t])[..., None] * bt[:, None]
        y[t] = np.einsum("hpn,hn->hp", s, ct) + w[p + "D"][:, None] * x[t]
    gated = y.reshape(rows, inner) * (z / (1 + np.exp(-z)))
    group_width = inner if variant == "ungrouped-norm" else inner // groups
    grouped = gated.reshape(rows, -1, group_width)
    grouped = grouped / np.sqrt(
        np.mean(grouped**2, axis=-1, keepdims=True) + cfg["layer_norm_epsilon"]
    )
    normed = grouped.reshape(rows, inner) * w[p + "norm.weight"]
    return normed @ w[p + "out_proj.weight"].T, float(dt.min())


def numpy_attention(cfg: dict, w: dict, p: str, h: np.ndarray) -> np.ndarray:
    """Causal GQA attention without positional encoding (Nemotron-H applies no RoPE)."""
    heads, kv, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rows = h.shape[0]
    q = (h @ w[p + "q_proj.weight"].T).reshape(rows, heads, head_dim)
    k = np.repeat((h @ w[p + "k_proj.weight"].T).reshape(rows, kv, head_dim), heads // kv, 1)
    v = np.repeat((h @ w[p + "v_proj.weight"].T).reshape(rows, kv, head_dim), heads // kv, 1)
    scores = np.einsum("thd,shd->hts", q, k) * head_dim**-0.5
    scores = np.where(np.tril(np.ones((rows, rows), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hts,shd->thd", probs, v).reshape(rows, heads * head_dim)
    return out @ w[p + "o_proj.weight"].T


def relu2_mlp(h: np.ndarray, up: np.ndarray, down: np.ndarray, variant: str) -> np.ndarray:
    hidden = np.maximum(h @ up.T, 0)
    return (hidden if variant == "relu" else hidden**2) @ down.T


def numpy_moe(cfg: dict, w: dict, p: str, h: np.ndarray, variant: str, routing: list) -> np.ndarray:
    """Nemotron-3's router (sigmoid, score-correction bias, grouped top-k) and relu^2 experts."""
    experts, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    groups, top_groups = cfg["n_group"], cfg["topk_group"]
    scores = 1 / (1 + np.exp(-(h @ w[p + "gate.weight"].T)))  # [T, E]
    choice = scores + (0 if variant == "no-score-bias" else w[p + "gate.e_score_correction_bias"])
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        ranked, group_margin = choice[t].copy(), np.inf
        if variant != "no-group-limit":
            per_group = np.sort(choice[t].reshape(groups, -1), axis=-1)[:, -2:].sum(-1)
            by_score = np.argsort(-per_group, kind="stable")
            group_margin = per_group[by_score[top_groups - 1]] - per_group[by_score[top_groups]]
            kept = np.isin(np.arange(experts) // (experts // groups), by_score[:top_groups])
            ranked = np.where(kept, ranked, -np.inf)
        order = np.argsort(-ranked, kind="stable")
        chosen = order[:k]
        # The margins a float32 reimplementation must not cross: k-th vs (k+1)-th expert,
        # and the last kept group vs the first dropped one.
        margin = min(ranked[order[k - 1]] - ranked[order[k]], group_margin)
        routing.append((tuple(sorted(chosen.tolist())), float(margin)))
        weights = scores[t, chosen]
        weights = weights / (weights.sum() + 1e-20) * cfg["routed_scaling_factor"]
        for e, weight in zip(chosen, weights, strict=True):
            up, down = w[f"{p}experts.{e}.up_proj.weight"], w[f"{p}experts.{e}.down_proj.weight"]
            out[t] += weight * relu2_mlp(h[t], up, down, variant)
    shared = p + "shared_experts."
    return out + relu2_mlp(h, w[shared + "up_proj.weight"], w[shared + "down_proj.weight"], variant)


def numpy_forward(
    ckpt: Path, ids: list[int], variant: str = "", routing: list | None = None
) -> tuple[np.ndarray, float]:
    """Float64 logits [T, vocab] of one prompt, and the smallest Mamba2 time step seen.
    `variant` breaks one detail on purpose (`VARIANTS`) to show the logits depend on it."""
    cfg = json.loads((ckpt / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in base.load_np_weights(ckpt).items()}
    eps = cfg["layer_norm_epsilon"]
    routing = [] if routing is None else routing
    x = w["backbone.embeddings.weight"][np.asarray(ids)]
    smallest_dt = math.inf
    for i, kind in enumerate(cfg["layers_block_type"]):
        p = f"backbone.layers.{i}."
        h = rms(x, w[p + "norm.weight"], eps)
        m = p + "mixer."
        if kind == "linear_attention":
            out, low = numpy_mamba2(cfg, w, m, h, variant)
            smallest_dt = min(smallest_dt, low)
        elif kind == "full_attention":
            out = numpy_attention(cfg, w, m, h)
        elif kind == "mlp":
            out = relu2_mlp(h, w[m + "up_proj.weight"], w[m + "down_proj.weight"], variant)
        else:
            out = numpy_moe(cfg, w, m, h, variant, routing)
        x = x + out
    return rms(x, w["backbone.norm_f.weight"], eps) @ w["lm_head.weight"].T, smallest_dt


VARIANTS = {
    "nemotron_h_mm_f_m_a_f": ("relu", "no-conv-bias", "interleaved-groups", "ungrouped-norm"),
    "nemotron_h_f_e_m_e_a": ("relu", "no-score-bias", "no-group-limit", "no-conv-bias"),
    "nemotron_h_a_e_f_m_e": ("relu", "no-score-bias", "no-group-limit", "no-conv-bias"),
}


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def verify(name: str) -> dict:
    """Re-load from disk and compare everything against reference.npz and the NumPy forward."""
    out, ref, prompts, model = base.reloaded(name)
    cfg = json.loads((out / "config.json").read_text())
    max_np_err, smallest_dt, routing = 0.0, math.inf, []
    for b, p in enumerate(prompts):
        n = int(ref["lengths"][b])
        assert n == len(p) and ref["input_ids"][b, :n].tolist() == p
        got = base.logits_alone(model, p)
        assert np.abs(got - ref["logits"][b, :n]).max() <= 1e-6, name
        logits, low = numpy_forward(out, p)
        max_np_err = max(max_np_err, float(np.abs(logits - got).max()))
        gen, _ = base.greedy_no_cache(model, p)
        assert gen == ref["generated"][b].tolist(), (name, b)
        smallest_dt = min(smallest_dt, numpy_forward(out, p + gen[:-1], routing=routing)[1], low)
    assert max_np_err < 1e-3, (name, max_np_err)
    # Hugging Face clips the time step at time_step_min in a prefill but not in a decode step;
    # no time step reaches that limit here, so both paths agree.
    assert smallest_dt > 2 * cfg["time_step_min"], (name, smallest_dt)
    longest = max(prompts, key=len)
    exact = numpy_forward(out, longest)[0]
    effects = {}
    for variant in VARIANTS[name]:
        effects[variant] = float(np.abs(numpy_forward(out, longest, variant)[0] - exact).max())
        assert effects[variant] > 1e-2, (name, variant, effects[variant])
    summary = {"numpy_max_err": max_np_err, "smallest_dt": smallest_dt, "effects": effects}
    if routing:
        used = {e for chosen, _ in routing for e in chosen}
        assert len(used) == cfg["n_routed_experts"], (name, sorted(used))
        margin = min(m for _, m in routing)
        assert margin > 1e-4, (name, margin)
        summary["experts_used"] = f"{len(used)}/{cfg['n_routed_experts']}"
        summary["router_margin"] = margin
    files = sorted(f for f in out.iterdir() if f.is_file())
    summary["files"] = {f.name: f.stat().st_size for f in files}
    summary["n_params"] = sum(p.numel() for p in model.parameters())
    return summary


# --------------------------------------------------------------------------------------------
# The mixer alone
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def make_mixer() -> dict:
    """Writes nemotron_h_mamba2_mixer/{config.json, mixer.npz} (module docstring)."""
    out = GOLDEN / MIXER
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = NemotronHConfig(**MIXER_CONFIG, **base.COMMON_CONFIG)
    config.save_pretrained(out)
    (out / "config.json").chmod(0o644)
    torch.manual_seed(1030)
    mixer = NemotronHMamba2Mixer(config, layer_idx=0).eval()
    randomize_nemotron_(mixer, seed=1030)
    gen = torch.Generator(device="cpu").manual_seed(2030)
    longest, hidden = max(MIXER_LENGTHS), config.hidden_size
    rows = torch.randn((len(MIXER_LENGTHS), longest, hidden), generator=gen)
    steps = torch.randn((len(MIXER_LENGTHS), DECODE_STEPS, hidden), generator=gen)
    output = torch.zeros_like(rows)
    decoded = torch.zeros_like(steps)
    for s, length in enumerate(MIXER_LENGTHS):
        output[s, :length] = mixer(rows[s : s + 1, :length])[0]
        cache = DynamicCache(config=config)
        prefill = mixer(rows[s : s + 1, :length], cache=cache)[0]
        assert torch.allclose(prefill, output[s, :length], atol=1e-6)
        for t in range(DECODE_STEPS):
            decoded[s, t] = mixer(steps[s : s + 1, t : t + 1], cache=cache)[0, 0]
        whole = torch.cat([rows[s, :length], steps[s]])[None]
        assert torch.allclose(mixer(whole)[0, length:], decoded[s], atol=1e-5), s
    arrays = {name: p.numpy().copy() for name, p in mixer.named_parameters()}
    clamped = arrays["dt_bias"].copy()
    clamped[0] -= 9.0  # softplus(-9 - ...) < 1.2e-4: clipped to time_step_min = 1e-3
    mixer.dt_bias.copy_(torch.from_numpy(clamped))
    output_clamped = torch.zeros_like(rows)
    for s, length in enumerate(MIXER_LENGTHS):
        output_clamped[s, :length] = mixer(rows[s : s + 1, :length])[0]
    mixer.time_step_limit = (0.0, math.inf)  # what the clip changes
    unclipped = torch.cat([mixer(rows[s : s + 1, :n])[0] for s, n in enumerate(MIXER_LENGTHS)])
    clipped = torch.cat([output_clamped[s, :n] for s, n in enumerate(MIXER_LENGTHS)])
    clamp_effect = float((clipped - unclipped).abs().max())
    assert clamp_effect > 1e-4, clamp_effect
    arrays |= {
        "dt_bias_clamped": clamped,
        "lengths": np.asarray(MIXER_LENGTHS, np.int32),
        "rows": rows.numpy(),
        "output": output.numpy(),
        "decode_rows": steps.numpy(),
        "decode_output": decoded.numpy(),
        "output_clamped": output_clamped.numpy(),
    }
    base.save_npz_deterministic(out / "mixer.npz", arrays)
    return {
        "files": {f.name: f.stat().st_size for f in sorted(out.iterdir())},
        "max_abs_output": float(output.abs().max()),
        "clamp_effect": clamp_effect,
    }


def main() -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}  transformers {transformers.__version__}")
    names = sys.argv[1:] or [*MODELS, MIXER]
    unknown = sorted(set(names) - MODELS.keys() - {MIXER})
    if unknown:
        raise SystemExit(f"unknown golden names {unknown}; choose among {[*MODELS, MIXER]}")
    for name in names:
        if name == MIXER:
            made = make_mixer()
            print(f"\n== {name}: {made}")
            continue
        summary, ref, _ = base.write_reference(name, MODELS[name])
        assert type(ref) is NemotronHForCausalLM, type(ref)
        checked = verify(name)
        size = sum(checked["files"].values())
        print(f"\n== {name}: {checked['n_params']} params, {size / 1e3:.1f} kB {checked['files']}")
        print(
            f"   max|logit| {summary['max_abs_logit']:.3f}   min top-2 gap {summary['min_gap']:.4f}"
            f"   prompt seed {summary['prompt_seed']}"
        )
        print(
            f"   bf16 max|dlogit| {summary['bf16_max_err']:.4f}   bf16 greedy == fp32 greedy: "
            f"{summary['bf16_greedy_same']}"
        )
        print(f"   numpy float64 re-implementation max|dlogit| {checked['numpy_max_err']:.2e}")
        print(f"   smallest Mamba2 time step {checked['smallest_dt']:.2e}")
        if "experts_used" in checked:
            print(
                f"   experts used {checked['experts_used']}; smallest gap between the k-th and "
                f"(k+1)-th expert or the last kept and first dropped group "
                f"{checked['router_margin']:.2e}"
            )
        print(f"   max|dlogit| with one detail broken: {checked['effects']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
