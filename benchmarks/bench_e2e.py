"""Whole-model prefill and decode: boundary-jax against one `jax.jit` with GSPMD, and the roofline.

The baseline (`benchmarks.gspmd_baseline`) is the obvious alternative a user writes first: the
same Llama model as one jitted function over global arrays whose `NamedSharding`s are the
project's own (the weights are the project model's placed state, not a copy), with XLA's GSPMD
inserting the collectives. It comes in two forms: plain `jnp` attention within each sequence, and
the same attention kernels the project uses on GPU (cuDNN through `jax.nn.dot_product_attention`),
so that "project / GSPMD (same kernels)" isolates what the boundaries cost or gain. Before any
timing, last-row prefill logits of each baseline are compared with the project's.

Cases (Llama-3-8B shape, bf16, `--layers` layers, TP 1 and 2):
  prefill 512 tokens (1 sequence) and 4096 tokens (8 x 512; packed rows in the project, a
  [8, 512] batch in the baseline), writing the KV cache, greedy token of each last row;
  decode 8 and 64 sequences at cache 1024 and 8192: a jitted loop of 32 greedy steps
  (one program; time per step), each sequence reading about a full cache.
Roofline: decode, weights + KV bytes read per GPU / the bandwidth a device copy reaches
(measured in the run, `common.hbm_bytes_per_s`); prefill, matmul + causal attention FLOPs per
GPU / dense bf16 peak (990 TFLOP/s). Times are wall-clock medians of blocking calls (a decode
call runs 32 steps, so dispatch is amortized). The TPs default to those of 1 and 2 that the
visible devices hold.

With `--scan` the project model is built with `scan_layers=True` and both baselines run their
layers (stacked once, a copy) as one `lax.scan`, as a user writing a deep model would. On JAX
0.11.2 a scanned decode step copies each layer's weights out of the stack (RESULTS run 15), so
decode is measured unrolled.

Run on the GPU machine from the repository root:
  python3 -m benchmarks.bench_e2e --layers 8 --tp 1 2
  python3 -m benchmarks.bench_e2e --layers 32 --tp 2 --scan
  python3 -m benchmarks.bench_e2e --layers 32 --quantize fp8   # bf16 vs FP8 (bench_fp8)

`--smoke` is the CPU check that the script runs: 2 layers of a tiny config, one prefill and one
decode case at tiny shapes, one timed call each (seconds, on one device or on simulated ones:
JAX_NUM_CPU_DEVICES=2 adds TP 2):
  python3 -m benchmarks.bench_e2e --smoke
"""

# ruff: noqa: B023 (each timed closure runs within its own loop iteration)

from __future__ import annotations

import argparse
import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj
from models.build import build_model
from models.config import DecoderConfig
from models.inputs.rows import pack_sequences
from models.layers.attention.cudnn import decode_attention_cudnn
from models.layers.attention.self_attention import AttentionImpl
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM
from pallas_kernels import Impl

from . import bench_fp8
from .common import (
    LLAMA3_8B,
    LLAMA3_SMOKE,
    PEAK_FLOPS,
    SMOKE_CASES,
    Cases,
    decode_ids,
    decode_inputs,
    hbm_bytes_per_s,
    header,
    kernel_ms,
    kv_bytes_per_gpu,
    median_wall_ms,
    or_out_of_memory,
    prefill_flops_per_gpu,
    print_table,
    ratio,
    weight_bytes_per_gpu,
)
from .gspmd_baseline import (
    auto_mesh,
    baseline_caches,
    baseline_params,
    decode_attention,
    make_baseline,
)


@dataclasses.dataclass(frozen=True)
class GenerateCheck:
    """The shapes of the generate() check (`generate_check`).

    Attributes:
      prompts: Prompts generated from at once.
      prompt_tokens: Tokens per prompt.
      new_tokens: Tokens sampled per prompt.
      cache: Cache length of the check's jitted decode loop.
      repeats: Timed calls of each program.
    """

    prompts: int = 64
    prompt_tokens: int = 64
    new_tokens: int = 129
    cache: int = 256
    repeats: int = 3

    def __post_init__(self):
        if self.prompt_tokens + self.new_tokens > self.cache:
            raise ValueError(
                f"cache ({self.cache}) must hold the prompt ({self.prompt_tokens}) and the new "
                f"tokens ({self.new_tokens}); lengthen the cache"
            )


SMOKE_GENERATE = GenerateCheck(prompts=2, prompt_tokens=8, new_tokens=3, cache=16, repeats=1)
"""`--smoke`: the generate() check at 2 prompts of 8 tokens, timed once."""
DEFAULT_TP = (1, 2)
"""The TPs a run measures unless `--tp` says; those the visible devices cannot hold are left out."""

FUSIONS = ("none", "auto", "pallas")


def fusion_provider(name: str, topology: bj.Topology) -> bj.fusions.FusionProvider:
    """The project's boundary fusions for `--fusions`: none (the default stack), the platform's
    candidates as they pick by shape (`platform_fusions`), or every candidate forced onto its
    Pallas GPU kernel."""
    if name == "none":
        return bj.fusions.NO_FUSIONS
    impl = Impl.PALLAS_GPU if name == "pallas" else None
    return bj.fusions.platform_fusions(topology, impl=impl)


def run_config(
    config: DecoderConfig,
    tp: int,
    results: list,
    memory: list,
    cases: Cases,
    only: list[str] | None = None,
    scan: bool = False,
    fusions: str = "none",
) -> None:
    """Times the project and both baselines on every case of `cases` (those named in `only`,
    if given) at TP `tp`; appends a row per case to `results` and a memory line to `memory`."""
    wanted = lambda case: only is None or case in only  # noqa: E731
    topology = bj.Topology(attn_tp=tp)
    mesh = bj.make_mesh(topology)
    model = build_model(
        config,
        topology,
        BuildOptions(
            dtype=jnp.bfloat16,
            attention=AttentionImpl.for_platform(jax.default_backend()),
            scan_layers=scan,
            fusions=fusion_provider(fusions, topology),
        ),
        mesh=mesh,
    )
    runner = ShardedCausalLM(model, mesh)
    del model
    weights = sum(
        x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(nnx.to_pure_dict(runner.state))
    )
    stats = mesh.devices.flat[0].memory_stats() or {}
    memory.append(
        f"{config.num_layers} layers TP {tp}, fusions {fusions}: "
        f"sharded weights {weights / 2**30:.2f} GiB per GPU; "
        f"GPU 0 in use after placement {stats.get('bytes_in_use', 0) / 2**30:.2f} GiB, "
        f"peak {stats.get('peak_bytes_in_use', 0) / 2**30:.2f} GiB"
    )
    print(memory[-1], flush=True)
    gspmd = auto_mesh(mesh)
    params = baseline_params(runner, gspmd, scan=scan)
    baselines = {
        name: make_baseline(config, cudnn, scan)
        for name, cudnn in (("cuDNN", True), ("jnp", False))
    }
    rng = np.random.default_rng(0)
    replicated = NamedSharding(gspmd, PartitionSpec())
    key = jax.device_put(jax.random.key(0), NamedSharding(mesh, PartitionSpec()))
    label = f"{config.num_layers}L TP{tp}" + ("" if fusions == "none" else f" fusions {fusions}")

    def zero_caches(slots, length):
        return baseline_caches(config, topology, gspmd, slots=slots, length=length, scan=scan)

    length = cases.prefill_length
    for case, sequences in cases.prefills():
        if not wanted(case):
            continue
        prompts = rng.integers(0, config.vocab_size, (sequences, length)).astype(np.int32)
        packed = pack_sequences(list(prompts), topology, max_sequence_rows=length)
        rows, batch = runner.place(packed)
        last_rows = runner.place_array(packed.last_row_index())
        last = packed.last_row_index()[packed.slot_order()]
        want = runner.forward_placed(rows, batch)[last]
        ids = jax.device_put(prompts, replicated)
        times, errors = {}, {}
        for name, (logits_of, _, _) in baselines.items():
            got = logits_of(params, ids)
            got, ref = np.asarray(got), np.asarray(want)
            errors[name] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        del want

        def project_prefill_ms():
            caches = [runner.new_caches(packed.decode_rows_per_rank, length)]

            def project_prefill():
                tokens, caches[0] = runner.prefill(rows, batch, caches[0], last_rows, key)
                return tokens

            return median_wall_ms(project_prefill, cases.prefill_repeats)

        times["project"] = or_out_of_memory(project_prefill_ms)
        for name, (_, step, _) in baselines.items():

            def baseline_prefill_ms(step=step):
                holder = [zero_caches(sequences, length)]

                def baseline_prefill():
                    tokens, holder[0] = step(params, ids, holder[0])
                    return tokens

                return median_wall_ms(baseline_prefill, cases.prefill_repeats)

            times[name] = or_out_of_memory(baseline_prefill_ms)
        flops = prefill_flops_per_gpu(config, tp, sequences, length)
        results.append(
            (
                label,
                case,
                times["project"],
                times["cuDNN"],
                times["jnp"],
                ratio(times["cuDNN"], times["project"]),
                ratio(times["jnp"], times["project"]),
                roofline(flops / PEAK_FLOPS * 1e3, times["project"], "FLOP"),
                f"{errors['cuDNN']:.1e} / {errors['jnp']:.1e}",
            )
        )
        print(results[-1], flush=True)

    steps = cases.steps
    for case, sequences, cache_len in cases.decodes():
        if not wanted(case):
            continue
        start = cache_len - steps - 1
        times = {}
        rows, batch = decode_inputs(runner, sequences, start)

        def project_decode_ms():
            caches = [runner.new_caches(sequences, cache_len)]

            def project_decode():
                out, caches[0] = runner.decode(rows, batch, caches[0], key, steps, capacity=steps)
                return out

            return median_wall_ms(project_decode, cases.decode_repeats) / steps

        times["project"] = or_out_of_memory(project_decode_ms)
        tokens = jax.device_put(decode_ids(config.vocab_size, sequences), replicated)
        positions = jax.device_put(np.full(sequences, start, np.int32), replicated)
        for name, (_, _, decode) in baselines.items():

            def baseline_decode_ms(decode=decode):
                holder = [zero_caches(sequences, cache_len)]

                def baseline_decode():
                    out, holder[0] = decode(params, tokens, positions, holder[0], steps)
                    return out

                return median_wall_ms(baseline_decode, cases.decode_repeats) / steps

            times[name] = or_out_of_memory(baseline_decode_ms)
        context = start + steps / 2
        nbytes = weight_bytes_per_gpu(config, tp) + kv_bytes_per_gpu(config, tp, sequences, context)
        results.append(
            (
                label,
                case,
                times["project"],
                times["cuDNN"],
                times["jnp"],
                ratio(times["cuDNN"], times["project"]),
                ratio(times["jnp"], times["project"]),
                roofline(nbytes / hbm_bytes_per_s() * 1e3, times["project"], "HBM"),
                "-",
            )
        )
        print(results[-1], flush=True)


def roofline(floor_ms: float, ms: float | str, unit: str) -> str:
    """`ms` as a percentage of the roofline time `floor_ms` ("-" where it was not measured)."""
    return "-" if isinstance(ms, str) else f"{100 * floor_ms / ms:.0f}% {unit}"


def attention_kernels() -> None:
    """Decode attention alone, one GPU, TP-2-local heads (16 query, 4 kv): cache read rate."""
    print("\n## decode attention kernels (16 query heads, 4 kv heads, head 128, bf16)")
    print("| sequences @ cache | cuDNN per query head | cuDNN grouped | plain jnp |")
    print("|---|---|---|---|")
    rng = jax.random.key(0)
    for sequences, length in ((64, 1024), (64, 8192), (8, 8192)):
        q = jax.random.normal(rng, (sequences, 16, 128), jnp.bfloat16)
        k = jax.random.normal(rng, (sequences, length, 4, 128), jnp.bfloat16)
        v = jax.random.normal(rng, (sequences, length, 4, 128), jnp.bfloat16)
        positions = jnp.full((sequences,), length - 1, jnp.int32)
        lengths = positions + 1
        nbytes = 2 * k.nbytes
        cells = []
        for fn in (
            jax.jit(lambda q, k, v, n: decode_attention_cudnn(q, k, v, n, grouped=False)),
            jax.jit(lambda q, k, v, n: decode_attention_cudnn(q, k, v, n)),
            jax.jit(lambda q, k, v, p: decode_attention(q, k, v, p - 1)),
        ):
            ms = kernel_ms(fn, [(q, k, v, lengths)])
            cells.append(f"{ms * 1e3:.1f} us ({nbytes / ms / 1e9:.2f} TB/s)")
        print(f"| {sequences} @ {length} | " + " | ".join(cells) + " |")


def generate_check(config: DecoderConfig, tp: int, check: GenerateCheck) -> None:
    """generate() per token (the decode part) against the jitted decode loop it calls."""
    topology = bj.Topology(attn_tp=tp)
    mesh = bj.make_mesh(topology)
    runner = ShardedCausalLM(
        build_model(config, topology, BuildOptions(dtype=jnp.bfloat16), mesh=mesh), mesh
    )
    rng = np.random.default_rng(1)
    count, length = check.prompts, check.prompt_tokens
    prompts = [rng.integers(0, config.vocab_size, length).tolist() for _ in range(count)]
    new = check.new_tokens
    repeats = check.repeats
    for n in (1, new):
        runner.generate(prompts, n)  # compile
    one = median_wall_ms(lambda: runner.generate(prompts, 1), repeats)
    full = median_wall_ms(lambda: runner.generate(prompts, new), repeats)
    per_token = (full - one) / (new - 1)
    rows, batch = decode_inputs(runner, count, length)
    caches = [runner.new_caches(count, check.cache)]

    def loop():
        out, caches[0] = runner.decode(
            rows, batch, caches[0], jax.random.key(0), new - 1, capacity=new - 1
        )
        return out

    step = median_wall_ms(loop, repeats) / (new - 1)
    print(
        f"\ngenerate(): {count} prompts of {length} tokens, {config.num_layers} layers TP {tp}: "
        f"{per_token:.3f} ms per new token (generate({new}) - generate(1)) / {new - 1}; "
        f"jitted decode loop at the same shapes {step:.3f} ms per step: "
        f"ratio {per_token / step:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layers", type=int, nargs="+", default=None, help="default: 8 (2 with --smoke)"
    )
    parser.add_argument(
        "--tp",
        type=int,
        nargs="+",
        default=None,
        help=f"default: those of {DEFAULT_TP} that the visible devices hold",
    )
    parser.add_argument("--no-generate", action="store_true")
    parser.add_argument("--kernels", action="store_true", help="decode attention kernels only")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny config and tiny cases (a CPU check, seconds)"
    )
    parser.add_argument(
        "--scan", action="store_true", help="scanned layers in the project and the baselines"
    )
    parser.add_argument(
        "--fusions",
        nargs="+",
        choices=FUSIONS,
        default=["none"],
        help="the project's boundary fusions; several values build one project model each",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        default=None,
        help="only these cases, e.g. 'prefill 4096' 'decode 64 @ 1024' (default: all)",
    )
    parser.add_argument(
        "--quantize",
        choices=("fp8",),
        help="fp8: the project's bf16 step against its FP8 step (benchmarks.bench_fp8, e2e)",
    )
    args = parser.parse_args()
    try:
        cases = (SMOKE_CASES if args.smoke else Cases()).naming(args.cases)
    except ValueError as error:
        parser.error(str(error))
    base = LLAMA3_SMOKE if args.smoke else LLAMA3_8B
    layers_list = args.layers or [base.num_layers if args.smoke else 8]
    if args.quantize == "fp8":
        fp8_args = ["--parts", "e2e", "--layers", str(layers_list[0])]
        fp8_args += ["--smoke"] if args.smoke else []
        bench_fp8.main(fp8_args + (["--cases", *args.cases] if args.cases else []))
        return
    devices = jax.device_count()
    tps = args.tp or [tp for tp in DEFAULT_TP if tp <= devices]
    if max(tps) > devices:
        parser.error(
            f"--tp {max(tps)} needs {max(tps)} devices; JAX sees {devices}. Pass a smaller "
            "--tp, or simulate CPU devices with JAX_NUM_CPU_DEVICES"
        )
    print(header("bench_e2e"))
    left_out = [tp for tp in DEFAULT_TP if tp > devices] if args.tp is None else []
    if left_out:
        print(f"TP {left_out} left out of the default: JAX sees {devices} device(s)")
    if args.kernels:
        attention_kernels()
        return
    results, memory = [], []
    for layers in layers_list:
        for tp in tps:
            config = dataclasses.replace(base, num_layers=layers)
            for fusions in args.fusions:
                gc.collect()  # the previous model and caches hold reference cycles
                run_config(config, tp, results, memory, cases, args.cases, args.scan, fusions)
    print("\n## Llama-3-8B shape, bf16: project vs one-jit GSPMD (ms; ratios are speedups)")
    print_table(
        (
            "model",
            "case",
            "project ms",
            "GSPMD cuDNN ms",
            "GSPMD jnp ms",
            "vs cuDNN",
            "vs jnp",
            "project roofline",
            "logit err cuDNN / jnp",
        ),
        results,
    )
    print("\n" + "\n".join(memory))
    if not args.no_generate:
        generate_check(config, max(tps), SMOKE_GENERATE if args.smoke else GenerateCheck())


if __name__ == "__main__":
    main()
