"""Golden fixture for GPT-OSS (attention sinks, q/k/v/o biases, alternating windows, YaRN, a biased
router and biased clamped-SwiGLU experts), and its MXFP4 form read by transformers.

A sibling of ``make_golden.py`` with the same conventions and files (``config.json``,
``generation_config.json``, float32 ``model.safetensors``, ``prompts.json``, ``reference.npz``
with the same keys) in ``tests/golden/gpt_oss``: 2 layers (sliding window 4, then full), 8 query
heads over 2 kv heads of width 16, 8 experts of width 32 (top-2), YaRN (factor 4, original 64,
``truncate: false``, which moves one frequency here), ``swiglu_limit`` 1.25 (so the clamp cuts
some gate and up values of random weights).

Every weight is random (``randomize``): projections N(0, 1/fan_in), q/k/v/o, router and expert
biases N(0, 0.25), sinks N(0, 4) (so the sink takes a large share of some heads' weight), norms
1 + 0.2 N(0, 1). After writing, the script re-loads the checkpoint, checks logits and greedy
tokens against ``reference.npz`` and against an independent float64 NumPy forward pass
(``numpy_forward``), that no token sits near a routing tie, that the clamp is active on some
values and not on most, and that each detail of the math changes the logits (``VARIANTS``).

MXFP4: ``reference.npz`` also holds ``logits_mxfp4``, transformers' logits of the checkpoint's
MXFP4 form as ``models/weights/mxfp4.py`` writes it (``write_mxfp4_checkpoint``, loaded from its
file: that module needs only NumPy and safetensors), loaded by transformers with
``Mxfp4Config(dequantize=True)``; and ``mxfp4_sample.npz`` random packed blocks and scales with
transformers' own dequantization of them (``convert_moe_packed_tensors``), which pins the layout
the loader reads. The script checks transformers' dequantized experts equal the module's.

Run (from the repository root; needs the Python 3.11 CPU-torch venv, see tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_golden_gpt_oss.py
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as base  # noqa: E402

NAME = "gpt_oss"
GOLDEN = base.GOLDEN
MIN_ROUTING_MARGIN = 1e-4
MAX_WEIGHT_TRIES = 20
MXFP4_FILE = Path(__file__).resolve().parents[1] / "models" / "weights" / "mxfp4.py"

SPEC = {
    "config_cls": GptOssConfig,
    "model_cls": GptOssForCausalLM,
    "seed": 1031,
    "prompt_seed": 2031,
    "resid_gain": 1.0,
    "shard_size": None,
    "legacy_config": False,
    "config": {
        "vocab_size": base.VOCAB,
        "hidden_size": 64,
        "intermediate_size": 32,  # the experts' width; a multiple of 32 for MXFP4
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "swiglu_limit": 1.25,
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    },
}


def _mxfp4_module():
    """`models/weights/mxfp4.py`, loaded from its file (the package imports JAX)."""
    spec = importlib.util.spec_from_file_location("mxfp4", MXFP4_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, resid_gain: float = 1.0) -> None:
    """Every parameter random, so a wrong layout, a dropped bias or sink shows in the logits."""
    del resid_gain
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        elif name.endswith("sinks"):
            p.copy_(2.0 * noise)
        elif name.endswith("bias"):  # q/k/v/o, router, expert gate_up and down biases
            p.copy_(0.5 * noise)
        elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            p.copy_(noise / math.sqrt(p.shape[1]))  # [experts, in, out]
        elif p.ndim == 2:  # nn.Linear [out, in], the router's too
            p.copy_(noise / math.sqrt(p.shape[1]))
        else:
            raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")


SPEC["randomize"] = randomize

# --------------------------------------------------------------------------------------------
# Independent NumPy forward pass (float64), with one detail broken at a time
# --------------------------------------------------------------------------------------------

VARIANTS = (
    "no-sinks",
    "no-window",
    "window-off-by-one",
    "no-yarn",
    "truncate",
    "no-yarn-factor",
    "no-o-bias",
    "o-bias-twice",
    "no-qkv-bias",
    "no-router-bias",
    "softmax-over-all",
    "no-expert-bias",
    "down-bias-twice",
    "not-interleaved",
    "no-clamp",
    "gate-clamped-below",
    "up-clamped-above-only",
)


def yarn(cfg: dict, dim: int, variant: str) -> tuple[np.ndarray, float]:
    """Inverse frequencies and cos/sin factor of the config's YaRN RoPE (transformers'
    `_compute_yarn_parameters`, with `truncate`)."""
    rp = cfg["rope_parameters"]
    theta, factor, orig = rp["rope_theta"], rp["factor"], rp["original_max_position_embeddings"]
    powers = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if variant == "no-yarn":
        return 1.0 / powers, 1.0

    def corr(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr(rp["beta_fast"]), corr(rp["beta_slow"])
    if rp.get("truncate", True) or variant == "truncate":
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    inv = (1 / (factor * powers)) * ramp + (1 / powers) * (1 - ramp)
    factor_cos = 1.0 if variant == "no-yarn-factor" else 0.1 * math.log(factor) + 1.0
    return inv, factor_cos


def numpy_forward(
    ckpt: Path, ids: list[int], variant: str = "", margins=None, stats=None
) -> np.ndarray:
    """Float64 logits [T, vocab] of one prompt, written from transformers' GPT-OSS code;
    appends routing margins to `margins` and (gate, up) pre-activations to `stats`."""
    cfg = json.loads((ckpt / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, top_k, limit = cfg["rms_norm_eps"], cfg["num_experts_per_tok"], cfg["swiglu_limit"]
    alpha = cfg.get("swiglu_alpha", 1.702)

    def rms(x, g):
        return g * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    def proj(h, name, bias=True):
        return h @ w[name + ".weight"].T + (w[name + ".bias"] if bias else 0.0)

    T = len(ids)
    inv, factor_cos = yarn(cfg, hd, variant)
    angles = np.arange(T)[:, None] * inv[None, :]
    cos, sin = np.cos(angles) * factor_cos, np.sin(angles) * factor_cos

    def rotate(x):  # [T, H, hd]: halves (NeoX)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    distance = np.arange(T)[:, None] - np.arange(T)[None, :]
    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        h = rms(x, w[p + "input_layernorm.weight"])
        qkv_bias = variant != "no-qkv-bias"
        q = rotate(proj(h, a + "q_proj", qkv_bias).reshape(T, nh, hd))
        k = rotate(proj(h, a + "k_proj", qkv_bias).reshape(T, nkv, hd))
        v = proj(h, a + "v_proj", qkv_bias).reshape(T, nkv, hd)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        visible = distance >= 0
        if cfg["layer_types"][i] == "sliding_attention" and variant != "no-window":
            window = cfg["sliding_window"] + (variant == "window-off-by-one")
            visible &= distance < window
        s = np.einsum("thd,shd->hts", q, k) * hd**-0.5
        s = np.where(visible[None], s, -np.inf)
        sink = w[a + "sinks"][:, None, None] if variant != "no-sinks" else -np.inf
        peak = np.maximum(s.max(-1, keepdims=True), sink)
        e = np.exp(s - peak)
        weights = e / (e.sum(-1, keepdims=True) + np.exp(sink - peak))
        attn = np.einsum("hts,shd->thd", weights, v).reshape(T, nh * hd)
        o_bias = {"no-o-bias": 0.0, "o-bias-twice": 2.0}.get(variant, 1.0)
        x = x + attn @ w[a + "o_proj.weight"].T + o_bias * w[a + "o_proj.bias"]
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        m = p + "mlp."
        logits = h @ w[m + "router.weight"].T
        if variant != "no-router-bias":
            logits = logits + w[m + "router.bias"]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        moe = np.zeros_like(x)
        for t in range(T):
            order = np.argsort(-logits[t], kind="stable")
            chosen = order[:top_k]
            if margins is not None:
                margins.append(probs[t, order[top_k - 1]] - probs[t, order[top_k]])
            if variant == "softmax-over-all":
                gates = probs[t, chosen]
            else:
                gates = np.exp(logits[t, chosen] - logits[t, chosen].max())
                gates /= gates.sum()
            for e_id, gate_weight in zip(chosen, gates, strict=True):
                gate_up = h[t] @ w[m + "experts.gate_up_proj"][e_id]
                if variant != "no-expert-bias":
                    gate_up = gate_up + w[m + "experts.gate_up_proj_bias"][e_id]
                if variant == "not-interleaved":
                    gate, up = np.split(gate_up, 2)
                else:
                    gate, up = gate_up[::2], gate_up[1::2]
                if stats is not None:
                    stats.append((gate, up))
                if variant == "gate-clamped-below":
                    gate, up = np.maximum(gate, -limit), np.clip(up, -limit, limit)
                elif variant == "up-clamped-above-only":
                    gate, up = np.minimum(gate, limit), np.minimum(up, limit)
                elif variant != "no-clamp":
                    gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
                act = (up + 1) * gate / (1 + np.exp(-alpha * gate))
                out = act @ w[m + "experts.down_proj"][e_id]
                down_bias = {"no-expert-bias": 0.0, "down-bias-twice": 2.0}.get(variant, 1.0)
                out = out + down_bias * w[m + "experts.down_proj_bias"][e_id]
                moe[t] += gate_weight * out
        x = x + moe
    x = rms(x, w["model.norm.weight"])
    return x @ w["lm_head.weight"].T


# --------------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------------


def mxfp4_sample(seed: int) -> dict[str, np.ndarray]:
    """Random packed blocks and scales, and transformers' dequantization of them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)  # [experts, rows, groups, 16]
    scales = rng.integers(118, 136, (3, 5, 2), dtype=np.uint8)
    dequantized = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )
    return {"blocks": blocks, "scales": scales, "dequantized": dequantized.numpy()}


@torch.no_grad()
def mxfp4_logits(prompts: list[list[int]]) -> np.ndarray:
    """transformers' logits of the fixture's MXFP4 form (written by the repository's writer),
    each prompt alone; checks its dequantized experts equal the writer's module's."""
    mxfp4 = _mxfp4_module()
    with tempfile.TemporaryDirectory() as tmp:
        quantized = mxfp4.write_mxfp4_checkpoint(GOLDEN / NAME, tmp)
        assert len(quantized) == 2 * SPEC["config"]["num_hidden_layers"], quantized
        model = AutoModelForCausalLM.from_pretrained(
            tmp,
            dtype=torch.float32,
            attn_implementation="eager",
            quantization_config=Mxfp4Config(dequantize=True),
        ).eval()
        stored = load_file(str(Path(tmp) / "model.safetensors"))
        for name in quantized:
            ours = mxfp4.dequantize_mxfp4(stored[name + "_blocks"], stored[name + "_scales"])
            theirs = model.get_parameter(name).detach().numpy()
            assert np.array_equal(ours, theirs), name
        logits = np.zeros((len(prompts), base.MAX_LEN, base.VOCAB), np.float32)
        for b, p in enumerate(prompts):
            logits[b, : len(p)] = base.logits_alone(model, p)
    return logits


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def make() -> dict:
    """Writes the fixture, drawing the weights again (next seed) until no token of the prompts
    and their greedy continuations sits within `MIN_ROUTING_MARGIN` of a routing tie."""
    out = GOLDEN / NAME
    for attempt in range(MAX_WEIGHT_TRIES):
        trial = SPEC | {"seed": SPEC["seed"] + attempt}
        summary, ref, _ = base.write_reference(NAME, trial)
        prompts = json.loads((out / "prompts.json").read_text())
        generated = np.load(out / "reference.npz")["generated"]
        margins: list = []
        for prompt, gen in zip(prompts, generated.tolist(), strict=True):
            numpy_forward(out, prompt + gen[:-1], margins=margins)
        if min(margins) > MIN_ROUTING_MARGIN:
            break
    else:
        raise AssertionError(f"no weight seed keeps routing {MIN_ROUTING_MARGIN} off ties")
    arrays = dict(np.load(out / "reference.npz"))
    arrays["logits_mxfp4"] = mxfp4_logits(prompts)
    base.save_npz_deterministic(out / "reference.npz", arrays)
    base.save_npz_deterministic(out / "mxfp4_sample.npz", mxfp4_sample(trial["seed"]))
    summary["seed"] = trial["seed"]
    return summary


@torch.no_grad()
def verify() -> dict:
    """Re-load from disk and compare against reference.npz and the NumPy forward."""
    out, ref, prompts, model = base.reloaded(NAME)
    max_np_err, margins, stats = 0.0, [], []
    for b, p in enumerate(prompts):
        n = int(ref["lengths"][b])
        assert n == len(p) and ref["input_ids"][b, :n].tolist() == p
        got = base.logits_alone(model, p)
        assert np.abs(got - ref["logits"][b, :n]).max() <= 1e-6
        max_np_err = max(max_np_err, float(np.abs(numpy_forward(out, p) - got).max()))
        gen, _ = base.greedy_no_cache(model, p)
        assert gen == ref["generated"][b].tolist(), b
        numpy_forward(out, p + gen[:-1], margins=margins, stats=stats)
    assert max_np_err < 1e-3, max_np_err
    router_margin = float(min(margins))
    assert router_margin > MIN_ROUTING_MARGIN, router_margin
    limit = SPEC["config"]["swiglu_limit"]
    gates = np.concatenate([g for g, _ in stats])
    ups = np.concatenate([u for _, u in stats])
    clamped = {"gate": float(np.mean(gates > limit)), "up": float(np.mean(np.abs(ups) > limit))}
    assert all(0.02 < share < 0.5 for share in clamped.values()), clamped
    longest = max(prompts, key=len)
    exact = numpy_forward(out, longest)
    effects = {}
    for variant in VARIANTS:
        effects[variant] = float(np.abs(numpy_forward(out, longest, variant) - exact).max())
        assert effects[variant] > 1e-2, (variant, effects[variant])
    mxfp4_error = float(np.abs(ref["logits_mxfp4"] - ref["logits"]).max())
    sample = np.load(out / "mxfp4_sample.npz")
    assert np.array_equal(
        _mxfp4_module().dequantize_mxfp4(sample["blocks"], sample["scales"]),
        sample["dequantized"],
    )
    files = sorted(f for f in out.iterdir() if f.is_file())
    return {
        "numpy_max_err": max_np_err,
        "router_margin": router_margin,
        "clamped": clamped,
        "effects": effects,
        "mxfp4_vs_float": mxfp4_error,
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
    print(f"   smallest routing margin {checked['router_margin']:.2e}")
    print(f"   share of routed values the clamp cuts {checked['clamped']}")
    print(f"   MXFP4 form vs float max|dlogit| {checked['mxfp4_vs_float']:.3f}")
    print(f"   max|dlogit| with one detail broken: {checked['effects']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
