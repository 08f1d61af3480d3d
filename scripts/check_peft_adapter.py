"""Check that `peft` loads an adapter boundary-jax wrote (`train --train-lora`,
`models.weights.peft.write_peft_adapter`) with the logits boundary-jax computed through it.

Run with the torch venv (peft installed), after saving the boundary-jax logits of the prompts
through the adapter (float32 [prompts, longest, vocab], zero past each end) as a .npy::

    /work/main/.torchenv/bin/python scripts/check_peft_adapter.py \\
        --base tests/golden/llama --adapter ADAPTER_DIR \\
        --prompts tests/golden/llama/prompts.json --logits LOGITS.npy

Prints the largest difference relative to the largest logit, and how far the adapter moves the
logits from the base model's; exits 1 if the difference is above 1e-4.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the base checkpoint directory")
    parser.add_argument("--adapter", required=True, help="the PEFT adapter folder")
    parser.add_argument("--prompts", required=True, help="a JSON list of token-id lists")
    parser.add_argument("--logits", required=True, help="boundary-jax's logits (.npy)")
    args = parser.parse_args()
    base = AutoModelForCausalLM.from_pretrained(
        args.base, dtype=torch.float32, attn_implementation="eager"
    )
    model = PeftModel.from_pretrained(base, args.adapter).eval()
    prompts = json.loads(Path(args.prompts).read_text())
    want = np.load(args.logits)
    error = moved = 0.0
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            tokens = torch.tensor([prompt])
            got = model(tokens).logits[0].numpy()
            error = max(error, float(np.abs(got - want[index, : len(prompt)]).max()))
            with model.disable_adapter():
                plain = model(tokens).logits[0].numpy()
            moved = max(moved, float(np.abs(plain - got).max()))
    scale = float(np.abs(want).max())
    print(
        f"peft vs boundary-jax: {error / scale:.2e} of the largest logit; adapter moves {moved:.3f}"
    )
    return 0 if error <= 1e-4 * scale else 1


if __name__ == "__main__":
    sys.exit(main())
