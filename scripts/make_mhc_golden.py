"""Generate `tests/golden/mhc/reference.npz`: DeepSeek-V4's hyper-connection and hyper-head on
random weights, computed by PyTorch `transformers`, for `boundary_jax.residual.mhc`'s parity test.

Run (from the repository root, with the Python 3.11 CPU-torch venv of tests/golden/README.md)::

    /work/main/.torchenv/bin/python scripts/make_mhc_golden.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
)

OUT = Path(__file__).resolve().parents[1] / "tests" / "golden" / "mhc" / "reference.npz"
HIDDEN, HC, ROWS = 32, 4, 12


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = DeepseekV4Config(
        hidden_size=HIDDEN, hc_mult=HC, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6
    )
    connection = DeepseekV4HyperConnection(config).float()
    head = DeepseekV4HyperHead(config).float()
    with torch.no_grad():
        for parameter in (*connection.parameters(), *head.parameters()):
            parameter.copy_(torch.randn_like(parameter) * 0.5)
        streams = torch.randn(1, ROWS, HC, HIDDEN)
        output = torch.randn(1, ROWS, HIDDEN)
        post, comb, collapsed = connection(streams)
        updated = post.unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(
            comb.transpose(-1, -2), streams
        )
        collapsed_head = head(streams)
    arrays = {
        "streams": streams[0],
        "output": output[0],
        "fn": connection.fn,
        "base": connection.base,
        "scale": connection.scale,
        "post": post[0],
        "comb": comb[0],
        "collapsed": collapsed[0],
        "updated": updated[0],
        "head_fn": head.hc_fn,
        "head_base": head.hc_base,
        "head_scale": head.hc_scale,
        "head_collapsed": collapsed_head[0],
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez(OUT, **{name: value.detach().numpy() for name, value in arrays.items()})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
