"""Generate ``tests/golden/lora_train/``: a LoRA adapter trained by PyTorch ``peft`` for three
optimizer steps over the tiny ``qwen3`` checkpoint, the reference for ``train --train-lora``.

* ``start/``: the adapter both sides start from, as PEFT starts one (B zero) but with A drawn
  here (uniform in +-1/sqrt(in), PEFT's kaiming-uniform bound, from a fixed seed): r 4,
  lora_alpha 16 (scaling 4, so a trainer that steps B with the scaling folded in takes other
  steps), every attention and MLP projection.
* ``trained/``: the adapter after three steps, each over the four sequences of
  ``reference.json`` packed into one batch: the mean next-token cross-entropy over every
  predicted token, global-norm clipping of the adapter's gradients, then ``torch.optim.AdamW``
  at ``TrainConfig``'s warmup + cosine learning rate of that step (optax's adamw: decoupled
  weight decay times the learning rate, as torch's).
* ``reference.json``: the sequences, the ``--train-lora`` spec, the ``TrainConfig`` fields, and
  each step's loss and gradient norm (before clipping).

Run (from the repository root; the torch venv with ``peft`` installed)::

    /work/main/.torchenv/bin/python scripts/make_golden_lora_train.py
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

GOLDEN = Path(__file__).parents[1] / "tests" / "golden"
OUT = GOLDEN / "lora_train"
SEQUENCES = [[5, 7, 9, 11, 2, 30, 4], [3, 8, 1], [8, 8, 1, 4, 6, 2, 9, 40, 41], [17, 4, 99, 12]]
RANK, ALPHA = 4, 16.0
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
CONFIG = dict(learning_rate=1e-2, total_steps=4, warmup_steps=0, final_fraction=0.1)
DEFAULTS = dict(weight_decay=0.01, clip_norm=1.0, b1=0.9, b2=0.95, eps=1e-8)  # TrainConfig's
STEPS = 3


def base() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        GOLDEN / "qwen3", dtype=torch.float32, attn_implementation="eager"
    )


def save(model: PeftModel, directory: Path) -> None:
    model.save_pretrained(directory)
    (directory / "README.md").unlink()  # PEFT's model card


def learning_rate(step: int) -> float:
    """optax.warmup_cosine_decay_schedule as TrainConfig.schedule sets it."""
    peak, warmup = CONFIG["learning_rate"], CONFIG["warmup_steps"]
    total, end = CONFIG["total_steps"], CONFIG["learning_rate"] * CONFIG["final_fraction"]
    if step < warmup:
        return peak * step / warmup
    done = min(step - warmup, total - warmup) / (total - warmup)
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * done))


def write_start() -> None:
    settings = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        target_modules=[f"{t}_proj" for t in TARGETS],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base(), settings)
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if "lora_A" in name:
                bound = parameter.shape[1] ** -0.5
                drawn = rng.uniform(-bound, bound, tuple(parameter.shape))
                parameter.copy_(torch.from_numpy(drawn.astype(np.float32)))
            elif "lora_B" in name:
                parameter.zero_()
    save(model, OUT / "start")


def train() -> dict:
    model = PeftModel.from_pretrained(base(), OUT / "start", is_trainable=True).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=0.0,
        betas=(DEFAULTS["b1"], DEFAULTS["b2"]),
        eps=DEFAULTS["eps"],
        weight_decay=DEFAULTS["weight_decay"],
    )
    count = sum(len(s) - 1 for s in SEQUENCES)
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        total = 0.0
        for sequence in SEQUENCES:
            ids = torch.tensor([sequence])
            logits = model(input_ids=ids).logits[0]
            total = total + torch.nn.functional.cross_entropy(
                logits[:-1], ids[0, 1:], reduction="sum"
            )
        loss = total / count
        loss.backward()
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
        if norm > DEFAULTS["clip_norm"]:
            for p in params:
                p.grad.mul_(DEFAULTS["clip_norm"] / norm)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        optimizer.step()
        losses.append(float(loss))
        norms.append(norm)
    save(model, OUT / "trained")
    return {"losses": losses, "grad_norms": norms}


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    torch.manual_seed(0)
    write_start()
    trained = train()
    reference = {
        "sequences": SEQUENCES,
        "train_lora": f"r={RANK},alpha={ALPHA:g},targets={','.join(TARGETS)}",
        "config": CONFIG,
        **trained,
    }
    (OUT / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(json.dumps(trained))


if __name__ == "__main__":
    main()
