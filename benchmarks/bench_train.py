"""Train-step throughput: boundary-jax's `Trainer` against one `jax.jit` train step with GSPMD.

Both steps train the same Llama-3-8B-shaped model (`--layers` layers, bf16 weights and AdamW
state, random weights) on the same packed batch (`--sequences` x `--length` tokens) with the
same optax optimizer (global-norm clipping, AdamW, warmup + cosine): the project's step runs the
forward inside `shard_map` through the boundaries and its loss on the vocab-parallel logits; the
baseline is the obvious alternative a user writes first: the same model as plain `jnp` over
global arrays sharded as the project's (`NamedSharding`), its collectives inserted by GSPMD, the
loss a `log_softmax` of the full logits. Attention is plain `jnp` in both (`--attention`).
Before timing, the two steps' first losses are compared. The project packs the batch with
`max_sequence_rows=--length`, so its attention scores each block of rows against the keys within
one sequence's reach; `--unbounded` packs without it (every pair of packed rows scored).

Reported per step: wall-clock median (a blocking call: each step waits for the previous), tokens
per second, and MFU: model FLOPs (6 x matmul parameters x tokens, plus causal attention
12 x layers x tokens x length / 2 x heads x head_dim) over time x GPUs x 990 TFLOP/s (dense bf16).

Run on the GPU machine from the repository root:
  python3 -m benchmarks.bench_train --layers 4 --tp 2
  python3 -m benchmarks.bench_train --smoke   # CPU check: small-llama, 2 layers, 2 x 32 tokens
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj
from models.build import build_model
from models.config import PRESETS, DecoderConfig
from models.layers.attention.self_attention import AttentionImpl
from models.options import BuildOptions
from models.training.trainer import TrainConfig, Trainer, state_shardings

from .common import LLAMA3_8B, PEAK_FLOPS, attention_kernel, header, print_table
from .gspmd_baseline import (
    auto_mesh,
    causal_attention,
    mlp_residual,
    qkv,
    rewrap,
    rms_norm,
    split_part,
)


def train_flops(config: DecoderConfig, sequences: int, length: int) -> float:
    """Model FLOPs of one train step (forward + backward = 3 x forward), all GPUs together."""
    d, heads, kv = config.hidden_size, config.num_heads, config.num_kv_heads
    per_layer = d * config.head_dim * (heads + 2 * kv) + heads * config.head_dim * d
    per_layer += 3 * d * config.intermediate_size
    matmul_params = config.num_layers * per_layer + d * config.vocab_size  # + LM head
    tokens = sequences * length
    attention = 2 * 2 * config.num_layers * tokens * (length / 2) * heads * config.head_dim
    return 3 * (2 * matmul_params * tokens + attention)


def llama_shaped(config: DecoderConfig) -> bool:
    """Whether the GSPMD baseline (a plain Llama) computes the same model as `config`."""
    shape = (
        "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
        "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
        "max_position_embeddings",
    )  # fmt: skip
    return config == dataclasses.replace(LLAMA3_8B, **{f: getattr(config, f) for f in shape})


def separate_projections(params: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The project's parameters with its stacked k|v and gate|up projections as one matrix
    each (`attn.{k,v}_proj.kernel`, `mlp.{gate,up}_proj.kernel`), as the baseline trains them."""
    stacks = {
        "attn.kv_proj": ("attn.k_proj", "attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    }
    out = {}
    for path, value in params.items():
        stack = next((s for s in stacks if path.endswith(f"{s}.kernel")), None)
        if stack is None:
            out[path] = value
            continue
        for index, name in enumerate(stacks[stack]):
            out[path.replace(stack, name)] = split_part(value, index)
    return out


def make_baseline(
    config: DecoderConfig, optimizer: optax.GradientTransformation, shardings, kernel: str
):
    """The GSPMD train step: (params, opt_state, ids [B, L], labels [B, L]) -> same, loss."""
    eps = config.rms_norm_eps
    layers = config.num_layers

    def loss_fn(params, ids, labels):
        batch, length = ids.shape
        positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)
        x = params["embed.embedding"][ids.reshape(-1)]
        for index in range(layers):
            layer = {
                "attn_norm": params[f"layers.{index}.input_norm.weight"],
                "wq": params[f"layers.{index}.attn.q_proj.kernel"],
                "wk": params[f"layers.{index}.attn.k_proj.kernel"],
                "wv": params[f"layers.{index}.attn.v_proj.kernel"],
                "wo": params[f"layers.{index}.attn.o_proj.kernel"],
                "ffn_norm": params[f"layers.{index}.post_attn_norm.weight"],
                "wg": params[f"layers.{index}.mlp.gate_proj.kernel"],
                "wu": params[f"layers.{index}.mlp.up_proj.kernel"],
                "wd": params[f"layers.{index}.mlp.down_proj.kernel"],
            }
            h = rms_norm(x, layer["attn_norm"], eps)
            q, k, v = qkv(layer, h, positions, config)
            q, k, v = (a.reshape(batch, length, *a.shape[1:]) for a in (q, k, v))
            if kernel == "cudnn":
                out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=kernel)
            else:
                out = causal_attention(q, k, v)
            x = x + out.reshape(batch * length, -1) @ layer["wo"]
            x = mlp_residual(layer, x, eps)
        x = rms_norm(x, params["final_norm.weight"], eps)
        logits = (x @ params["lm_head.kernel"])[:, : config.vocab_size].astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        flat = labels.reshape(-1)
        picked = jnp.take_along_axis(log_probs, jnp.maximum(flat, 0)[:, None], axis=1)[:, 0]
        mask = flat >= 0
        return -jnp.sum(jnp.where(mask, picked, 0)) / jnp.maximum(jnp.sum(mask), 1)

    def step(params, opt_state, ids, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1), out_shardings=(shardings[0], shardings[1], None))


def timed(call, steps: int) -> float:
    """Median wall-clock ms of `steps` blocking calls of `call()` (after two warmup calls)."""
    for _ in range(2):
        jax.block_until_ready(call())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(
    base: DecoderConfig,
    layers: int,
    tp: int,
    sequences: int,
    length: int,
    steps: int,
    kernel: str,
    unbounded: bool = False,
) -> dict:
    config = dataclasses.replace(base, num_layers=layers)
    topology = bj.Topology(attn_tp=tp)
    mesh = bj.make_mesh(topology)
    optimizer = TrainConfig(learning_rate=1e-4, total_steps=1000, warmup_steps=10).optimizer()
    start = time.perf_counter()
    attention = AttentionImpl.CUDNN if kernel == "cudnn" else AttentionImpl.XLA
    model = build_model(
        config, topology, BuildOptions(dtype=jnp.bfloat16, attention=attention), mesh=mesh
    )
    trainer = Trainer(model, mesh, optimizer)
    del model
    print(f"  project: built and placed in {time.perf_counter() - start:.1f}s")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (sequences, length)).astype(np.int32)
    batch = trainer.pack(list(ids), max_sequence_rows=None if unbounded else length)
    labels = np.concatenate([ids[:, 1:], np.full((sequences, 1), -1, np.int32)], axis=1)

    # The baseline's own copy of the weights (the project's are donated each step).
    gspmd = auto_mesh(mesh)
    params = separate_projections(
        {k: rewrap(jnp.copy(v), gspmd) for k, v in trainer.state.params.items()}
    )
    param_shardings = {k: NamedSharding(gspmd, v.sharding.spec) for k, v in params.items()}
    replicated = NamedSharding(gspmd, PartitionSpec())
    opt_shardings = state_shardings(optimizer, params, param_shardings, replicated)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    baseline = make_baseline(config, optimizer, (param_shardings, opt_shardings), kernel)
    data = (jax.device_put(ids, replicated), jax.device_put(labels, replicated))

    start = time.perf_counter()
    first = trainer.step(batch)["loss"]
    print(f"  project: first step (compile) {time.perf_counter() - start:.1f}s, loss {first:.4f}")
    start = time.perf_counter()
    params, opt_state, base_first = baseline(params, opt_state, *data)
    print(
        f"  gspmd: first step (compile) {time.perf_counter() - start:.1f}s, loss {base_first:.4f}"
    )
    holder = {"params": params, "opt": opt_state}

    def baseline_step():
        holder["params"], holder["opt"], loss = baseline(holder["params"], holder["opt"], *data)
        return loss

    project_ms = timed(lambda: trainer.step(batch), steps)
    baseline_ms = timed(baseline_step, steps)
    tokens = sequences * length
    flops = train_flops(config, sequences, length)
    return {
        "attention": kernel,
        "project key reach": "all rows" if unbounded else f"{length} rows",
        "layers": layers,
        "tp": tp,
        "tokens/step": tokens,
        "first loss project": round(first, 4),
        "first loss gspmd": round(float(base_first), 4),
        "project ms": round(project_ms, 2),
        "gspmd ms": round(baseline_ms, 2),
        "project / gspmd speed": round(baseline_ms / project_ms, 3),
        "project tokens/s": round(tokens / project_ms * 1e3),
        "gspmd tokens/s": round(tokens / baseline_ms * 1e3),
        "project MFU": round(flops / (project_ms * 1e-3 * tp * PEAK_FLOPS), 3),
        "gspmd MFU": round(flops / (baseline_ms * 1e-3 * tp * PEAK_FLOPS), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--tp", type=int, nargs="+", default=None, help="default: 2 (with --smoke, 2 if it fits)"
    )
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--preset",
        choices=sorted(name for name, preset in PRESETS.items() if llama_shaped(preset)),
        help="a small Llama preset in place of Llama-3-8B (smoke); the baseline is a plain Llama",
    )
    parser.add_argument(
        "--attention",
        choices=("platform", "xla"),
        default="xla",
        help="xla (default): plain jnp attention in both steps; platform: cuDNN on GPU, which "
        "the project's Trainer rejects (see RESULTS.md run 10)",
    )
    parser.add_argument(
        "--unbounded",
        action="store_true",
        help="pack without max_sequence_rows: the project's attention scores every pair of the "
        "packed rows (as before the bound existed)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a CPU check that the script runs: small-llama (or --preset), 2 layers, 2 x 32 "
        "tokens, 2 steps (in place of --layers, --sequences, --length, --steps)",
    )
    args = parser.parse_args()
    devices = jax.device_count()
    if args.smoke:
        args.preset = args.preset or "small-llama"
        args.layers, args.sequences, args.length, args.steps = 2, 2, 32, 2
    args.tp = args.tp or [min(2, devices) if args.smoke else 2]
    if max(args.tp) > devices:
        parser.error(
            f"--tp {max(args.tp)} needs {max(args.tp)} devices; JAX sees {devices}. Pass a "
            "smaller --tp, or simulate CPU devices with JAX_NUM_CPU_DEVICES"
        )
    kernel = attention_kernel() if args.attention == "platform" else "xla"
    base = LLAMA3_8B if args.preset is None else PRESETS[args.preset]
    name = "Llama-3-8B shape" if args.preset is None else args.preset
    print(header(f"bench_train: {name}, {args.layers} layers, bf16, AdamW"))
    rows = []
    for tp in args.tp:
        print(f"TP {tp}:")
        rows.append(
            run(
                base,
                args.layers,
                tp,
                args.sequences,
                args.length,
                args.steps,
                kernel,
                args.unbounded,
            )
        )
    print_table(list(rows[0]), [list(row.values()) for row in rows])


if __name__ == "__main__":
    main()
