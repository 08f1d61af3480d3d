"""End to end on the lent GPUs: the decoders on boundaries, and fusion providers on and off.

Part 1 checks the Qwen3 and Llama golden checkpoints on two GPUs (TP 2, attention DP 2,
input-scattered TP 2) against the transformers logits and greedy tokens, in float32 with
`highest` matmul precision.

Part 2 times a Llama-shaped decoder (hidden 4096, 32 heads, 8 kv heads, intermediate 14336,
2 layers, bf16) over TP 2, one forward of packed 8-token sequences, with the boundary's fusion
candidates off (psum + XLA add+norm), with only the Pallas add+norm (psum + Pallas), and with the
platform's candidates (`platform_fusions`: the fused all-reduce + add + norm where the kernel
pays off, else psum + Pallas).
Each variant is compiled once; times are wall-clock medians of blocking forwards.

Part 3 times the same decoder per layout and reduction policy: TP 2 ordinary and
input-scattered (rs, ar), attention DP 2 (ar, rsv).

Run from the repository root: `python3 -m benchmarks.bench_decoder [parity] [fusions]
[policies]` (default: all three).
"""

import dataclasses
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import boundary_jax as bj
from boundary_jax.fusions import AddRmsNorm, FusionProvider, platform_fusions
from models.build import build_model, load_model
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

from .common import LLAMA3_8B, header, median_wall_ms

GOLDEN = pathlib.Path(__file__).parents[1] / "tests" / "golden"
# Llama-3-8B layers with a 32k vocabulary, 2 layers deep.
LLAMA_8B_SHAPE = dataclasses.replace(LLAMA3_8B, vocab_size=32000, num_layers=2)


def parity() -> None:
    print("\n## golden checkpoints on GPU (float32, highest precision)")
    print("| model | layout | max |logit diff| / max |logit| | greedy tokens equal |")
    print("|---|---|---|---|")
    with jax.default_matmul_precision("highest"):
        for name in ("qwen3", "llama"):
            prompts = json.loads((GOLDEN / name / "prompts.json").read_text())
            reference = np.load(GOLDEN / name / "reference.npz")
            for label, dp, tp, scattered in (
                ("TP 2", 1, 2, False),
                ("attention DP 2", 2, 1, False),
                ("input-scattered TP 2", 1, 2, True),
            ):
                mesh = bj.make_mesh(bj.Topology(attn_dp=dp, attn_tp=tp))
                runner = ShardedCausalLM(
                    load_model(GOLDEN / name, mesh), mesh, input_scattered=scattered
                )
                logits = runner.forward(prompts)
                want = reference["logits"]
                error = np.max(np.abs(logits - want)) / np.max(np.abs(want))
                tokens = runner.generate(prompts, reference["generated"].shape[1])
                same = bool(np.array_equal(tokens, reference["generated"]))
                print(f"| {name} | {label} | {error:.1e} | {same} |")


def fusions() -> None:
    topology = bj.Topology(attn_tp=2)
    mesh = bj.make_mesh(topology)
    platform = jax.default_backend()
    variants = {
        "off (psum + XLA add+norm)": FusionProvider(),
        "Pallas add+norm (psum + kernel)": FusionProvider(
            attn_input=(AddRmsNorm(platform, None, "attn_tp"),),
            ffn_input=(AddRmsNorm(platform, None, "attn_tp"),),
        ),
        "platform_fusions": platform_fusions(topology, platform=platform),
    }
    rng = np.random.default_rng(0)
    print("\n## Llama-8B-shaped decoder, 2 layers, bf16, TP 2: forward time by fusion provider")
    print("| rows | " + " | ".join(variants) + " | off / platform | max |diff| platform vs off |")
    print("|---" * (len(variants) + 3) + "|")
    runners = {
        name: ShardedCausalLM(
            build_model(
                LLAMA_8B_SHAPE, topology, BuildOptions(fusions=provider, dtype=jnp.bfloat16)
            ),
            mesh,
            check_vma=False,
        )
        for name, provider in variants.items()
    }
    for rows in (8, 256, 2048):
        sequences = [rng.integers(0, 32000, 8).tolist() for _ in range(rows // 8)]
        times, outputs = {}, {}
        for name, runner in runners.items():
            packed = runner.pack(sequences)
            times[name] = median_wall_ms(
                lambda runner=runner, packed=packed: runner.forward_rows(packed), 20
            )
            outputs[name] = np.asarray(jax.device_get(runner.forward_rows(packed)), np.float32)
        off, fused = list(variants)[0], list(variants)[-1]
        diff = np.max(np.abs(outputs[fused] - outputs[off]))
        cells = " | ".join(f"{times[name]:.3f} ms" for name in variants)
        print(f"| {rows} | {cells} | {times[off] / times[fused]:.2f}x | {diff:.2e} |")


def policies() -> None:
    """Forward time of the same decoder per layout and reduction policy on the two GPUs."""
    rng = np.random.default_rng(1)
    P = bj.ReductionPolicy
    layouts = {
        "TP 2 (any policy: ar)": (1, 2, False, P.AR),
        "TP 2 input-scattered, rs": (1, 2, True, P.RS),
        "TP 2 input-scattered, ar": (1, 2, True, P.AR),
        "attention DP 2, ar": (2, 1, False, P.AR),
        "attention DP 2, rsv": (2, 1, False, P.RSV),
    }
    print("\n## Llama-8B-shaped decoder, 2 layers, bf16: forward time by layout and policy")
    print("| rows | " + " | ".join(layouts) + " |")
    print("|---" * (len(layouts) + 1) + "|")
    runners = {}
    for name, (dp, tp, scattered, policy) in layouts.items():
        topology = bj.Topology(attn_dp=dp, attn_tp=tp)
        model = build_model(
            LLAMA_8B_SHAPE, topology, BuildOptions(reduction=policy, dtype=jnp.bfloat16)
        )
        runners[name] = ShardedCausalLM(model, bj.make_mesh(topology), input_scattered=scattered)
    for rows in (256, 2048, 8192):
        sequences = [rng.integers(0, 32000, 8).tolist() for _ in range(rows // 8)]
        cells = []
        for runner in runners.values():
            packed = runner.pack(sequences)
            cells.append(
                median_wall_ms(lambda runner=runner, packed=packed: runner.forward_rows(packed), 20)
            )
        print(f"| {rows} | " + " | ".join(f"{ms:.3f} ms" for ms in cells) + " |")


def main() -> None:
    print(header("bench_decoder"))
    parts = {"parity": parity, "fusions": fusions, "policies": policies}
    for name in sys.argv[1:] or parts:
        parts[name]()


if __name__ == "__main__":
    main()
