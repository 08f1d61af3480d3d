"""Writes the Hugging Face fine-grained FP8 form of a checkpoint (as Qwen3-*-FP8 and DeepSeek-V3
store theirs): every attention, MLP and routed-expert projection weight becomes float8_e4m3fn
[out, in] with a float32 ``weight_scale_inv`` [out / 128, in / 128] (one scale per 128 x 128
block: the block's largest magnitude / 448), the other tensors are copied, and ``config.json``
gains ``quantization_config`` (``quant_method: fp8``, ``weight_block_size: [128, 128]``,
dynamic activations). ``boundary-jax forward --checkpoint TARGET`` then loads it as an FP8 model.

Run (from the repository root)::

    .venv/bin/python scripts/make_fp8_checkpoint.py SOURCE_DIR TARGET_DIR
"""

from __future__ import annotations

import argparse

from models.weights.fp8 import write_fp8_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a Hugging Face checkpoint directory (bf16 or float32)")
    parser.add_argument("target", help="where to write the FP8 checkpoint")
    args = parser.parse_args()
    names = write_fp8_checkpoint(args.source, args.target)
    print(f"wrote {args.target}: {len(names)} weights in FP8 blocks")


if __name__ == "__main__":
    main()
