"""Random small checkpoints of every family against transformers, on many layouts.

The golden fixtures pin one configuration per family; this sweep draws many (head and kv-head
counts, widths, layer kinds and patterns, RoPE scalings, biases, tied heads, expert counts and
top-k, q LoRA on or off, bf16 or float32 storage, prompts longer than a delta-rule chunk), writes
each as transformers saves it, and checks the project's logits and greedy tokens on the layouts
named. It runs in two environments, as the golden scripts do:

``make`` (the torch venv of ``tests/golden/README.md``) draws the config of each (family, seed)
from the seed alone, randomizes every weight (the golden scripts' randomizers), saves the checkpoint
and its references: each prompt's float32 logits alone, and 4 greedy tokens by recomputation
(transformers' cache raises on some Nemotron-H patterns) with their smallest top-2 gap::

    .torchenv/bin/python scripts/parity_sweep.py make --families gpt_oss kimi_linear --seeds 1 2

``check`` (the project's ``.venv``) loads each checkpoint on each layout with 8 simulated CPU
devices and prints one line per layout: ``ok``, ``BAD`` (logits past 1e-4 of the largest, a
non-zero row past a prompt's end, or a greedy token that differs where transformers' top-2 gap
is not a near-tie) or ``ERR`` (a refusal, which should name a configuration the project does not
build)::

    .venv/bin/python scripts/parity_sweep.py check /tmp/parity-sweep/*

A layout is ``DP.TP`` then any of ``.epN`` (experts over N ranks, gathered rows), ``.epNa``
(all-to-all), ``.s`` (input-scattered rows), ``.ppN`` (pipeline stages) and ``.scan``
(scanned layers), e.g. ``2.2.ep4a``; the default list is every family's, plus the expert
layouts for the MoE families. ``check`` exits 1 when a layout is ``BAD``; either command
exits 2 with one line for bad arguments, a folder that is not a sweep checkpoint (``make`` also
writes ``sweep.json``), an unwritable ``--out`` or an interrupt.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import random
import shutil
import sys
import time
import zlib
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
VOCAB = 200
NEW_TOKENS = 4
TOLERANCE = 1e-4
NEAR_TIE = 1e-3
"""A greedy step whose top-2 gap is below this share of the largest logit may pick either."""
LAYOUTS = ("1.1", "1.2", "1.4", "2.2", "1.4.s", "8.1", "1.8", "4.2", "1.2.pp2", "2.2.pp2")
MOE_LAYOUTS = ("1.4.ep4", "2.2.ep4a", "1.8.ep8a", "1.2.ep2a", "2.2.ep2", "4.2.ep8a")
DEFAULT_OUT = Path("/tmp/parity-sweep")
SWEEP_FILE = "sweep.json"
CHECK_FILES = ("config.json", "prompts.json", "reference.npz", SWEEP_FILE)


@dataclasses.dataclass(frozen=True)
class Draw:
    """One drawn configuration: transformers' config and model class names, the config's
    keys, the weights' scheme (`RANDOMIZERS`), and whether it has experts."""

    config_class: str
    model_class: str
    config: dict
    scheme: str = "generic"
    moe: bool = False


# --------------------------------------------------------------------------------------------
# The configurations
# --------------------------------------------------------------------------------------------

HEADS = ((2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8), (6, 2), (6, 3))


def _rope(r: random.Random, kinds: tuple[str, ...], theta: float = 10000.0) -> dict:
    kind = r.choice(kinds)
    rope = {"rope_type": kind, "rope_theta": theta}
    if kind in ("linear", "dynamic"):
        rope["factor"] = r.choice([2.0, 4.0])
    elif kind == "llama3":
        rope |= {
            "factor": r.choice([2.0, 8.0]),
            "original_max_position_embeddings": r.choice([8, 16, 64]),
            "low_freq_factor": 1.0,
            "high_freq_factor": r.choice([2.0, 4.0]),
        }
    elif kind == "yarn":
        rope |= {
            "factor": r.choice([2.0, 4.0, 32.0]),
            "original_max_position_embeddings": r.choice([16, 64, 4096]),
        }
        if r.random() < 0.5:
            rope["beta_fast"], rope["beta_slow"] = r.choice([(32.0, 1.0), (16.0, 2.0)])
        if r.random() < 0.5:
            rope["truncate"] = r.random() < 0.5
    return rope


ANY_ROPE = ("default", "linear", "dynamic", "llama3", "yarn")


def _dense(r: random.Random, heads=HEADS, head_dim: bool = True) -> dict:
    n, kv = r.choice(heads)
    config = {
        "vocab_size": VOCAB,
        "hidden_size": n * r.choice([8, 16]),
        "intermediate_size": r.choice([48, 96]),
        "num_hidden_layers": r.randint(1, 4),
        "num_attention_heads": n,
        "num_key_value_heads": kv,
        "tie_word_embeddings": r.random() < 0.3,
        "max_position_embeddings": 256,
    }
    return config | ({"head_dim": r.choice([8, 16])} if head_dim else {})


def _kinds(r: random.Random, layers: int, kinds: tuple[str, str]) -> list[str]:
    return [r.choice(kinds) for _ in range(layers)]


def _sparse_layers(r: random.Random, layers: int) -> list[int]:
    return sorted(r.sample(range(layers), r.randint(0, layers // 2)))


def llama(r):
    config = _dense(r) | {"rope_parameters": _rope(r, ANY_ROPE)}
    config |= {"attention_bias": r.random() < 0.3, "mlp_bias": r.random() < 0.3}
    return Draw("LlamaConfig", "LlamaForCausalLM", config)


def mistral(r):
    config = _dense(r) | {"sliding_window": r.choice([None, 3, 6, 4096])}
    return Draw("MistralConfig", "MistralForCausalLM", config)


def qwen2(r):
    config = _dense(r, head_dim=False) | {"rope_parameters": _rope(r, ANY_ROPE)}
    slide = r.random() < 0.4
    config |= {
        "use_sliding_window": slide,
        "sliding_window": r.choice([3, 5]) if slide else None,
        "max_window_layers": r.randint(0, config["num_hidden_layers"]),
    }
    return Draw("Qwen2Config", "Qwen2ForCausalLM", config)


def qwen3(r):
    config = _dense(r) | {"rope_parameters": _rope(r, ANY_ROPE), "attention_bias": r.random() < 0.3}
    return Draw("Qwen3Config", "Qwen3ForCausalLM", config)


def _experts(r: random.Random, layers: int) -> dict:
    return {
        "num_experts": r.choice([4, 8, 16]),
        "num_experts_per_tok": r.choice([1, 2, 4]),
        "moe_intermediate_size": r.choice([16, 32]),
        "norm_topk_prob": r.random() < 0.6,
        "decoder_sparse_step": r.choice([1, 1, 2]),
        "mlp_only_layers": _sparse_layers(r, layers),
    }


def qwen3_moe(r):
    config = _dense(r) | {"rope_parameters": _rope(r, ANY_ROPE)}
    config |= _experts(r, config["num_hidden_layers"])
    return Draw("Qwen3MoeConfig", "Qwen3MoeForCausalLM", config, moe=True)


def qwen2_moe(r):
    config = _dense(r, head_dim=False)
    config |= _experts(r, config["num_hidden_layers"])
    config["shared_expert_intermediate_size"] = r.choice([16, 48])
    return Draw("Qwen2MoeConfig", "Qwen2MoeForCausalLM", config, moe=True)


def mixtral(r):
    config = _dense(r) | {
        "num_local_experts": r.choice([4, 8]),
        "num_experts_per_tok": r.choice([1, 2]),
        "sliding_window": r.choice([None, 4]),
    }
    return Draw("MixtralConfig", "MixtralForCausalLM", config, moe=True)


def gemma3(r):
    config = _dense(r)
    config |= {
        "query_pre_attn_scalar": r.choice([8, 16, 24]),
        "sliding_window": r.choice([3, 6]),
        "layer_types": _kinds(
            r, config["num_hidden_layers"], ("sliding_attention", "full_attention")
        ),
        "final_logit_softcapping": None,
    }
    return Draw("Gemma3TextConfig", "Gemma3ForCausalLM", config)


def olmo2(r):
    config = _dense(r, head_dim=False) | {"rope_parameters": _rope(r, ANY_ROPE)}
    return Draw("Olmo2Config", "Olmo2ForCausalLM", config)


def exaone4(r):
    config = _dense(r) | {"rope_parameters": _rope(r, ANY_ROPE)}
    slide = r.random() < 0.6
    kinds = ("sliding_attention", "full_attention") if slide else ("full_attention",) * 2
    config |= {
        "sliding_window": r.choice([3, 5]) if slide else None,
        "layer_types": _kinds(r, config["num_hidden_layers"], kinds),
    }
    return Draw("Exaone4Config", "Exaone4ForCausalLM", config)


def apertus(r):
    config = _dense(r) | {"rope_parameters": _rope(r, ("default", "llama3"))}
    return Draw("ApertusConfig", "ApertusForCausalLM", config, "apertus")


def arcee(r):
    config = _dense(r) | {"rope_parameters": _rope(r, ("default", "yarn"))}
    config |= {"attention_bias": r.random() < 0.4, "mlp_bias": r.random() < 0.4}
    return Draw("ArceeConfig", "ArceeForCausalLM", config)


def gpt_oss(r):
    n, kv = r.choice(((4, 1), (4, 2), (8, 2), (8, 4), (8, 8), (16, 4)))
    layers = r.randint(1, 4)
    config = {
        "vocab_size": VOCAB,
        "hidden_size": r.choice([32, 64]),
        "intermediate_size": r.choice([16, 32, 48]),
        "num_hidden_layers": layers,
        "num_attention_heads": n,
        "num_key_value_heads": kv,
        "head_dim": r.choice([8, 16]),
        "layer_types": _kinds(r, layers, ("sliding_attention", "full_attention")),
        "sliding_window": r.choice([2, 3, 5, 8]),
        "num_local_experts": r.choice([4, 8, 16]),
        "num_experts_per_tok": r.choice([1, 2, 4]),
        "swiglu_limit": r.choice([0.7, 1.25, 7.0]),
        "rope_parameters": _rope(r, ("yarn",), 150000.0),
        "tie_word_embeddings": r.random() < 0.2,
        "max_position_embeddings": 256,
    }
    return Draw("GptOssConfig", "GptOssForCausalLM", config, "gpt_oss", moe=True)


def _gated_deltanet(r: random.Random) -> dict:
    layers = r.randint(2, 5)
    n, kv = r.choice(((2, 1), (4, 2), (4, 1), (8, 2), (4, 4)))
    key_heads = r.choice([1, 2, 4])
    return {
        "vocab_size": VOCAB,
        "hidden_size": r.choice([32, 64]),
        "num_hidden_layers": layers,
        "layer_types": _kinds(r, layers, ("linear_attention", "full_attention")),
        "num_attention_heads": n,
        "num_key_value_heads": kv,
        "head_dim": r.choice([8, 16, 32]),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": r.choice([0.25, 0.5, 1.0]),
        },
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": key_heads * r.choice([1, 2, 4]),
        "linear_key_head_dim": r.choice([8, 16]),
        "linear_value_head_dim": r.choice([8, 16]),
        "linear_conv_kernel_dim": r.choice([2, 3, 4]),
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "tie_word_embeddings": r.random() < 0.3,
    }


def _gated_deltanet_experts(r: random.Random) -> dict:
    return {
        "num_experts": r.choice([4, 8, 16]),
        "num_experts_per_tok": r.choice([1, 2, 4]),
        "moe_intermediate_size": r.choice([16, 32]),
        "shared_expert_intermediate_size": r.choice([16, 48]),
    }


def qwen3_next(r):
    config = _gated_deltanet(r) | _gated_deltanet_experts(r)
    config |= {
        "intermediate_size": r.choice([48, 96]),
        "norm_topk_prob": r.random() < 0.7,
        "decoder_sparse_step": r.choice([1, 1, 2]),
        "mlp_only_layers": _sparse_layers(r, config["num_hidden_layers"]),
    }
    return Draw("Qwen3NextConfig", "Qwen3NextForCausalLM", config, "gated_deltanet", moe=True)


def qwen3_5(r):
    config = _gated_deltanet(r) | {"intermediate_size": r.choice([48, 96])}
    return Draw("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", config, "gated_deltanet")


def qwen3_5_moe(r):
    config = _gated_deltanet(r) | _gated_deltanet_experts(r)
    return Draw("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", config, "gated_deltanet", moe=True)


def kimi_linear(r):
    layers = r.randint(2, 5)
    heads = r.choice([2, 4, 8])
    dense = r.randint(0, 2)
    config = {
        "vocab_size": VOCAB,
        "hidden_size": r.choice([32, 64]),
        "intermediate_size": r.choice([48, 96]),
        "num_hidden_layers": layers,
        "layer_types": _kinds(r, layers, ("linear_attention", "full_attention")),
        "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(layers)],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": r.choice([None, 16, 32]),
        "kv_lora_rank": r.choice([16, 32]),
        "qk_nope_head_dim": r.choice([8, 16]),
        "qk_rope_head_dim": r.choice([4, 8]),
        "v_head_dim": r.choice([8, 16]),
        "linear_num_heads": r.choice([2, 4, 8]),
        "linear_head_dim": r.choice([8, 16]),
        "linear_conv_kernel_dim": r.choice([2, 4]),
        "num_local_experts": r.choice([4, 8, 16]),
        "num_experts_per_tok": r.choice([1, 2, 4]),
        "moe_intermediate_size": r.choice([16, 32]),
        "n_shared_experts": r.choice([0, 1, 2]),
        "routed_scaling_factor": r.choice([1.0, 2.5]),
        "norm_topk_prob": r.random() < 0.7,
        "max_position_embeddings": 512,
        "tie_word_embeddings": r.random() < 0.3,  # transformers never ties Kimi-Linear's head
    }
    return Draw("KimiLinearConfig", "KimiLinearForCausalLM", config, "kimi_linear", moe=True)


def deepseek_v3(r):
    groups = r.choice([1, 2, 4])
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    heads = r.choice([2, 4, 8])
    per_group, kept = r.choice([2, 4]), r.randint(1, groups)
    top_k = r.choice([k for k in (1, 2, 4) if k <= kept * per_group])  # as released configs
    config = {
        "vocab_size": VOCAB,
        "hidden_size": r.choice([32, 64]),
        "intermediate_size": r.choice([48, 96]),
        "num_hidden_layers": r.randint(2, 4),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": r.choice([None, 16]),
        "kv_lora_rank": r.choice([16, 32]),
        "qk_nope_head_dim": r.choice([8, 16]),
        "qk_rope_head_dim": r.choice([4, 8]),
        "v_head_dim": r.choice([8, 16]),
        "n_routed_experts": groups * per_group,
        "num_experts_per_tok": top_k,
        "n_group": groups,
        "topk_group": kept,
        "moe_intermediate_size": r.choice([16, 32]),
        "n_shared_experts": r.choice([1, 2]),
        "first_k_dense_replace": r.randint(0, 2),
        "routed_scaling_factor": r.choice([1.0, 2.5]),
        "norm_topk_prob": r.random() < 0.7,
        "rope_parameters": r.choice([{"rope_type": "default", "rope_theta": 10000.0}, yarn]),
        "max_position_embeddings": 256,
        "tie_word_embeddings": r.random() < 0.2,
    }
    return Draw("DeepseekV3Config", "DeepseekV3ForCausalLM", config, moe=True)


def nemotron_h(r):
    layers = r.randint(2, 5)
    moe = r.random() < 0.7
    pattern = "".join(r.choice("M*-E" if moe else "M*-") for _ in range(layers))
    if moe and "E" not in pattern:
        at = r.randrange(layers)
        pattern = pattern[:at] + "E" + pattern[at + 1 :]
    n, kv = r.choice(((4, 1), (4, 2), (8, 2), (8, 4)))
    config = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_attention_heads": n,
        "num_key_value_heads": kv,
        "head_dim": r.choice([8, 16]),
        "intermediate_size": r.choice([32, 48]),
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "hybrid_override_pattern": pattern,
        "mamba_num_heads": r.choice([4, 8]),
        "mamba_head_dim": r.choice([4, 8]),
        "n_groups": r.choice([1, 2]),
        "ssm_state_size": r.choice([4, 8]),
        "conv_kernel": r.choice([2, 4]),
        "chunk_size": r.choice([4, 5, 16]),
        "time_step_min": 1e-3,
        "use_conv_bias": r.random() < 0.5,
    }
    if moe:
        groups = r.choice([1, 2, 4])
        config |= {
            "n_routed_experts": 4 * groups,
            "num_experts_per_tok": r.choice([1, 2, 3]),
            "moe_intermediate_size": r.choice([8, 16]),
            "moe_shared_expert_intermediate_size": r.choice([16, 32]),
            "n_group": groups,
            "topk_group": r.randint(1, groups),
            "norm_topk_prob": r.random() < 0.7,
            "routed_scaling_factor": r.choice([1.0, 2.5]),
        }
    return Draw("NemotronHConfig", "NemotronHForCausalLM", config, "nemotron_h", moe=moe)


FAMILIES = {
    draw.__name__: draw
    for draw in (
        llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral, gemma3, olmo2, exaone4,
        apertus, arcee, gpt_oss, qwen3_next, qwen3_5, qwen3_5_moe, kimi_linear, deepseek_v3,
        nemotron_h,
    )
}  # fmt: skip


def draw(family: str, seed: int) -> tuple[Draw, random.Random]:
    """The configuration of (family, seed), and the generator that then draws its prompts."""
    r = random.Random(seed * 100_003 + zlib.crc32(family.encode()))
    return FAMILIES[family](r), r


# --------------------------------------------------------------------------------------------
# make: the checkpoint and transformers' references (torch)
# --------------------------------------------------------------------------------------------


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RANDOMIZERS = {
    "generic": ("make_golden", "randomize_"),
    "gated_deltanet": ("make_golden_qwen3_next", "randomize_qwen3_next_"),
    "kimi_linear": ("make_golden_kimi_linear", "randomize_kimi_linear_"),
    "apertus": ("make_golden_apertus_arcee", "randomize_apertus_"),
    "gpt_oss": ("make_golden_gpt_oss", "randomize"),
    "nemotron_h": ("make_golden_nemotron_h", "randomize_nemotron_"),
}
"""Each weight scheme's golden script and function: every parameter random, so a wrong layout
or sum shows."""


def randomize(model, seed: int, scheme: str) -> None:
    """Overwrites every parameter of `model` by the golden scripts' `scheme`."""
    module, function = RANDOMIZERS[scheme]
    getattr(_script(module), function)(model, seed)


def make(family: str, seed: int, out: Path) -> dict:
    """Writes the checkpoint of (family, seed) to `out` (bf16 for even seeds) with
    `prompts.json`, `reference.npz` and `sweep.json` (its family, seed and whether it has
    experts); returns the drawn config. The files are written beside `out` and moved there
    whole, so an interrupted run leaves no half-written checkpoint."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        made = _write(family, seed, partial)
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return made


def _write(family: str, seed: int, out: Path) -> dict:
    import torch
    import transformers

    torch.set_num_threads(1)
    drawn, r = draw(family, seed)
    config_class = getattr(transformers, drawn.config_class)
    config = config_class(**drawn.config, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, drawn.model_class)(config)
    randomize(model, seed, drawn.scheme)
    bf16 = seed % 2 == 0
    model = (model.to(torch.bfloat16) if bf16 else model.float()).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # The references: float32 from the stored (maybe bf16) weights, read back as a user would
    # (a float cast in place would keep RoPE's inverse frequencies rounded to bf16).
    model = getattr(transformers, drawn.model_class).from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    )
    lengths = [r.randint(1, 12), r.choice([20, 70, 130]), r.randint(1, 30), r.randint(5, 20)]
    prompts = [[r.randrange(1, VOCAB) for _ in range(n)] for n in lengths]
    logits = np.zeros((len(prompts), max(lengths), VOCAB), np.float32)
    generated, gaps = [], []
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            tokens, gap = list(prompt), math.inf
            for step in range(NEW_TOKENS + 1):
                out_logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
                if step == 0:
                    logits[index, : len(prompt)] = out_logits.numpy()
                if step == NEW_TOKENS:
                    break
                top = torch.topk(out_logits[-1].double(), 2)
                gap = min(gap, float(top.values[0] - top.values[1]))
                tokens.append(int(top.indices[0]))
            generated.append(tokens[len(prompt) :])
            gaps.append(gap)
    (out / "prompts.json").write_text(json.dumps(prompts))
    np.savez(
        out / "reference.npz",
        logits=logits,
        generated=np.array(generated, np.int32),
        gaps=np.array(gaps),
        lengths=np.array(lengths),
    )
    made = {"family": family, "seed": seed, "bf16": bf16, "moe": drawn.moe}
    (out / SWEEP_FILE).write_text(json.dumps(made))
    return made | drawn.config


# --------------------------------------------------------------------------------------------
# check: the project on each layout (JAX)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and its options, as `DP.TP[.epN[a]][.s][.ppN][.scan]` names them."""

    text: str
    dp: int
    tp: int
    ep: int = 1
    all_to_all: bool = False
    scattered: bool = False
    pp: int = 1
    scan: bool = False
    experts: bool = False

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Raises ValueError for text not in the form above (argparse's type)."""
        pieces, fields = text.split("."), {}
        try:
            fields.update(dp=int(pieces[0]), tp=int(pieces[1]))
            for part in pieces[2:]:
                if part.startswith("ep"):
                    fields.update(ep=int(part[2:].removesuffix("a")), experts=True)
                    fields["all_to_all"] = part.endswith("a")
                elif part.startswith("pp"):
                    fields["pp"] = int(part[2:])
                elif part in ("s", "scan"):
                    fields["scattered" if part == "s" else "scan"] = True
                else:
                    raise ValueError(part)
        except (ValueError, IndexError):
            raise ValueError(f"not a layout (DP.TP[.epN[a]][.s][.ppN][.scan]): {text!r}") from None
        if min(fields["dp"], fields["tp"], fields.get("ep", 1), fields.get("pp", 1)) < 1:
            raise ValueError(f"a layout's sizes are >= 1: {text!r}")
        return cls(text, **fields)


def runner(checkpoint: Path, layout: Layout):
    """The project's runner of `checkpoint` on `layout`."""
    import boundary_jax as bj
    from models.build import load_model
    from models.options import BuildOptions
    from models.pipeline import PipelineCausalLM, load_pipeline
    from models.serving.runtime import ShardedCausalLM

    topology = bj.Topology(pp=layout.pp, attn_dp=layout.dp, attn_tp=layout.tp, moe_ep=layout.ep)
    mesh = bj.make_mesh(topology)
    dispatch = bj.MoeDispatch.ALL_TO_ALL if layout.all_to_all else bj.MoeDispatch.GATHER
    options = BuildOptions(
        moe_dispatch=dispatch if layout.experts else None, scan_layers=layout.scan
    )
    if layout.pp > 1:
        stages = load_pipeline(checkpoint, mesh, options, moe_ep=layout.ep)
        return PipelineCausalLM(stages, mesh, microbatches=2)
    model = load_model(checkpoint, mesh, options, moe_ep=layout.ep)
    return ShardedCausalLM(model, mesh, input_scattered=layout.scattered)


def check(checkpoint: Path, layouts: tuple[Layout, ...]) -> int:
    """Prints one line per layout; returns how many were BAD."""
    prompts = json.loads((checkpoint / "prompts.json").read_text())
    reference = np.load(checkpoint / "reference.npz")
    want, lengths = reference["logits"], reference["lengths"]
    largest = float(np.max(np.abs(want)))
    ties = reference["gaps"] < NEAR_TIE * largest
    bad = 0
    for layout in layouts:
        start = time.time()
        try:
            run = runner(checkpoint, layout)
            got = run.forward(prompts)
            tokens = np.asarray(run.generate(prompts, NEW_TOKENS))
        except (ValueError, NotImplementedError) as error:
            print(f"{checkpoint.name} {layout.text}: ERR {str(error).splitlines()[0][:240]}")
            continue
        error = float(np.max(np.abs(got - want))) / largest
        tail = any(np.any(got[i, n:]) for i, n in enumerate(lengths))
        same = np.all((tokens == reference["generated"]) | ties[:, None])
        ok = error <= TOLERANCE and same and not tail
        bad += not ok
        detail = f"error {error:.1e}" + ("" if same else f", tokens {tokens.tolist()}")
        detail += ", rows past an end" if tail else ""
        seconds = time.time() - start
        verdict = "ok" if ok else "BAD"
        print(f"{checkpoint.name} {layout.text}: {verdict} {detail} ({seconds:.0f} s)")
    return bad


def _layout_argument(text: str) -> Layout:
    try:
        return Layout.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main() -> int:
    """Exit 0 (all ok), 1 (a layout BAD) or 2 (bad arguments, files or an interrupt), the last
    two with one line saying why."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("make", help="draw and write checkpoints (torch environment)")
    made.add_argument("--families", nargs="+", default=sorted(FAMILIES), choices=sorted(FAMILIES))
    made.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    made.add_argument("--out", type=Path, default=DEFAULT_OUT)
    checked = commands.add_parser("check", help="load and compare (the project's environment)")
    checked.add_argument("checkpoints", nargs="+", type=Path)
    checked.add_argument(
        "--layouts",
        nargs="+",
        type=_layout_argument,
        default=None,
        help="default: module docstring",
    )
    args = parser.parse_args()
    try:
        if args.command == "make":
            try:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / ".written").touch()
                (args.out / ".written").unlink()
            except OSError as error:
                parser.error(f"--out {args.out} is not a writable folder: {error.strerror}")
            for family in args.families:
                for seed in args.seeds:
                    print(json.dumps(make(family, seed, args.out / f"{family}-{seed}")))
            return 0
        sweeps = {}
        for checkpoint in args.checkpoints:
            missing = [name for name in CHECK_FILES if not (checkpoint / name).is_file()]
            if missing:
                parser.error(f"{checkpoint} is not a sweep checkpoint: no {', '.join(missing)}")
            sweeps[checkpoint] = json.loads((checkpoint / SWEEP_FILE).read_text())
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
        bad = 0
        for checkpoint, sweep in sweeps.items():
            layouts = LAYOUTS + MOE_LAYOUTS * sweep["moe"]
            bad += check(checkpoint, tuple(args.layouts or map(Layout.parse, layouts)))
        return 1 if bad else 0
    except KeyboardInterrupt:
        print("parity_sweep: interrupted", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
