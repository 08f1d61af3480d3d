"""How far FP8 weights and activations move a trained model from its bf16 run (CPU or GPU).

Loads one checkpoint in bf16 and quantized to FP8 on load (`--quantize fp8`: 128 x 128 weight
blocks, activations per 128-feature token group; bf16 activations), and in float32 for scale,
runs them on the same windows of a text (byte tokens) and reports, for FP8 against bf16 (and
bf16 against float32), over every position:

- the logits' difference: max and mean |fp8 - bf16| relative to the largest |bf16| logit;
- teacher-forced agreement: how often both pick the same next token at a position;
- free-running agreement: greedy continuations of prompts cut from the text, compared token by
  token (and the mean length of the common prefix).

A model with random weights cannot judge FP8 (it moves a tiny random model's logits by 15-20%
of their largest value), so train one first, e.g. on the repository's own text:

    boundary-jax train --preset tiny-qwen3-fp8 --text DIR --steps 300 --out /tmp/trained
    .venv/bin/python -m benchmarks.fp8_drift --checkpoint /tmp/trained --text DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import boundary_jax as bj
from models.build import load_model
from models.layers.fp8_linear import Fp8Quantization
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM


def windows(text_dir: str, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` windows of `length` byte tokens from the files under `text_dir` (or one file)."""
    source = Path(text_dir)
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    tokens = np.frombuffer(b"".join(f.read_bytes() for f in files), np.uint8).astype(np.int32)
    starts = np.random.default_rng(seed).integers(0, len(tokens) - length, count)
    return [tokens[s : s + length].tolist() for s in starts]


def measure(checkpoint: str, text: str, *, count: int, length: int, new_tokens: int) -> dict:
    """The drift numbers of the module docstring, as a JSON-friendly dict: FP8 against bf16,
    and for scale bf16 against float32."""
    mesh = bj.make_mesh(bj.Topology())
    fp8 = Fp8Quantization.for_platform(jax.default_backend())
    runners = {
        name: ShardedCausalLM(
            load_model(checkpoint, mesh, BuildOptions(dtype=dtype, quantization=quantization)), mesh
        )
        for name, dtype, quantization in (
            ("float32", jnp.float32, None),
            ("bf16", jnp.bfloat16, None),
            ("fp8", jnp.bfloat16, fp8),
        )
    }
    sequences = windows(text, count, length, seed=0)
    logits = {name: runner.forward(sequences) for name, runner in runners.items()}
    prompts = [s[: length // 2] for s in sequences]
    continued = {
        name: np.asarray(runner.generate(prompts, new_tokens)) for name, runner in runners.items()
    }
    return {
        "checkpoint": checkpoint,
        "positions": int(logits["bf16"].shape[0] * logits["bf16"].shape[1]),
        "fp8_vs_bf16": _drift(logits, continued, "fp8", "bf16"),
        "bf16_vs_float32": _drift(logits, continued, "bf16", "float32"),
    }


def _drift(logits: dict, continued: dict, name: str, base: str) -> dict:
    scale = np.abs(logits[base]).max()
    difference = np.abs(logits[name] - logits[base])
    same = continued[name] == continued[base]
    steps = same.shape[1]
    common = np.where(same.all(1), steps, np.argmin(same, axis=1))
    return {
        "max_abs_logit": float(scale),
        "max_difference_relative": float(difference.max() / scale),
        "mean_difference_relative": float(difference.mean() / scale),
        "teacher_forced_agreement": float(
            np.mean(logits[name].argmax(-1) == logits[base].argmax(-1))
        ),
        "greedy_tokens_compared": int(same.size),
        "greedy_agreement": float(same.mean()),
        "greedy_common_prefix_mean": float(common.mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a trained checkpoint directory")
    parser.add_argument("--text", required=True, help="a text file or directory (byte tokens)")
    parser.add_argument("--windows", type=int, default=16, help="text windows (default 16)")
    parser.add_argument("--length", type=int, default=128, help="tokens per window (default 128)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens (default 32)")
    args = parser.parse_args()
    result = measure(
        args.checkpoint,
        args.text,
        count=args.windows,
        length=args.length,
        new_tokens=args.new_tokens,
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
