"""Writes the MXFP4 form of a float GPT-OSS checkpoint, in the layout of the released ones
(openai/gpt-oss-20b, -120b): each layer's routed experts ``mlp.experts.gate_up_proj`` [experts,
hidden, 2 x width] and ``mlp.experts.down_proj`` [experts, width, hidden] become ``*_blocks``
(uint8 [experts, out, in / 32, 16], two e2m1 values a byte) and ``*_scales`` (uint8 e8m0
[experts, out, in / 32], one per 32 values), the other tensors are copied as stored, every
weights file keeps its name (an index is rewritten), and ``config.json`` gains
``quantization_config: {quant_method: mxfp4, ...}``. ``boundary-jax forward --checkpoint
TARGET`` then loads it, each device dequantizing its shard to the model's dtype.

Run (from the repository root)::

    .venv/bin/python scripts/make_mxfp4_checkpoint.py SOURCE_DIR TARGET_DIR
"""

from __future__ import annotations

import argparse

from models.weights.mxfp4 import write_mxfp4_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a GPT-OSS checkpoint directory (bf16 or float32)")
    parser.add_argument("target", help="where to write the MXFP4 checkpoint")
    args = parser.parse_args()
    names = write_mxfp4_checkpoint(args.source, args.target)
    print(f"wrote {args.target}: {len(names)} expert tensors in MXFP4")


if __name__ == "__main__":
    main()
