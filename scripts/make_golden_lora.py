"""Generate the multi-LoRA golden fixtures under ``tests/golden/lora/`` with PyTorch ``peft``.

For each of the tiny ``qwen3``, ``llama``, ``qwen3_moe``, ``gemma3``, ``olmo2``, ``exaone4``,
``mixtral``, ``qwen2_moe``, ``gpt_oss``, ``apertus`` and ``arcee`` checkpoints of
``tests/golden/`` (written by ``scripts/make_golden*.py``), two PEFT LoRA adapters, in
``tests/golden/lora/<name>/``:

* ``a1/`` and ``a2/``: ``adapter_config.json`` + ``adapter_model.safetensors`` as
  ``PeftModel.save_pretrained`` writes them. ``a1``: r 4, lora_alpha 8, every attention and MLP
  projection (the ungated MLPs of ``apertus`` and ``arcee`` have no gate). ``a2``: r 8,
  lora_alpha 4, rsLoRA (scaling alpha / sqrt(r)), on q, v, up and down only. On the models with
  experts (``MOE``, whose experts take no adapters) the attention's projections only.
  A and B are random (A ~ N(0, 1/in), B ~ N(0, 0.5^2 / r)), not PEFT's zero B, so each
  adapter moves the logits by about as much as the base model's own spread.
* ``prompts.json``: the golden prompts of the base checkpoint, each an object
  ``{"ids": [...], "adapter": "a1"}`` (``"adapter"`` left out for the base model): the
  command line's per-prompt form.
* ``reference.npz``: ``input_ids`` [4, 12] int32 (0-padded), ``lengths`` [4], ``adapters`` [4]
  int32 (1: a1, 2: a2, 0: none), ``logits`` [4, 12, 250] float32 (each prompt alone with its
  adapter, eager attention, zeros past each prompt's end), ``base_logits`` (the same without
  any adapter, to show the adapters move them), ``generated`` [4, 6] int32 (greedy, 6 new
  tokens) and ``min_top2_gap`` [4].

Both adapters are loaded back from the files into one ``PeftModel`` (``load_adapter``) before
any logits are computed, so the references are of the saved adapters.

Run (from the repository root; the torch venv with ``peft`` installed)::

    /work/main/.torchenv/bin/python scripts/make_golden_lora.py            # every model
    /work/main/.torchenv/bin/python scripts/make_golden_lora.py qwen3_moe  # some of them
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
OUT = GOLDEN / "lora"
NAMES = (
    "qwen3",
    "llama",
    "qwen3_moe",
    "gemma3",
    "olmo2",
    "exaone4",
    "mixtral",
    "qwen2_moe",
    "gpt_oss",
    "apertus",
    "arcee",
)
MOE = ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss")
UNGATED = ("apertus", "arcee")
ADAPTERS = ("a1", "a2")
NEW_TOKENS = 6
PROMPT_ADAPTERS = ("a1", "a2", None, "a1")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def adapter_config(name: str, adapter: str) -> LoraConfig:
    """a1: r 4, alpha 8 on every projection; a2: r 8, alpha 4, rsLoRA on q, v, up, down. On the
    MoE model (whose experts take no adapters) the attention's projections only."""
    moe = name in MOE
    if adapter == "a1":
        mlp = [m for m in MLP if m != "gate_proj"] if name in UNGATED else MLP
        targets = ATTENTION if moe else ATTENTION + mlp
        return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    targets = ["q_proj", "v_proj"] + ([] if moe else ["up_proj", "down_proj"])
    return LoraConfig(r=8, lora_alpha=4, use_rslora=True, lora_dropout=0.0, target_modules=targets)


def base_model(name: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        GOLDEN / name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def write_adapter(name: str, adapter: str, seed: int, directory: Path) -> None:
    """A random PEFT adapter over `name`'s base model, saved to `directory`."""
    model = get_peft_model(base_model(name), adapter_config(name, adapter))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in sorted(model.named_modules(), key=lambda item: item[0]):
            if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            a.copy_(torch.randn(a.shape, generator=generator) / a.shape[1] ** 0.5)
            b.copy_(torch.randn(b.shape, generator=generator) * 0.5 / b.shape[1] ** 0.5)
    # A path inside the repository, not this machine's; PEFT's model card is left out.
    model.peft_config["default"].base_model_name_or_path = f"tests/golden/{name}"
    model.save_pretrained(directory)
    (directory / "README.md").unlink()


def run(name: str) -> None:
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for index, adapter in enumerate(ADAPTERS):
        write_adapter(name, adapter, 1000 + 10 * NAMES.index(name) + index, out / adapter)
    model = PeftModel.from_pretrained(base_model(name), out / "a1", adapter_name="a1")
    model.load_adapter(out / "a2", adapter_name="a2")
    model.eval()
    prompts = json.loads((GOLDEN / name / "prompts.json").read_text())
    longest = max(map(len, prompts))
    ids = np.zeros((len(prompts), longest), np.int32)
    logits = np.zeros((len(prompts), longest, 250), np.float32)
    base = np.zeros_like(logits)
    generated = np.zeros((len(prompts), NEW_TOKENS), np.int32)
    gaps = np.zeros(len(prompts), np.float32)
    with torch.no_grad():
        for i, (prompt, adapter) in enumerate(zip(prompts, PROMPT_ADAPTERS, strict=True)):
            ids[i, : len(prompt)] = prompt
            tokens = torch.tensor([prompt])
            with model.disable_adapter():
                base[i, : len(prompt)] = model(tokens).logits[0].numpy()
            if adapter is None:
                context = model.disable_adapter()
            else:
                model.set_adapter(adapter)
                context = contextlib.nullcontext()
            with context:
                logits[i, : len(prompt)] = model(tokens).logits[0].numpy()
                sequence, gap = list(prompt), np.inf
                for step in range(NEW_TOKENS):
                    last = model(torch.tensor([sequence])).logits[0, -1].numpy()
                    top = np.sort(last)[-2:]
                    gap = min(gap, float(top[1] - top[0]))
                    sequence.append(int(np.argmax(last)))
                    generated[i, step] = sequence[-1]
                gaps[i] = gap
    moved = np.max(np.abs(logits - base)) / np.max(np.abs(base))
    print(f"{name}: adapters move the logits by {moved:.2f} of the largest; gaps {gaps}")
    assert moved > 0.2, "the adapters must move the logits"
    assert np.all(gaps > 1e-3), "greedy steps need a clear winner"
    (out / "prompts.json").write_text(
        json.dumps(
            [
                {"ids": p} if a is None else {"ids": p, "adapter": a}
                for p, a in zip(prompts, PROMPT_ADAPTERS, strict=True)
            ]
        )
        + "\n"
    )
    np.savez(
        out / "reference.npz",
        input_ids=ids,
        lengths=np.asarray(list(map(len, prompts)), np.int32),
        adapters=np.asarray([0 if a is None else int(a[1]) for a in PROMPT_ADAPTERS], np.int32),
        logits=logits,
        base_logits=base,
        generated=generated,
        min_top2_gap=gaps,
    )


if __name__ == "__main__":
    torch.manual_seed(0)
    for family in sys.argv[1:] or NAMES:
        run(family)
