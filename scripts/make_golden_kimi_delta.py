"""Golden fixture for one Kimi Delta Attention mixer (transformers' `KimiLinearDeltaAttention`).

Writes ``tests/golden/kimi_delta_mixer/mixer.npz``: the weights of one mixer under their
Hugging Face names (relative to the mixer: ``q_proj.weight``, ``conv1d.weight``,
``forget_gate.f_a_proj.weight``, ``forget_gate.A_log``, ...), its shapes (``hidden_size``,
``num_heads``, ``head_dim``, ``conv_kernel``, ``eps``), random input rows of four sequences
(``rows`` [4, 16, hidden], ``lengths``) and each sequence's output run alone over all 16 rows
(``output``, the chunked form of transformers' `chunk_kimi_delta_attention`): a prefill of the
first ``lengths`` rows then decode steps must give the same outputs.

Every parameter is random: linear weights N(0, 1/fan_in), the conv N(0, 1/K), A_log log U(0.5,
4), dt_bias U(-2, 0), the gated norm's weight 1 + 0.2 N(0, 1).

Run (from the repository root; needs the Python 3.11 CPU-torch venv, see tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_golden_kimi_delta.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as base  # noqa: E402

OUT = base.GOLDEN / "kimi_delta_mixer"
SHAPES = {"hidden_size": 32, "num_heads": 4, "head_dim": 8, "conv_kernel": 4, "eps": 1e-5}
LENGTHS = (9, 1, 13, 4)
ROWS = 16


@torch.no_grad()
def main() -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    config = KimiLinearConfig(
        hidden_size=SHAPES["hidden_size"],
        num_hidden_layers=1,
        linear_num_heads=SHAPES["num_heads"],
        linear_head_dim=SHAPES["head_dim"],
        linear_conv_kernel_dim=SHAPES["conv_kernel"],
        rms_norm_eps=SHAPES["eps"],
        layer_types=["linear_attention"],
    )
    mixer = KimiLinearDeltaAttention(config, layer_idx=0).eval()
    gen = torch.Generator(device="cpu").manual_seed(4501)
    for name, p in sorted(mixer.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        uniform = torch.rand(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("A_log"):
            p.copy_(torch.log(0.5 + 3.5 * uniform))
        elif name.endswith("dt_bias"):
            p.copy_(-2.0 + 2.0 * uniform)
        elif name.endswith("o_norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("conv1d.weight"):
            p.copy_(noise / math.sqrt(p.shape[-1]))
        elif p.ndim == 2:
            p.copy_(noise / math.sqrt(p.shape[1]))
        else:
            raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")
    rows = torch.randn((len(LENGTHS), ROWS, SHAPES["hidden_size"]), generator=gen)
    output = torch.stack([mixer(rows[s : s + 1])[0] for s in range(len(LENGTHS))])
    arrays = {name: p.numpy() for name, p in mixer.named_parameters()}
    arrays |= {key: np.asarray(value) for key, value in SHAPES.items()}
    arrays |= {
        "rows": rows.numpy(),
        "lengths": np.asarray(LENGTHS, np.int32),
        "output": output.numpy(),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    base.save_npz_deterministic(OUT / "mixer.npz", arrays)
    print(f"{OUT / 'mixer.npz'}: max|output| {float(output.abs().max()):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
