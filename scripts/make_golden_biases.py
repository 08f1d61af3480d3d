"""Golden fixtures for attention and MLP biases: Llama and Arcee AFM with `mlp_bias` and
`attention_bias` set.

A sibling of ``make_golden.py`` with the same conventions and files (``config.json``,
``generation_config.json``, float32 ``model.safetensors``, ``prompts.json``, ``reference.npz``
with the same keys), for two tiny random checkpoints in ``tests/golden/<name>/``:

* ``llama_biased``: ``LlamaForCausalLM`` of the ``llama`` fixture's shape, with biases on q, k,
  v, o and the MLP's gate, up and down projections. Its ``reference.npz`` also holds
  ``logits_lora`` (float32 [4, 12, 250]): ``peft``'s logits with the LoRA adapters of
  ``tests/golden/lora/llama`` over it, prompt i through ``LORA_ADAPTERS[i]`` (None: the base).
* ``arcee_biased``: ``ArceeForCausalLM`` of the ``arcee`` fixture's shape with two layers, with
  biases on q, k, v, o and the ungated MLP's up and down projections.

Every bias is drawn N(0, 0.25) (``make_golden.randomize_``), every other parameter as in
``make_golden.py``. After writing, the script re-loads each checkpoint, checks the logits and
greedy tokens against ``reference.npz`` and the logits against the float64 NumPy forward pass of
the unbiased fixture's script (which adds a bias wherever the checkpoint has one), and checks
that each kind of bias changes the logits: the NumPy forward of a copy without the MLP's
biases, and of one without the attention's, each differ by more than 0.1.

Run (from the repository root; needs the CPU-torch venv, see tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_golden_biases.py [llama_biased arcee_biased]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as base  # noqa: E402
import make_golden_apertus_arcee as ungated  # noqa: E402

BIASES = {"attention_bias": True, "mlp_bias": True}
MODELS: dict[str, dict] = {
    "llama_biased": base.MODELS["llama"]
    | {
        "seed": 1041,
        "prompt_seed": 2041,
        "shard_size": None,
        "legacy_config": False,
        "config": base.MODELS["llama"]["config"] | BIASES,
    },
    "arcee_biased": ungated.MODELS["arcee"]
    | {
        "seed": 1042,
        "prompt_seed": 2042,
        "config": ungated.MODELS["arcee"]["config"] | BIASES | {"num_hidden_layers": 2},
    },
}
FORWARD = {"llama_biased": base.numpy_forward, "arcee_biased": ungated.numpy_forward}
LORA = base.GOLDEN / "lora" / "llama"
LORA_ADAPTERS = ("a1", "a2", None, "a1")
"""The adapter of each prompt in `logits_lora` (the tests ask for the same)."""


@torch.no_grad()
def add_lora_logits(name: str) -> float:
    """Adds `logits_lora` to `name`'s reference.npz; returns how far the adapters move the
    logits (relative to the largest)."""
    out = base.GOLDEN / name
    model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    )
    model = PeftModel.from_pretrained(model, LORA / "a1", adapter_name="a1")
    model.load_adapter(LORA / "a2", adapter_name="a2")
    model.eval()
    arrays = dict(np.load(out / "reference.npz"))
    prompts = json.loads((out / "prompts.json").read_text())
    logits = np.zeros_like(arrays["logits"])
    for i, (prompt, adapter) in enumerate(zip(prompts, LORA_ADAPTERS, strict=True)):
        tokens = torch.tensor([prompt])
        if adapter is None:
            with model.disable_adapter():
                logits[i, : len(prompt)] = model(tokens).logits[0].numpy()
        else:
            model.set_adapter(adapter)
            logits[i, : len(prompt)] = model(tokens).logits[0].numpy()
    base.save_npz_deterministic(out / "reference.npz", arrays | {"logits_lora": logits})
    moved = np.abs(logits - arrays["logits"]).max() / np.abs(arrays["logits"]).max()
    assert moved > 0.1, (name, moved)  # the adapters matter
    return float(moved)


def without(ckpt: Path, kind: str, into: Path) -> Path:
    """A copy of `ckpt` in `into` without its biases of `kind` ("mlp" or "self_attn")."""
    weights = base.load_np_weights(ckpt)
    kept = {k: v for k, v in weights.items() if not (f".{kind}." in k and k.endswith(".bias"))}
    assert len(kept) < len(weights), (ckpt, kind)
    into.mkdir()
    (into / "config.json").write_text((ckpt / "config.json").read_text())
    save_file(kept, str(into / "model.safetensors"))
    return into


@torch.no_grad()
def verify(name: str) -> dict:
    """Re-load from disk and compare everything against reference.npz and the NumPy forward;
    the max |logit| change without each kind of bias."""
    out = base.GOLDEN / name
    forward = FORWARD[name]
    model, prompts, max_np_err = base.check_reloaded(name, MODELS[name]["model_cls"], forward)
    longest = max(prompts, key=len)
    exact = forward(out, longest)
    effects = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("mlp", "self_attn"):
            copy = without(out, kind, Path(tmp) / kind)
            effects[f"no {kind} biases"] = float(np.abs(forward(copy, longest) - exact).max())
    assert min(effects.values()) > 1e-1, (name, effects)  # each kind of bias matters
    files = sorted(f for f in out.iterdir() if f.is_file())
    return {
        "numpy_max_err": max_np_err,
        "effects": effects,
        "size": sum(f.stat().st_size for f in files),
        "n_params": sum(p.numel() for p in model.parameters()),
    }


def main() -> int:
    for name in base.begin(MODELS):
        made, ref, _ = base.write_reference(name, MODELS[name])
        assert type(ref) is MODELS[name]["model_cls"], type(ref)
        if name == "llama_biased":
            print(f"   the LoRA adapters move the logits by {add_lora_logits(name):.2f}")
        checked = verify(name)
        base.summarize(name, made, checked["n_params"], checked["size"], checked["numpy_max_err"])
        print(f"   max|dlogit| without each kind of bias: {checked['effects']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
