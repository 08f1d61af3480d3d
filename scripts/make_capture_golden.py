"""Golden auxiliary hidden states: ``output_hidden_states`` of the existing golden checkpoints.

For each named fixture (default: ``qwen3``, ``llama``, ``mistral``) this loads
``tests/golden/<name>/`` with ``AutoModelForCausalLM.from_pretrained`` (float32, eager
attention, CPU), runs each prompt of its ``prompts.json`` alone (batch 1, positions 0..len-1) with
``output_hidden_states=True`` and writes ``tests/golden/<name>/hidden_states.npz``:

* ``hidden_states``: float32 [layers + 1, prompts, longest, hidden], zero past each prompt's end.
  Entry ``i < layers`` is transformers' ``output_hidden_states[i]``: the residual stream entering
  decoder layer ``i`` (entry 0 is the embedding output). Entry ``layers`` is the residual the
  final norm reads (the last layer's output, before the norm); transformers' last entry is that
  residual after the final norm, stored as ``final_normed``.
* ``final_normed``: float32 [prompts, longest, hidden], transformers' ``output_hidden_states[-1]``.
* ``lengths``: int32 [prompts].

The residual entering the final norm is recorded with a forward pre-hook on ``model.model.norm``.
The script checks that the norm of that residual equals transformers' last hidden state.

Run (from the repository root, with the Python 3.11 CPU-torch venv of tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_capture_golden.py [name ...]
"""

from __future__ import annotations

import io
import json
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden"
DEFAULT = ("qwen3", "llama", "mistral")


def hidden_states(name: str) -> dict[str, np.ndarray]:
    """The capture reference arrays of fixture `name`."""
    directory = GOLDEN / name
    prompts = json.loads((directory / "prompts.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    config = model.config
    # LongCat-Flash's num_hidden_layers counts its two attentions per layer; its layers are
    # num_layers (one hidden state each).
    longcat = config.model_type == "longcat_flash"
    layers = config.num_layers if longcat else config.num_hidden_layers
    hidden = config.hidden_size
    longest = max(len(p) for p in prompts)
    states = np.zeros((layers + 1, len(prompts), longest, hidden), np.float32)
    normed = np.zeros((len(prompts), longest, hidden), np.float32)
    entering_norm = []
    hook = model.model.norm.register_forward_pre_hook(
        lambda module, args: entering_norm.append(args[0].detach().clone())
    )
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            entering_norm.clear()
            ids = torch.tensor([prompt], dtype=torch.long)
            out = model(ids, output_hidden_states=True, use_cache=False)
            assert len(out.hidden_states) == layers + 1, len(out.hidden_states)
            length = len(prompt)
            for layer in range(layers):
                states[layer, index, :length] = out.hidden_states[layer][0].numpy()
            (final,) = entering_norm
            states[layers, index, :length] = final[0].numpy()
            normed[index, :length] = out.hidden_states[layers][0].numpy()
            recomputed = model.model.norm(final)[0].numpy()
            np.testing.assert_allclose(recomputed, normed[index, :length], rtol=0, atol=1e-6)
    hook.remove()
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    return {"hidden_states": states, "final_normed": normed, "lengths": lengths}


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An .npz with fixed zip timestamps, so that re-running writes identical bytes."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for key, value in arrays.items():
            buffer = io.BytesIO()
            np.save(buffer, value, allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(2026, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, buffer.getvalue())


def main(names: list[str]) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    for name in names or DEFAULT:
        arrays = hidden_states(name)
        save_npz(GOLDEN / name / "hidden_states.npz", arrays)
        shape = arrays["hidden_states"].shape
        print(f"{name}: hidden_states {list(shape)} -> tests/golden/{name}/hidden_states.npz")


if __name__ == "__main__":
    main(sys.argv[1:])
