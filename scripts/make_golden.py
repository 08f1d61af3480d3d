"""Generate the golden parity fixtures under ``tests/golden/`` with PyTorch ``transformers``.

What it produces, for each of three tiny random decoder checkpoints (``qwen3``, ``llama``,
``mistral``), in ``tests/golden/<name>/``:

* ``config.json``, ``generation_config.json`` and float32 ``*.safetensors`` weights written by
  ``save_pretrained`` (``llama`` is saved SHARDED: ``model-0000x-of-0000y.safetensors`` plus
  ``model.safetensors.index.json``; its ``config.json`` is rewritten in the legacy
  ``rope_theta`` + ``rope_scaling`` form used by the real Llama-3.x hub checkpoints, while
  ``qwen3``/``mistral`` keep the transformers-5 ``rope_parameters`` form).
* ``prompts.json``: 4 ragged prompts of token ids (a JSON list of lists, the CLI input format).
* ``reference.npz`` (see ``tests/golden/README.md``): ``input_ids`` [4, 12] int32 (0-padded),
  ``lengths`` [4] int32, ``logits`` [4, 12, 250] float32 (each prompt run alone, eager attention,
  zeros past each prompt's end), ``logits_bf16`` (same, model loaded in bfloat16, stored as
  float32), ``generated`` [4, 6] int32 (greedy, 6 new tokens, no EOS) and ``min_top2_gap`` [4]
  float32 (smallest top-1/top-2 logit gap seen over each prompt's greedy steps).

Every parameter is random (linear weights N(0, 1/fan_in), embeddings N(0, 1), every RMSNorm
weight 1 + 0.2 N(0, 1), q_norm/k_norm included), with a fixed seed per model, so that a
transposed, mis-sharded or mis-named weight shows up in the logits. Exception: qwen3 (tied
embeddings) draws o_proj/down_proj with std 8/sqrt(fan_in), see ``MODELS["qwen3"]``.

After writing, the script re-loads every checkpoint with ``AutoModelForCausalLM.from_pretrained``
and checks the logits (bitwise, at most 1e-6 tolerated) and the greedy tokens, and checks the
logits against an independent float64 NumPy forward pass written from the formulas (see
``numpy_forward``), then prints a summary.

Run (from the repository root; needs the Python 3.11 CPU-torch venv, see tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_golden.py

Re-running rewrites byte-identical files (fixed seeds, CPU float32, fixed zip timestamps in the
``.npz``), as far as torch's CPU kernels are deterministic.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file as load_safetensors_np
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"

VOCAB = 250
PROMPT_LENGTHS = (7, 1, 12, 5)
MAX_LEN = max(PROMPT_LENGTHS)
NEW_TOKENS = 6
# Greedy steps must have a clear winner: the top-1 / top-2 logit gap must exceed this at every
# generated step (fp32), otherwise the prompts are re-drawn with the next prompt seed.
MIN_GAP = 1e-3
# A stronger, preferred margin: we keep drawing prompts (up to MAX_PROMPT_TRIES) until the
# smallest gap is at least this, so that a JAX run with other matmul kernels picks the same token.
PREFERRED_GAP = 5e-2
MAX_PROMPT_TRIES = 200

# Llama-3 rope scaling. head_dim = 64 / 8 = 8 -> 4 frequencies 1, 0.1, 0.01, 0.001 (theta 1e4),
# wavelengths 2*pi/inv_freq = 6.28, 62.8, 628, 6283. With original_max_position_embeddings = 100,
# high_freq_wavelen = 100/4 = 25 and low_freq_wavelen = 100/1 = 100: frequency 0 is kept as is,
# frequency 1 is interpolated with smooth factor (100/62.8 - 1)/3 = 0.197 (0.1 -> 0.0298) and
# frequencies 2, 3 are divided by `factor` = 8, so all three branches of the llama3 formula
# matter. (With the 16 first suggested, every frequency would be scaled, none kept, and with 64
# the smooth factor would be 0.006, nearly indistinguishable from dividing by 8.) It must stay
# below max_position_embeddings = 128, or transformers warns.
LLAMA3_ORIGINAL_MAX_POS = 100

MODELS: dict[str, dict] = {
    "qwen3": {
        "config_cls": Qwen3Config,
        "model_cls": Qwen3ForCausalLM,
        "seed": 1001,
        "prompt_seed": 2001,
        # Tied embeddings: with std-1 embeddings and std 1/sqrt(fan_in) everywhere, the current
        # token's embedding dominates the residual stream and lm_head = embed_tokens^T maps it back
        # to itself, so greedy decoding just repeats the last prompt token, whatever attention
        # does. o_proj/down_proj get std resid_gain/sqrt(fan_in) so the layers dominate instead.
        "resid_gain": 8.0,
        "shard_size": None,
        "legacy_config": False,
        "config": {
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 16,  # 8 * 16 = 128 != hidden_size 64, on purpose
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 128,
            "tie_word_embeddings": True,
            "attention_bias": False,
        },
    },
    "llama": {
        "config_cls": LlamaConfig,
        "model_cls": LlamaForCausalLM,
        "seed": 1002,
        "prompt_seed": 2002,
        "resid_gain": 1.0,
        "shard_size": 240_000,  # bytes; ~560 KB of weights -> 3 shards
        "legacy_config": True,
        "config": {
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 128,
            "tie_word_embeddings": False,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POS,
            },
        },
    },
    "mistral": {
        "config_cls": MistralConfig,
        "model_cls": MistralForCausalLM,
        "seed": 1003,
        "prompt_seed": 2003,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "config": {
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 8,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 128,
            "sliding_window": None,
            "tie_word_embeddings": False,
        },
    },
}

# Mixture-of-experts checkpoints and dense Qwen2 (q/k/v biases). Shapes are chosen so routing is
# not trivial: many experts, top-k >= 2, and the prompts' tokens spread over all experts (checked
# in `verify`). Expert widths are small to keep the files small.
MOE_MIXTRAL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 16,  # Mixtral's expert width (it has no dense FFN)
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "router_jitter_noise": 0.0,
}

MODELS |= {
    "qwen3_moe": {
        "config_cls": Qwen3MoeConfig,
        "model_cls": Qwen3MoeForCausalLM,
        "seed": 1004,
        "prompt_seed": 2004,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "config": {
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,  # the dense FFN of layer 1 (mlp_only_layers)
            "moe_intermediate_size": 16,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],  # layers 0 and 2 sparse, layer 1 dense
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 128,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "sliding_window": None,
            "use_sliding_window": False,
        },
    },
    "mixtral": {
        "config_cls": MixtralConfig,
        "model_cls": MixtralForCausalLM,
        "seed": 1005,
        "prompt_seed": 2005,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "config": MOE_MIXTRAL | {"sliding_window": None},
    },
    # The same architecture with a sliding window of 5: prompts of 7 and 12 tokens and their
    # continuations (up to 18 tokens) run past it, the 1- and 5-token prompts do not.
    "mixtral_sliding": {
        "config_cls": MixtralConfig,
        "model_cls": MixtralForCausalLM,
        "seed": 1006,
        "prompt_seed": 2006,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "config": MOE_MIXTRAL | {"sliding_window": 5},
    },
    "qwen2_moe": {
        "config_cls": Qwen2MoeConfig,
        "model_cls": Qwen2MoeForCausalLM,
        "seed": 1008,
        "prompt_seed": 2007,
        "resid_gain": 1.0,
        "shard_size": None,
        "legacy_config": False,
        "config": {
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 64,  # the dense FFN of layer 1 (mlp_only_layers)
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            # Layer 1 dense between sparse ones; layer 2 a sparse layer neither first nor last
            # (the middle sparse layer `plan` reports).
            "mlp_only_layers": [1],
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "qkv_bias": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 128,
            "tie_word_embeddings": False,
            "sliding_window": None,
            "use_sliding_window": False,
        },
    },
    "qwen2": {
        "config_cls": Qwen2Config,
        "model_cls": Qwen2ForCausalLM,
        "seed": 1008,
        "prompt_seed": 2008,
        # Tied embeddings, as Qwen2-0.5B: the same remedy as qwen3 against greedy decoding that
        # only repeats the last prompt token.
        "resid_gain": 8.0,
        "shard_size": None,
        "legacy_config": False,
        "config": {
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 128,
            "tie_word_embeddings": True,
            "sliding_window": None,
            "use_sliding_window": False,
        },
    },
}

# Common to all: float32, no special tokens (so that generation never stops early and
# nn.Embedding gets no padding_idx), eager attention.
COMMON_CONFIG = {
    "dtype": "float32",
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "use_cache": True,
}


# --------------------------------------------------------------------------------------------
# Building and initialising the models
# --------------------------------------------------------------------------------------------


def build_config(spec: dict):
    cfg = spec["config_cls"](**spec["config"], **COMMON_CONFIG)
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, resid_gain: float = 1.0) -> None:
    """Overwrite every parameter: Linear N(0, 1/fan_in), Embedding N(0, 1), RMSNorm 1 + 0.2 N(0,1).

    The residual-writing projections (o_proj, down_proj) get N(0, resid_gain^2/fan_in). Stacked
    expert weights (transformers 5 holds them as [experts, out, in]; `save_pretrained` writes one
    [out, in] tensor per expert) get N(0, 1/in), so every expert differs; the attention's and
    the MLP's biases N(0, 0.25).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # named_parameters() de-duplicates tied parameters (Qwen3 lm_head is embed_tokens).
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):  # input/post_attention_layernorm, q_norm, k_norm, norm
            assert p.ndim == 1, name
            p.copy_(1.0 + 0.2 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        elif p.ndim == 2:  # nn.Linear weight [out, in]
            gain = resid_gain if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            p.copy_(noise * (gain / math.sqrt(p.shape[1])))
        elif p.ndim == 3 and ".experts." in name:  # [experts, out, in]
            gain = resid_gain if name.endswith("down_proj") else 1.0
            p.copy_(noise * (gain / math.sqrt(p.shape[2])))
        elif p.ndim == 1 and name.endswith("_proj.bias"):  # attention and MLP biases
            p.copy_(0.5 * noise)
        else:
            raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")


def make_model(spec: dict) -> torch.nn.Module:
    torch.manual_seed(spec["seed"])
    cfg = build_config(spec)
    model = spec["model_cls"](cfg)
    # A family with other parameters (Nemotron-H's Mamba2) brings its own scheme.
    spec.get("randomize", randomize_)(model, spec["seed"], spec["resid_gain"])
    model = model.to(torch.float32).eval()
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    gc = model.generation_config
    gc.bos_token_id = None
    gc.eos_token_id = None
    gc.pad_token_id = None
    gc.do_sample = False
    return model


# --------------------------------------------------------------------------------------------
# Reference computations
# --------------------------------------------------------------------------------------------


def draw_prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # ids in [1, VOCAB): 0 is the padding value of input_ids, keep it out of the prompts.
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def logits_alone(model, prompt: list[int]) -> np.ndarray:
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return out.logits[0].float().numpy()


@torch.no_grad()
def greedy_no_cache(model, prompt: list[int]) -> tuple[list[int], float]:
    """Greedy decoding by full recomputation; returns new tokens and the smallest top-2 gap."""
    seq = list(prompt)
    gaps = []
    for _ in range(NEW_TOKENS):
        last = logits_alone(model, seq)[-1].astype(np.float64)
        order = np.argsort(-last, kind="stable")
        gaps.append(last[order[0]] - last[order[1]])
        seq.append(int(order[0]))
    return seq[len(prompt) :], float(min(gaps))


@torch.no_grad()
def greedy_generate(model, prompt: list[int]) -> tuple[list[int], float]:
    """HF `generate` (greedy, KV cache) for one prompt alone; returns new tokens and min gap."""
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        return_dict_in_generate=True,
        output_logits=True,
    )
    new = out.sequences[0, len(prompt) :].tolist()
    assert len(new) == NEW_TOKENS, new
    gaps = []
    for step_logits in out.logits:
        top2 = torch.topk(step_logits[0].double(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    return new, min(gaps)


def choose_prompts(model, name: str, first_seed: int):
    """Draw prompts until greedy decoding has no near-tie (gap > MIN_GAP, ideally PREFERRED_GAP)."""
    best = None
    for attempt in range(MAX_PROMPT_TRIES):
        seed = first_seed + attempt
        prompts = draw_prompts(seed)
        gens, gaps = [], []
        for p in prompts:
            g1, gap1 = greedy_no_cache(model, p)
            g2, gap2 = greedy_generate(model, p)
            if g1 != g2:
                raise AssertionError(f"{name}: generate() {g2} != no-cache greedy {g1} for {p}")
            gens.append(g1)
            gaps.append(min(gap1, gap2))
        if any(len(set(g)) == 1 for g in gens):  # a constant continuation tests too little
            continue
        if best is None or min(gaps) > min(best[3]):
            best = (seed, prompts, gens, gaps)
        if min(gaps) >= PREFERRED_GAP:
            break
    if best is None or min(best[3]) <= MIN_GAP:
        raise AssertionError(f"{name}: no prompt seed gives a top-2 gap > {MIN_GAP}")
    seed, prompts, gens, gaps = best
    return seed, prompts, gens, gaps


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def save_npz_deterministic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like np.savez but with fixed zip timestamps, so that re-runs are byte-identical."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def rewrite_config_legacy(path: Path) -> None:
    """Rewrite config.json with top-level rope_theta + rope_scaling (the Llama-3.x hub form)."""
    cfg = json.loads(path.read_text())
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = rp
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_checkpoint(model, spec: dict, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    kwargs = {}
    if spec["shard_size"] is not None:
        kwargs["max_shard_size"] = spec["shard_size"]
    model.save_pretrained(out, **kwargs)  # transformers 5 always writes safetensors
    for f in out.iterdir():
        f.chmod(0o644)  # save_pretrained creates the .safetensors files with mode 0600
    if spec["legacy_config"]:
        rewrite_config_legacy(out / "config.json")


# --------------------------------------------------------------------------------------------
# Independent NumPy forward pass (float64), written from the formulas in the HF modeling code
# --------------------------------------------------------------------------------------------


def load_np_weights(ckpt: Path) -> dict[str, np.ndarray]:
    index = ckpt / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    w: dict[str, np.ndarray] = {}
    for f in files:
        w.update(load_safetensors_np(str(ckpt / f)))
    return w


def rope_inv_freq(cfg: dict, head_dim: int) -> np.ndarray:
    rp = cfg.get("rope_parameters") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta"))
    scaling = cfg.get("rope_scaling") or rp
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if rope_type == "default":
        return inv
    assert rope_type == "llama3", rope_type
    factor = scaling["factor"]
    lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(medium, smoothed, scaled)


def sliding_window_of(cfg: dict) -> int | None:
    """The attention window of every layer, or None: Mistral/Mixtral use `sliding_window` as is,
    the Qwen family only with `use_sliding_window` (none of the goldens enables it)."""
    if cfg["model_type"] in ("mistral", "mixtral"):
        return cfg.get("sliding_window")
    assert not cfg.get("use_sliding_window", False), cfg["model_type"]
    return None


def moe_prefix(cfg: dict, w: dict, layer: int) -> str | None:
    """The tensor-name prefix of layer `layer`'s sparse FFN, or None where the FFN is dense."""
    if cfg["model_type"] == "mixtral":
        return f"model.layers.{layer}.block_sparse_moe."
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    sparse = (
        experts > 0
        and layer not in cfg.get("mlp_only_layers", [])
        and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0
    )
    prefix = f"model.layers.{layer}.mlp."
    assert sparse == (prefix + "gate.weight" in w), (layer, sparse)
    return prefix if sparse else None


def swiglu(x, gate, up, down):
    g = x @ gate.T
    return ((g / (1 + np.exp(-g))) * (x @ up.T)) @ down.T


def numpy_moe(cfg: dict, w: dict, prefix: str, h: np.ndarray, routing: list | None):
    """The sparse FFN, one token at a time: softmax over all experts, top-k, renormalised for
    Mixtral and where `norm_topk_prob`, then the weighted sum of the chosen experts' SwiGLUs,
    plus Qwen2-MoE's shared expert scaled by sigmoid(shared_expert_gate(h))."""
    mixtral = cfg["model_type"] == "mixtral"
    top_k = cfg["num_experts_per_tok"]
    renormalise = mixtral or cfg.get("norm_topk_prob", False)
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    logits = h @ w[prefix + "gate.weight"].T  # [T, experts]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        order = np.argsort(-probs[t], kind="stable")
        chosen = order[:top_k]
        weights = probs[t, chosen]
        if renormalise:
            weights = weights / weights.sum()
        if routing is not None:  # (chosen experts, margin of the k-th over the (k+1)-th)
            margin = probs[t, order[top_k - 1]] - probs[t, order[top_k]]
            routing.append((tuple(int(e) for e in chosen), float(margin)))
        for e, weight in zip(chosen, weights, strict=True):
            ws = [w[f"{prefix}experts.{e}.{n}.weight"] for n in names]
            out[t] += weight * swiglu(h[t], *ws)
    if prefix + "shared_expert_gate.weight" in w:
        shared = swiglu(h, *(w[f"{prefix}shared_expert.{n}.weight"] for n in names))
        gate = h @ w[prefix + "shared_expert_gate.weight"].T  # [T, 1]
        out += shared / (1 + np.exp(-gate))
    return out


def numpy_forward(
    ckpt: Path, ids: list[int], routing: list | None = None, full_attention: bool = False
) -> np.ndarray:
    """Float64 logits [T, vocab] of one prompt; appends each sparse layer's routing of each token
    to `routing` when given. `full_attention` ignores the sliding window (to show it matters)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_np_weights(ckpt).items()}
    hs, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or hs // nh
    eps = cfg["rms_norm_eps"]

    def rms(x, g):
        return g * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    def rope(x, cos, sin):  # x [T, H, D]; rotate_half convention (first half / second half)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        rot = np.concatenate([-x2, x1], axis=-1)
        return x * cos[:, None, :] + rot * sin[:, None, :]

    def proj(h, name):  # nn.Linear, with its bias where the checkpoint has one
        y = h @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    T = len(ids)
    ang = np.arange(T, dtype=np.float64)[:, None] * rope_inv_freq(cfg, hd)[None, :]
    ang = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(ang), np.sin(ang)
    causal = np.tril(np.ones((T, T), dtype=bool))
    window = None if full_attention else sliding_window_of(cfg)
    if window is not None:  # row t sees t - window < s <= t
        causal &= np.arange(T)[:, None] - np.arange(T)[None, :] < window

    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = proj(h, p + "self_attn.q_proj").reshape(T, nh, hd)
        k = proj(h, p + "self_attn.k_proj").reshape(T, nkv, hd)
        v = proj(h, p + "self_attn.v_proj").reshape(T, nkv, hd)
        if p + "self_attn.q_norm.weight" in w:  # Qwen3: per-head RMSNorm over head_dim, pre-RoPE
            q = rms(q, w[p + "self_attn.q_norm.weight"])
            k = rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = nh // nkv  # query head j uses kv head j // rep
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        s = np.where(causal[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = np.einsum("hts,shd->thd", s, v).reshape(T, nh * hd)
        x = x + proj(a, p + "self_attn.o_proj")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        sparse = moe_prefix(cfg, w, i)
        if sparse is None:
            gate = proj(h, p + "mlp.gate_proj")
            hidden = gate / (1 + np.exp(-gate)) * proj(h, p + "mlp.up_proj")
            x = x + proj(hidden, p + "mlp.down_proj")
        else:
            x = x + numpy_moe(cfg, w, sparse, h, routing)
    x = rms(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def write_reference(name: str, spec: dict) -> tuple[dict, torch.nn.Module, torch.nn.Module]:
    """Builds checkpoint `name` from `spec`, saves it, and writes its prompts.json and
    reference.npz from the checkpoint as re-loaded from disk (eager attention), i.e. exactly what
    a user of the files gets. Returns the summary and the re-loaded float32 and bfloat16 models.
    """
    out = GOLDEN / name
    model = make_model(spec)
    write_checkpoint(model, spec, out)
    ref = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    )
    ref.eval()
    for (n1, p1), (n2, p2) in zip(
        sorted(model.state_dict().items()), sorted(ref.state_dict().items()), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2), (name, n1, n2)

    seed, prompts, gens, gaps = choose_prompts(ref, name, spec["prompt_seed"])

    input_ids = np.zeros((len(prompts), MAX_LEN), dtype=np.int32)
    lengths = np.array([len(p) for p in prompts], dtype=np.int32)
    logits = np.zeros((len(prompts), MAX_LEN, VOCAB), dtype=np.float32)
    for b, p in enumerate(prompts):
        input_ids[b, : len(p)] = p
        logits[b, : len(p)] = logits_alone(ref, p)
        # The in-memory model gives the same numbers up to fp32 kernel noise (not always bitwise:
        # e.g. for 1-token prompts the CPU GEMV path depends on the buffers' memory alignment).
        assert np.abs(logits[b, : len(p)] - logits_alone(model, p)).max() < 1e-5, name

    bf16 = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    logits_bf16 = np.zeros_like(logits)
    gens_bf16 = []
    for b, p in enumerate(prompts):
        logits_bf16[b, : len(p)] = logits_alone(bf16, p)
        gens_bf16.append(greedy_generate(bf16, p)[0])

    arrays = {
        "input_ids": input_ids,
        "lengths": lengths,
        "logits": logits,
        "logits_bf16": logits_bf16,
        "generated": np.array(gens, dtype=np.int32),
        "min_top2_gap": np.array(gaps, dtype=np.float32),
    }
    save_npz_deterministic(out / "reference.npz", arrays)
    (out / "prompts.json").write_text(json.dumps(prompts) + "\n")

    summary = {
        "name": name,
        "prompt_seed": seed,
        "min_gap": min(gaps),
        "max_abs_logit": float(np.abs(logits).max()),
        "bf16_max_err": float(np.abs(logits_bf16 - logits).max()),
        "bf16_greedy_same": gens_bf16 == gens,
    }
    return summary, ref, bf16


def make_one(name: str, spec: dict) -> dict:
    summary, ref, bf16 = write_reference(name, spec)
    return summary | {
        "inv_freq": ref.model.rotary_emb.inv_freq.tolist(),
        "bf16_inv_freq_dtype": str(bf16.model.rotary_emb.inv_freq.dtype),
    }


@torch.no_grad()
def reloaded(name: str) -> tuple[Path, np.lib.npyio.NpzFile, list[list[int]], torch.nn.Module]:
    """Fixture `name` read back as a user reads it: its directory, its reference.npz, its prompts
    and its float32 model with eager attention."""
    out = GOLDEN / name
    ref = np.load(out / "reference.npz")
    prompts = json.loads((out / "prompts.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return out, ref, prompts, model


@torch.no_grad()
def verify(name: str) -> dict:
    """Re-load from disk and compare everything against reference.npz."""
    out, ref, prompts, model = reloaded(name)
    assert next(model.parameters()).dtype == torch.float32
    max_np_err = 0.0
    routing: list = []  # over every prompt with its greedy continuation
    for b, p in enumerate(prompts):
        n = int(ref["lengths"][b])
        assert n == len(p) and ref["input_ids"][b, :n].tolist() == p
        assert not ref["input_ids"][b, n:].any() and not ref["logits"][b, n:].any()
        got = logits_alone(model, p)
        if not np.array_equal(got, ref["logits"][b, :n]):
            err = np.abs(got - ref["logits"][b, :n]).max()
            assert err <= 1e-6, (name, b, err)
        npf = numpy_forward(out, p)
        max_np_err = max(max_np_err, float(np.abs(npf - ref["logits"][b, :n]).max()))
        gen, _ = greedy_no_cache(model, p)
        assert gen == ref["generated"][b].tolist(), (name, b)
        numpy_forward(out, p + gen[:-1], routing)
    assert max_np_err < 1e-3, (name, max_np_err)
    window_effect = None
    if sliding_window_of(json.loads((out / "config.json").read_text())) is not None:
        longest = max(prompts, key=len)
        window_effect = float(
            np.abs(
                numpy_forward(out, longest, full_attention=True) - numpy_forward(out, longest)
            ).max()
        )
        assert window_effect > 1e-2, (name, window_effect)  # the window shapes the logits
    experts_used, router_margin = None, None
    if routing:
        experts = json.loads((out / "config.json").read_text())
        experts = experts.get("num_experts") or experts["num_local_experts"]
        used = {e for chosen, _ in routing for e in chosen}
        experts_used = f"{len(used)}/{experts}, {len(set(c for c, _ in routing))} distinct sets"
        router_margin = min(m for _, m in routing)
        # Every expert serves some token, and no token sits on a near-tie between its k-th and
        # (k+1)-th expert (a float32 reimplementation must choose the same experts).
        assert len(used) == experts, (name, sorted(used))
        assert router_margin > 1e-4, (name, router_margin)
    files = sorted(f for f in out.iterdir() if f.is_file())
    return {
        "name": name,
        "numpy_max_err": max_np_err,
        "files": {f.name: f.stat().st_size for f in files},
        "n_params": sum(p.numel() for p in model.parameters()),
        "experts_used": experts_used,
        "router_margin": router_margin,
        "window_effect": window_effect,
    }


@torch.no_grad()
def check_reloaded(
    name: str, model_cls: type, forward: Callable
) -> tuple[torch.nn.Module, list, float]:
    """Re-loads fixture `name` from disk (as `model_cls`) and checks it against its
    reference.npz: each prompt's logits (within 1e-6) and greedy tokens, and its NumPy forward
    `forward(directory, ids)` within 1e-3. Returns the model, the prompts and that largest
    NumPy error."""
    out, ref, prompts, model = reloaded(name)
    assert type(model) is model_cls, type(model)
    max_np_err = 0.0
    for b, p in enumerate(prompts):
        n = int(ref["lengths"][b])
        assert n == len(p) and ref["input_ids"][b, :n].tolist() == p
        got = logits_alone(model, p)
        assert np.abs(got - ref["logits"][b, :n]).max() <= 1e-6, name
        max_np_err = max(max_np_err, float(np.abs(forward(out, p) - got).max()))
        gen, _ = greedy_no_cache(model, p)
        assert gen == ref["generated"][b].tolist(), (name, b)
    assert max_np_err < 1e-3, (name, max_np_err)
    return model, prompts, max_np_err


def begin(models: dict[str, dict]) -> list[str]:
    """Sets torch deterministic on one CPU thread and quiets transformers; returns the fixture
    names the command line asks for (all of `models` by default)."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # CPU reductions in a fixed order
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}  transformers {transformers.__version__}")
    names = sys.argv[1:] or list(models)
    unknown = sorted(set(names) - models.keys())
    if unknown:
        raise SystemExit(f"unknown golden names {unknown}; choose among {sorted(models)}")
    return names


def summarize(name: str, made: dict, n_params: int, size: int, numpy_err: float) -> None:
    """Prints the lines every fixture reports: its size, logits, gaps, bf16 error and the
    NumPy forward's agreement (`write_reference`'s summary `made`)."""
    print(f"\n== {name}: {n_params} params, {size / 1e3:.1f} kB")
    print(
        f"   max|logit| {made['max_abs_logit']:.3f}   min top-2 gap {made['min_gap']:.4f}"
        f"   prompt seed {made['prompt_seed']}"
    )
    print(
        f"   bf16 max|dlogit| {made['bf16_max_err']:.4f}   bf16 greedy == fp32 greedy: "
        f"{made['bf16_greedy_same']}"
    )
    print(f"   numpy float64 re-implementation max|dlogit| {numpy_err:.2e}")


def main() -> int:
    names = begin(MODELS)
    made = [make_one(name, MODELS[name]) for name in names]
    checked = [verify(name) for name in names]
    total = 0
    for m, c in zip(made, checked, strict=True):
        size = sum(c["files"].values())
        total += size
        print(f"\n== {m['name']}: {c['n_params']} params, {size / 1e3:.1f} kB")
        for fname, sz in c["files"].items():
            print(f"   {fname:40s} {sz:>9d} B")
        print(
            f"   max|logit| {m['max_abs_logit']:.3f}   min top-2 gap {m['min_gap']:.4f}"
            f"   prompt seed {m['prompt_seed']}"
        )
        print(
            f"   bf16 max|dlogit| {m['bf16_max_err']:.4f}   bf16 greedy == fp32 greedy: "
            f"{m['bf16_greedy_same']}   bf16 inv_freq dtype {m['bf16_inv_freq_dtype']}"
        )
        print(f"   numpy float64 re-implementation max|dlogit| {c['numpy_max_err']:.2e}")
        if c["experts_used"] is not None:
            print(
                f"   experts used {c['experts_used']}; smallest k-th vs (k+1)-th router "
                f"probability gap {c['router_margin']:.2e}"
            )
        if c["window_effect"] is not None:
            print(f"   without the sliding window max|dlogit| {c['window_effect']:.3f}")
        print(f"   inv_freq {np.array(m['inv_freq'])}")
    all_files = [f for f in GOLDEN.rglob("*") if f.is_file()]
    golden_total = sum(f.stat().st_size for f in all_files)
    print(
        f"\ncheckpoints+references {total / 1e6:.3f} MB; tests/golden total "
        f"{golden_total / 1e6:.3f} MB in {len(all_files)} files"
    )
    assert golden_total < 11e6  # every fixture (make_golden_{norms,nemotron_h,longcat}.py too)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
