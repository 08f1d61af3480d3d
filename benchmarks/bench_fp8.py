"""FP8 weights on one H200: the whole Llama-3-8B-shaped model, the Qwen3-30B-A3B MoE layer and the
block-scaled matmuls, each against the project's bf16 counterpart measured in the same run.

Part "e2e" (also `bench_e2e --quantize fp8`): the project model with bf16 weights (its default step,
no fusions) and the same model with FP8 projection weights (`Fp8Quantization.for_platform`: the
Triton decode kernel up to 16 rows, the Mosaic GPU wgmma kernel above; quantized reads fused into
add + RMSNorm + quantize with `--fp8-fusions auto`): decode 8 and 64 sequences at a 1024-token cache
(a jitted loop of 32 greedy steps, time per step) and prefill 4096 tokens (8 x 512). Rooflines:
decode, the bytes a step reads (FP8: one byte per projection weight, its block scales, the bf16 LM
head and KV cache) over the bandwidth a device copy reaches (measured in the run); prefill, the
FLOPs over 990 (bf16) or 1979 (FP8) TFLOP/s. Targets (issue 25): decode >= 1.6x bf16 and >= 70% of
the FP8 bytes' roofline; prefill >= 1.3x. The FP8 prefill's last-row logits are checked against the
same FP8 weights through XLA's reference matmuls (the bf16 and FP8 models' random weights differ:
the FP8 ones are drawn in Hugging Face's [out, in] layout).

Part "moe" (also `bench_moe --fp8`): the MoE layer as the model runs it (`MoeFfn.finalized` with
the model default grouped matmuls, against `Fp8MoeFfn`: the Triton FP8 expert kernel at decode
sizes, the padded wgmma products above 2048 routed rows) at 8 and 64 tokens (CUPTI, or the wall
clock where the rows are padded) and 4096 (wall clock), checked against the same FP8 layer
through XLA's reference; one row per FP8 variant of the experts' products (`--moe-experts`; by
default the platform's). Targets: decode >= 1.5x bf16, every case >= 1.0x.

Part "experts": the MoE layer's two expert products alone, its experts padded to capacities of
320 and 384 rows (the bf16 layer's buckets at 4096 tokens): the bf16 batched einsum, the FP8
weights dequantized to bf16, and the batched Mosaic wgmma kernel over a sweep of tilings, for
tuning `mosaic_fp8_batched_tiling`.

Part "matmul": one [4096 -> 14336] projection at 8 / 64 / 512 / 4096 rows: bf16 `jnp.dot`, the FP8
weight dequantized by XLA in the program (the issue's 0.38-0.94x), and the FP8 kernels over a few
tilings (their `tiling` argument), each checked against XLA's FP8 reference, for tuning
`pallas_kernels/fp8_matmul/tuned_block_sizes.py`.

    python3 -m benchmarks.bench_fp8                     # every part, on the GPU machine
    python3 -m benchmarks.bench_fp8 --parts moe matmul
    python3 -m benchmarks.bench_fp8 --parts experts moe   # the padded FP8 experts
    python3 -m benchmarks.bench_fp8 --parts matmul --wide --rows 8 64   # the decode kernel's grid
    python3 -m benchmarks.bench_fp8 --smoke             # CPU: tiny shapes, XLA / interpreted
"""

# ruff: noqa: B023 (each timed closure runs within its own loop iteration)

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import boundary_jax as bj
from models.build import build_model
from models.config import DecoderConfig, MoeConfig
from models.inputs.rows import pack_sequences
from models.layers.attention.self_attention import AttentionImpl
from models.layers.fp8_linear import Fp8Quantization
from models.layers.moe.ffn import MoeFfn
from models.layers.moe.fp8 import Fp8MoeFfn
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM
from pallas_kernels import compat
from pallas_kernels.fp8_matmul import (
    Fp8GroupedImpl,
    Fp8MatmulImpl,
    default_fp8_grouped_impl,
    padded_product,
)
from pallas_kernels.grouped_matmul import default_grouped_matmul_impl
from pallas_kernels.impl import Impl

from .bench_fp8_kernels import experts, matmul
from .common import (
    LLAMA3_8B,
    PEAK_FLOPS,
    SMOKE_CASES,
    Cases,
    decode_inputs,
    hbm_bytes_per_s,
    header,
    interleaved_wall_ms,
    kernel_ms,
    kv_bytes_per_gpu,
    median_wall_ms,
    or_out_of_memory,
    prefill_flops_per_gpu,
    print_table,
    profile_into,
    relative_error,
    weight_bytes_per_gpu,
)

E2E_CASES = Cases(prefill_sequences=(8,), decode_caches=(1024,))
"""Part e2e: decode 8 and 64 sequences at a 1024-token cache, prefill 8 x 512."""
FP8_PEAK_FLOPS = 2 * PEAK_FLOPS
SMOKE = False  # set by --smoke: tiny shapes, XLA and interpreted kernels on CPU
MATMUL: Fp8MatmulImpl | None = None  # set by --matmul: the FP8 models' projections
ROWS_BY_XLA = False  # set by --quantize-rows xla: the projections' inputs quantized by XLA


def fp8_weight_bytes_per_gpu(config: DecoderConfig, tp: int) -> float:
    """Bytes of the weights an FP8 decode step reads per GPU: one per projection weight plus a
    float32 scale per 128 x 128 block, the LM head in bf16."""
    h, d = config.hidden_size, config.head_dim
    attn = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)
    mlp = 3 * h * config.intermediate_size
    projections = config.num_layers * (attn + mlp) * (1 + 4 / 128**2)
    return (projections + 2 * h * config.vocab_size) / tp


def timed_ms(fn, arg_sets, *, wall: bool = False) -> float:
    """`common.kernel_ms`; in a smoke run one call after a warm-up (the kernels interpreted)."""
    if not SMOKE:
        return kernel_ms(fn, arg_sets, repeats=20, wall=wall)
    jax.block_until_ready(fn(*arg_sets[0]))
    start = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    return (time.perf_counter() - start) * 1e3


def quantization() -> Fp8Quantization:
    if SMOKE:
        return Fp8Quantization()  # XLA: the reference runs anywhere
    chosen = Fp8Quantization.for_platform(jax.default_backend())
    if ROWS_BY_XLA:
        chosen = dataclasses.replace(chosen, rows=Impl.XLA)
    return chosen if MATMUL is None else dataclasses.replace(chosen, matmul=MATMUL)


# -- part e2e ----------------------------------------------------------------------------------


def e2e(
    config: DecoderConfig, fp8_fusions: str, cases: Cases, only: list[str] | None
) -> list[tuple]:
    """bf16 and FP8 project steps of `config` at TP 1 on `cases` (those named in `only`, if
    given): decode cases first, then prefill; rows of the results table."""
    wanted = lambda case: only is None or case in only  # noqa: E731
    topology = bj.Topology()
    mesh = bj.make_mesh(topology)
    attention = AttentionImpl.for_platform(jax.default_backend())
    runners = {}
    for name, quantized in (("bf16", None), ("fp8", quantization())):
        fused = name == "fp8" and fp8_fusions == "auto"
        model = build_model(
            config,
            topology,
            BuildOptions(
                dtype=jnp.bfloat16,
                attention=attention,
                quantization=quantized,
                fusions=bj.fusions.platform_fusions(topology) if fused else bj.fusions.NO_FUSIONS,
            ),
            mesh=mesh,
        )
        runners[name] = ShardedCausalLM(model, mesh)
        del model
        gc.collect()
    # The FP8 weights again through XLA's reference matmuls (a graph over the same state): the
    # check of the kernels' prefill logits.
    reference = nnx.eval_shape(
        lambda: build_model(
            config,
            topology,
            BuildOptions(dtype=jnp.bfloat16, attention=attention, quantization=Fp8Quantization()),
        )
    )
    checking = ShardedCausalLM(nnx.merge(nnx.graphdef(reference), runners["fp8"].state), mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    key = jax.device_put(jax.random.key(0), replicated)
    results = []
    bytes_of = {"bf16": weight_bytes_per_gpu, "fp8": fp8_weight_bytes_per_gpu}
    steps = cases.steps
    for case, sequences, cache_len in cases.decodes():
        if not wanted(case):
            continue
        start = cache_len - steps - 1
        times, roofs = {}, {}
        for name, runner in runners.items():
            rows, batch = decode_inputs(runner, sequences, start)
            caches = [runner.new_caches(sequences, cache_len)]

            def decode():
                out, caches[0] = runner.decode(rows, batch, caches[0], key, steps, capacity=steps)
                return out

            repeats = cases.decode_repeats
            times[name] = median_wall_ms(decode, repeats, label=f"{name} {case}") / steps
            del caches[0]
            nbytes = bytes_of[name](config, 1) + kv_bytes_per_gpu(
                config, 1, sequences, start + steps / 2
            )
            roofs[name] = nbytes / hbm_bytes_per_s() * 1e3 / times[name]
        results.append(_row(config, case, times, roofs, "HBM"))
        print(results[-1], flush=True)
    length = cases.prefill_length
    for case, sequences in cases.prefills():
        if not wanted(case):
            continue
        rng = np.random.default_rng(0)
        prompts = list(rng.integers(0, config.vocab_size, (sequences, length)).astype(np.int32))
        times, roofs, logits = {}, {}, {}
        for name, runner in (*runners.items(), ("xla", checking)):
            packed = pack_sequences(prompts, topology, max_sequence_rows=length)
            rows, batch = runner.place(packed)
            logits[name] = runner.forward_placed(rows, batch)[packed.last_row_index()]
            if name == "xla":
                break
            last_rows = runner.place_array(packed.last_row_index())
            caches = [runner.new_caches(packed.decode_rows_per_rank, length)]

            def prefill():
                tokens, caches[0] = runner.prefill(rows, batch, caches[0], last_rows, key)
                return tokens

            label = f"{name} {case}"
            times[name] = median_wall_ms(prefill, cases.prefill_repeats, label=label)
            del caches[0]
            peak = FP8_PEAK_FLOPS if name == "fp8" else PEAK_FLOPS
            flops = prefill_flops_per_gpu(config, 1, sequences, length)
            roofs[name] = flops / peak * 1e3 / times[name]
        error = relative_error(logits["fp8"], logits["xla"])
        results.append(_row(config, case, times, roofs, "FLOP", error))
        print(results[-1], flush=True)
    return results


def _row(config, case, times, roofs, unit, error=None) -> tuple:
    return (
        f"{config.num_layers}L",
        case,
        times["bf16"],
        times["fp8"],
        times["bf16"] / times["fp8"],
        f"{100 * roofs['bf16']:.0f}% / {100 * roofs['fp8']:.0f}% {unit}",
        "-" if error is None else f"{error:.2e}",
    )


# -- part moe ----------------------------------------------------------------------------------

MOE = dict(hidden=2048, experts=128, top_k=8, width=768)  # Qwen3-30B-A3B


def moe_variants() -> tuple[Fp8GroupedImpl, ...]:
    """Part moe's FP8 layers by default: the platform's expert products (for a smoke run, XLA's
    beside the padded products in the Mosaic GPU interpreter, where JAX has one)."""
    if SMOKE:
        interpreted = compat.gpu_interpret_params() is not None
        return (Fp8GroupedImpl.XLA,) + ((Fp8GroupedImpl.PADDED_GPU_INTERPRET,) * interpreted)
    return (default_fp8_grouped_impl(jax.default_backend()),)


def moe_layers(variants: tuple[Fp8GroupedImpl, ...]) -> dict[str, tuple]:
    """The bf16 layer and an FP8 layer per variant of the experts' products (graph, state) on one
    device, same shapes and routing (the experts differ: the FP8 ones are drawn in Hugging Face's
    [out, in] layout), and the FP8 layer again through XLA's reference (the same FP8 weights: the
    kernels' check)."""
    hidden, experts, top_k, width = MOE["hidden"], MOE["experts"], MOE["top_k"], MOE["width"]
    config = MoeConfig(
        num_experts=experts, top_k=top_k, expert_intermediate_size=width, renormalize=True
    )
    topology = bj.Topology()
    bf16 = MoeFfn(
        hidden,
        config,
        topology,
        impl=default_grouped_matmul_impl(jax.default_backend(), jnp.bfloat16),
        dtype=jnp.bfloat16,
        rngs=nnx.Rngs(0),
    )
    layers = {"bf16": nnx.split(bf16)}
    named = {impl.name: dataclasses.replace(quantization(), grouped=impl) for impl in variants}
    for name, quantized in {**named, "fp8 xla": Fp8Quantization()}.items():
        fp8 = Fp8MoeFfn(
            hidden, config, topology, quantization=quantized, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
        )
        layers[name] = nnx.split(fp8)
    return layers


def moe(tokens_list, variants: tuple[Fp8GroupedImpl, ...]) -> list[tuple]:
    layers = moe_layers(variants)
    results = []
    hidden, width = MOE["hidden"], MOE["width"]
    for tokens in tokens_list:
        sets = [
            (jax.random.normal(jax.random.key(100 + i), (tokens, hidden)).astype(jnp.bfloat16),)
            for i in range(4)
        ]
        # CUPTI misses the kernels of a branch XLA runs from a conditional (the padded
        # products' capacity buckets, the bf16 layer's above 2048 routed rows).
        padded = any(padded_product(impl, tokens * MOE["top_k"]) for impl in variants)
        wall = SMOKE or tokens > 256 or padded
        outs, contenders = {}, {}
        graph, state = layers["bf16"]
        routing = nnx.merge(graph, state).router[...]
        chosen = np.mean([_distinct(s[0], routing) for s in sets])
        for name, (graph, state) in layers.items():
            fn = jax.jit(lambda state, x, graph=graph: nnx.merge(graph, state).finalized(x))
            # XLA's ragged product over 4096 tokens takes 32 GiB (no H100 holds it beside the rest)
            outs[name] = or_out_of_memory(lambda fn=fn, state=state: fn(state, *sets[0]))
            if name != "fp8 xla":
                contenders[name] = (fn, [(state, *s) for s in sets])
        if wall and not SMOKE:  # the layers timed in turns, each round all of them
            times = interleaved_wall_ms(contenders)
        else:
            times = {name: timed_ms(fn, sets, wall=wall) for name, (fn, sets) in contenders.items()}
        bf16_roof = chosen * 3 * hidden * width * 2 / times["bf16"] / 1e9
        for impl in variants:
            ms = times[impl.name]
            fp8_roof = chosen * 3 * hidden * width * (1 + 4 / 128**2) / ms / 1e9
            roofs = [100 * roof / (hbm_bytes_per_s() / 1e12) for roof in (bf16_roof, fp8_roof)]
            results.append(
                (
                    "MoE layer" + (" [wall clock]" if wall else ""),
                    f"{tokens} tokens",
                    impl.name,
                    times["bf16"],
                    ms,
                    times["bf16"] / ms,
                    f"{roofs[0]:.0f}% / {roofs[1]:.0f}% HBM",
                    error_cell(outs[impl.name], outs["fp8 xla"]),
                )
            )
            print(results[-1], flush=True)
    return results


def error_cell(got, want) -> str:
    """The relative error of `got` against the reference `want`, or why it has none."""
    if isinstance(want, str):
        return "XLA ref OOM"
    return f"{relative_error(got, want):.2e}"


def _distinct(x, router) -> int:
    logits = np.asarray(x.astype(jnp.float32) @ router.astype(jnp.float32))
    return int(np.unique(np.argsort(-logits, axis=-1)[:, : MOE["top_k"]]).size)


# -- main --------------------------------------------------------------------------------------


def main(argv=None) -> None:
    global SMOKE, MATMUL, ROWS_BY_XLA
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", nargs="+", choices=("e2e", "moe", "matmul", "experts"), default=None
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--fp8-fusions", choices=("none", "auto"), default="auto")
    parser.add_argument("--cases", nargs="+", default=None, help="e.g. 'decode 64 @ 1024'")
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="part matmul's rows")
    parser.add_argument(
        "--shape", type=int, nargs=2, default=None, help="part matmul's [in, out] (4096 14336)"
    )
    parser.add_argument(
        "--wide", action="store_true", help="part matmul: the decode kernel over a tiling grid"
    )
    parser.add_argument(
        "--matmul",
        choices=[impl.name for impl in Fp8MatmulImpl],
        default=None,
        help="parts e2e and moe: the FP8 projections' matmul (default: the platform's)",
    )
    parser.add_argument(
        "--quantize-rows",
        choices=("kernel", "xla"),
        default="kernel",
        help="parts e2e and moe: quantize the projections' inputs by the platform's kernel "
        "(pallas_kernels.quantize_rows) or by XLA",
    )
    parser.add_argument(
        "--moe-experts",
        nargs="+",
        choices=[impl.name for impl in Fp8GroupedImpl],
        default=None,
        help="part moe: the FP8 layers' expert products, one row each (default: the platform's)",
    )
    parser.add_argument("--profile", default=None, help="part e2e: trace each case here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    args = parser.parse_args(argv)
    try:
        e2e_cases = (SMOKE_CASES if args.smoke else E2E_CASES).naming(args.cases)
    except ValueError as error:
        parser.error(str(error))
    if args.profile:
        profile_into(args.profile)
    SMOKE = args.smoke
    MATMUL = None if args.matmul is None else Fp8MatmulImpl[args.matmul]
    ROWS_BY_XLA = args.quantize_rows == "xla"
    parts = args.parts or ("e2e", "moe", "experts", "matmul")
    print(header("bench_fp8"))
    config = dataclasses.replace(LLAMA3_8B, num_layers=args.layers)
    tokens, shape, rows = (8, 64, 4096), (4096, 14336), (8, 64, 512, 4096)
    if SMOKE:
        config = dataclasses.replace(
            config, vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=128,
        )  # fmt: skip
        MOE.update(hidden=256, experts=8, top_k=2, width=256)
        tokens, shape, rows = (8,), (256, 256), (8, 128)
    if "e2e" in parts:
        print("\n## Llama-3-8B shape, TP 1: bf16 vs FP8 project steps (ms; ratio = speedup)")
        print_table(
            (
                "model",
                "case",
                "bf16 ms",
                "fp8 ms",
                "fp8 speedup",
                "roofline bf16 / fp8",
                "fp8 logits vs XLA fp8",
            ),
            e2e(config, args.fp8_fusions, e2e_cases, args.cases),
        )
    if "moe" in parts:
        print(f"\n## MoE layer {MOE}, 1 GPU: bf16 vs FP8 experts (ms)")
        variants = moe_variants()
        if args.moe_experts:
            variants = tuple(Fp8GroupedImpl[name] for name in args.moe_experts)
        print_table(
            (
                "layer",
                "case",
                "fp8 experts",
                "bf16 ms",
                "fp8 ms",
                "fp8 speedup",
                "roofline",
                "fp8 vs XLA fp8",
            ),
            moe(tokens, variants),
        )
    if "experts" in parts:
        capacities = (64,) if SMOKE else (320, 384)
        groups = 2 if SMOKE else MOE["experts"]
        print(f"\n## MoE experts padded to a capacity, {MOE}: the batched products (us)")
        print_table(
            ("product", "variant", "us", "x bf16", "TFLOP/s", "err vs fp8 reference"),
            experts(
                capacities,
                groups=groups,
                hidden=MOE["hidden"],
                width=MOE["width"],
                timed_ms=timed_ms,
                smoke=SMOKE,
            ),
        )
    if "matmul" in parts:
        k, n = args.shape or shape
        print(f"\n## one projection [{k} -> {n}], bf16 out (us)")
        print_table(
            ("rows", "variant", "us", "x bf16", "weight TB/s", "TFLOP/s", "rel err vs XLA fp8"),
            matmul(
                *(args.shape or shape),
                args.rows or rows,
                timed_ms=timed_ms,
                smoke=SMOKE,
                wide=args.wide,
            ),
        )


if __name__ == "__main__":
    main()
