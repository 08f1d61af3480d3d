"""Whole-model prefill and decode: boundary-jax against one `jax.jit` with GSPMD, and the roofline.

The baseline is the obvious alternative a user writes first: the same Llama model as one jitted
function over global arrays whose `NamedSharding`s are the project's own (the weights are the
project model's placed state, not a copy), with XLA's GSPMD inserting the collectives. It comes in
two forms: plain `jnp` attention within each sequence, and the same attention kernels the project
uses on GPU (cuDNN through `jax.nn.dot_product_attention`), so that "project / GSPMD (same
kernels)" isolates what the boundaries cost or gain. Before any timing, last-row prefill logits
of each baseline are compared with the project's.

Cases (Llama-3-8B shape, bf16, `--layers` layers, TP 1 and 2):
  prefill 512 tokens (1 sequence) and 4096 tokens (8 x 512; packed rows in the project, a
  [8, 512] batch in the baseline), writing the KV cache, greedy token of each last row;
  decode 8 and 64 sequences at cache 1024 and 8192: a jitted loop of `STEPS` greedy steps
  (one program; time per step), each sequence reading about a full cache.
Roofline: decode, weights + KV bytes read per GPU / HBM bandwidth (4.8 TB/s); prefill, matmul +
causal attention FLOPs per GPU / dense bf16 peak (990 TFLOP/s). Times are wall-clock medians of
blocking calls (a decode call runs STEPS steps, so dispatch is amortized).

With `--scan` the project model is built with `scan_layers=True` and both baselines run their
layers (stacked once, a copy) as one `lax.scan`, as a user writing a deep model would. On JAX
0.11.2 a scanned decode step copies each layer's weights out of the stack (RESULTS run 15), so
decode is measured unrolled.

Run on the GPU machine from the repository root:
  python3 -m benchmarks.bench_e2e --layers 8 --tp 1 2
  python3 -m benchmarks.bench_e2e --layers 32 --tp 2 --scan
  python3 -m benchmarks.bench_e2e --layers 32 --quantize fp8   # bf16 vs FP8 (bench_fp8)
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
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj
from models.build import build_model
from models.config import DecoderConfig
from models.inputs.rows import RowsPhase, TokenRows, pack_sequences
from models.layers.attention.cudnn import decode_attention_cudnn
from models.layers.attention.kv_cache import KVCache
from models.layers.attention.rope import apply_rope, rope_inv_freq
from models.layers.attention.self_attention import AttentionImpl
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM
from pallas_kernels import Impl

from .common import LLAMA3_8B, header, median_wall_ms, print_table

# On CPU (a smoke run of this script) cuDNN stands in as XLA's own attention.
KERNEL = "cudnn" if jax.default_backend() == "gpu" else "xla"
HBM_BYTES_PER_S = 4.8e12
PEAK_FLOPS = 990e12
STEPS = 32


# -- the GSPMD baseline: plain Llama over global arrays, one jax.jit --------------------------


def auto_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The same devices and axis names with Auto axes: the GSPMD baseline's mesh."""
    return jax.sharding.Mesh(
        mesh.devices,
        mesh.axis_names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names),
    )


def _rewrap(x: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
    """`x` viewed with the same spec on `mesh` (its device buffers, not a copy)."""
    sharding = NamedSharding(mesh, x.sharding.spec)
    shards = [shard.data for shard in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def split_part(w: jax.Array, index: int) -> jax.Array:
    """Part `index` of a stacked [..., parts, out] projection (the project's k|v and gate|up) as
    a matrix of its own, sharded as the stack's columns: a copy, since a baseline keeps one
    matrix per projection, as a user writes it."""
    spec = (*w.sharding.spec, *(None,) * (w.ndim - len(w.sharding.spec)))
    sharding = NamedSharding(w.sharding.mesh, PartitionSpec(*spec[:-2], spec[-1]))
    return jax.device_put(w[..., index, :], sharding)


def _layer_weights(flat: dict, prefix: tuple) -> dict:
    """One decoder layer's weights by role (stacked on a leading axis for a scanned run)."""
    get = lambda *name: flat[(*prefix, *name)]  # noqa: E731
    kv, gate_up = get("attn", "kv_proj", "kernel"), get("mlp", "gate_up_proj", "kernel")
    return {
        "attn_norm": get("input_norm", "weight"),
        "wq": get("attn", "q_proj", "kernel"),
        "wk": split_part(kv, 0),
        "wv": split_part(kv, 1),
        "wo": get("attn", "o_proj", "kernel"),
        "ffn_norm": get("post_attn_norm", "weight"),
        "wg": split_part(gate_up, 0),
        "wu": split_part(gate_up, 1),
        "wd": get("mlp", "down_proj", "kernel"),
    }


def baseline_params(runner: ShardedCausalLM, mesh: jax.sharding.Mesh, *, scan: bool) -> dict:
    """The project's placed weights, by role, on the Auto-axes `mesh`: the same buffers where
    the layouts agree, and k, v, gate and up each a matrix of its own. `scan`: the layers
    stacked on a leading axis (a copy), for a baseline that runs them as one `lax.scan` as a
    user writing a deep model would; else a list (a scanned project model's runs sliced per
    layer)."""
    flat = {
        path: _rewrap(variable[...], mesh) for path, variable in nnx.to_flat_state(runner.state)
    }
    layers = []
    for index, (block, module) in enumerate(runner.model.blocks()):
        if isinstance(module, bj.StackedLayers):
            run = _layer_weights(flat, ("layers", index, "layer"))
            layers += [{role: w[i] for role, w in run.items()} for i in range(len(block))]
        else:
            layers.append(_layer_weights(flat, ("layers", index)))
    if scan:
        layers = {role: jnp.stack([layer[role] for layer in layers]) for role in layers[0]}
    return {
        "embed": flat[("embed", "embedding")],
        "layers": layers,
        "final_norm": flat[("final_norm", "weight")],
        "lm_head": flat[("lm_head", "kernel")],
    }


def _rms(x, weight, eps):
    xf = x.astype(jnp.float32)
    normed = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def _mlp(layer, x, eps):
    h = _rms(x, layer["ffn_norm"], eps)
    return x + (jax.nn.silu(h @ layer["wg"]) * (h @ layer["wu"])) @ layer["wd"]


def _qkv(layer, h, positions, config):
    """h [R, hidden], positions [R] -> q [R, heads, D], k, v [R, kv heads, D] after RoPE."""
    d = config.head_dim
    inv_freq = rope_inv_freq(d, config.rope_theta, config.rope_scaling)
    q = (h @ layer["wq"]).reshape(h.shape[0], -1, d)
    k = (h @ layer["wk"]).reshape(h.shape[0], -1, d)
    v = (h @ layer["wv"]).reshape(h.shape[0], -1, d)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _logits(params, x, config):
    x = _rms(x, params["final_norm"], config.rms_norm_eps)
    return (x @ params["lm_head"])[..., : config.vocab_size].astype(jnp.float32)


def _causal_jnp(q, k, v):
    """[B, L, H, D] queries, [B, L, K, D] keys/values: causal GQA with float32 scores."""
    b, length, heads, d = q.shape
    q = q.reshape(b, length, k.shape[2], heads // k.shape[2], d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * d**-0.5
    causal = jnp.tril(jnp.ones((length, length), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, length, heads, d).astype(q.dtype)


def _decode_jnp(q, k_cache, v_cache, positions):
    """q [B, H, D] over caches [B, S, K, D], keys 0..positions[b]."""
    b, heads, d = q.shape
    kv = k_cache.shape[2]
    q = q.reshape(b, kv, heads // kv, d)
    scores = jnp.einsum("bkgd,bskd->bkgs", q, k_cache, preferred_element_type=jnp.float32)
    visible = jnp.arange(k_cache.shape[1])[None, :] <= positions[:, None]
    scores = jnp.where(visible[:, None, None, :], scores * d**-0.5, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bkgs,bskd->bkgd", probs, v_cache, preferred_element_type=jnp.float32)
    return out.reshape(b, heads, d).astype(q.dtype)


def _decode_cudnn(q, k_cache, v_cache, positions):
    """The project's own cuDNN decode call (the "same kernels" baseline)."""
    if KERNEL != "cudnn":
        return _decode_jnp(q, k_cache, v_cache, positions)
    return decode_attention_cudnn(q, k_cache, v_cache, (positions + 1).astype(jnp.int32))


def make_baseline(config: DecoderConfig, cudnn: bool, scan: bool = False):
    """(logits of prefill, prefill, decode) jitted over global arrays; caches are donated.
    `scan`: the layers and caches are stacked on a leading axis and run as one `lax.scan`."""
    eps = config.rms_norm_eps

    def over_layers(layer_fn, x, layers, caches):
        """`x, cache = layer_fn(layer, x, cache)` over every layer (caches may be None)."""
        if scan:
            return lax.scan(lambda x, lc: layer_fn(lc[0], x, lc[1]), x, (layers, caches))
        updated = []
        for index, layer in enumerate(layers):
            x, cache = layer_fn(layer, x, None if caches is None else caches[index])
            updated.append(cache)
        return x, None if caches is None else updated

    @jax.jit
    def logits_of_prefill(params, ids):
        """[B, L] ids -> [B, vocab] last-row logits (no cache), for the logits check."""
        return prefill(params, ids, None)[1]

    def prefill(params, ids, caches):
        batch, length = ids.shape
        positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)
        x = params["embed"][ids.reshape(-1)]

        def layer_fn(layer, x, cache):
            h = _rms(x, layer["attn_norm"], eps)
            q, k, v = _qkv(layer, h, positions, config)
            q, k, v = (a.reshape(batch, length, *a.shape[1:]) for a in (q, k, v))
            if cache is not None:
                k_cache, v_cache = cache
                k_cache = lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, 0, 0, 0))
                v_cache = lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, 0, 0, 0))
                cache = (k_cache, v_cache)
            if cudnn:
                out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=KERNEL)
            else:
                out = _causal_jnp(q, k, v)
            x = x + out.reshape(batch * length, -1) @ layer["wo"]
            return _mlp(layer, x, eps), cache

        x, updated = over_layers(layer_fn, x, params["layers"], caches)
        last = x.reshape(batch, length, -1)[:, -1]
        logits = _logits(params, last, config)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, updated

    def prefill_step(params, ids, caches):
        tokens, _, caches = prefill(params, ids, caches)
        return tokens, caches

    attend = _decode_cudnn if cudnn else _decode_jnp

    def decode(params, tokens, positions, caches, steps):
        rows = jnp.arange(tokens.shape[0])

        def step(_, carry):
            tokens, positions, caches = carry
            x = params["embed"][tokens]

            def layer_fn(layer, x, cache):
                h = _rms(x, layer["attn_norm"], eps)
                q, k, v = _qkv(layer, h, positions, config)
                k_cache = cache[0].at[rows, positions].set(k.astype(cache[0].dtype))
                v_cache = cache[1].at[rows, positions].set(v.astype(cache[1].dtype))
                out = attend(q, k_cache, v_cache, positions)
                x = x + out.reshape(x.shape[0], -1) @ layer["wo"]
                return _mlp(layer, x, eps), (k_cache, v_cache)

            x, caches = over_layers(layer_fn, x, params["layers"], caches)
            tokens = jnp.argmax(_logits(params, x, config), axis=-1).astype(jnp.int32)
            return tokens, positions + 1, caches

        caches = caches if scan else list(caches)
        tokens, _, caches = lax.fori_loop(0, steps, step, (tokens, positions, caches))
        return tokens, caches

    return (
        logits_of_prefill,
        jax.jit(prefill_step, donate_argnums=(2,)),
        jax.jit(decode, static_argnums=4, donate_argnums=3),
    )


# -- timing and the roofline ---------------------------------------------------------------


def weight_bytes_per_gpu(config: DecoderConfig, tp: int) -> float:
    """Bytes of the weights a decode step reads per GPU (bf16; the embedding reads few rows)."""
    h, d = config.hidden_size, config.head_dim
    attn = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)
    mlp = 3 * h * config.intermediate_size
    return 2 * (config.num_layers * (attn + mlp) + h * config.vocab_size) / tp


def kv_bytes_per_gpu(config: DecoderConfig, tp: int, sequences: int, context: float) -> float:
    per_token = 2 * 2 * config.num_kv_heads * config.head_dim * config.num_layers / tp
    return sequences * context * per_token


def prefill_flops_per_gpu(config: DecoderConfig, tp: int, sequences: int, length: int) -> float:
    h, d = config.hidden_size, config.head_dim
    params = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)
    params += 3 * h * config.intermediate_size
    tokens = sequences * length
    matmul = 2 * tokens * params * config.num_layers
    causal = 2 * 2 * config.num_heads * d * sequences * length * (length + 1) / 2
    head = 2 * sequences * h * config.vocab_size
    return (matmul + causal * config.num_layers + head) / tp


# -- the cases -------------------------------------------------------------------------------


def _decode_inputs(runner: ShardedCausalLM, sequences: int, start: int):
    """Placed DECODE rows: `sequences` slots at position `start`, and their batch facts."""
    slots = sequences // runner.topology.attn_dp
    ids = np.zeros(sequences, np.int32)
    positions = np.full(sequences, start, np.int32)
    segments = np.tile(np.arange(slots, dtype=np.int32), runner.topology.attn_dp)
    rows = TokenRows(
        runner.place_array(ids),
        runner.place_array(positions),
        runner.place_array(segments),
        RowsPhase.DECODE,
    )
    return rows, runner.place_batch(np.full(runner.topology.attn_dp, slots, np.int32))


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
    cases: list[str] | None = None,
    scan: bool = False,
    fusions: str = "none",
) -> None:
    wanted = lambda case: cases is None or case in cases  # noqa: E731
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
    cache_spec = KVCache.partition_spec(topology)
    cache_spec = NamedSharding(gspmd, PartitionSpec(None, *cache_spec) if scan else cache_spec)
    replicated = NamedSharding(gspmd, PartitionSpec())
    key = jax.device_put(jax.random.key(0), NamedSharding(mesh, PartitionSpec()))
    label = f"{config.num_layers}L TP{tp}" + ("" if fusions == "none" else f" fusions {fusions}")

    def zero_caches(slots, length):
        shape = KVCache.global_shape(config, topology, slots=slots, max_len=length)
        if scan:
            shape = (config.num_layers, *shape)
            zeros = lambda: jnp.zeros(shape, jnp.bfloat16, device=cache_spec)  # noqa: E731
            return (zeros(), zeros())
        return [
            (
                jnp.zeros(shape, jnp.bfloat16, device=cache_spec),
                jnp.zeros(shape, jnp.bfloat16, device=cache_spec),
            )
            for _ in range(config.num_layers)
        ]

    for sequences in (1, 8):
        length = 512
        if not wanted(f"prefill {sequences * length}"):
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
        caches = [runner.new_caches(packed.decode_rows_per_rank, length)]

        def project_prefill():
            tokens, caches[0] = runner.prefill(rows, batch, caches[0], last_rows, key)
            return tokens

        times["project"] = median_wall_ms(project_prefill)
        del caches[0]
        for name, (_, step, _) in baselines.items():
            holder = [zero_caches(sequences, length)]

            def baseline_prefill(step=step, holder=holder):
                tokens, holder[0] = step(params, ids, holder[0])
                return tokens

            times[name] = median_wall_ms(baseline_prefill)
            del holder[0]
        flops = prefill_flops_per_gpu(config, tp, sequences, length)
        roof = flops / PEAK_FLOPS * 1e3
        results.append(
            (
                label,
                f"prefill {sequences * length}",
                times["project"],
                times["cuDNN"],
                times["jnp"],
                times["cuDNN"] / times["project"],
                times["jnp"] / times["project"],
                f"{100 * roof / times['project']:.0f}% FLOP",
                f"{errors['cuDNN']:.1e} / {errors['jnp']:.1e}",
            )
        )
        print(results[-1], flush=True)

    for cache_len in (1024, 8192):
        for sequences in (8, 64):
            if not wanted(f"decode {sequences} @ {cache_len}"):
                continue
            start = cache_len - STEPS - 1
            times = {}
            rows, batch = _decode_inputs(runner, sequences, start)
            caches = [runner.new_caches(sequences, cache_len)]

            def project_decode():
                out, caches[0] = runner.decode(rows, batch, caches[0], key, STEPS, capacity=STEPS)
                return out

            times["project"] = median_wall_ms(project_decode, repeats=5) / STEPS
            del caches[0]
            tokens = jax.device_put(np.zeros(sequences, np.int32), replicated)
            positions = jax.device_put(np.full(sequences, start, np.int32), replicated)
            for name, (_, _, decode) in baselines.items():
                holder = [zero_caches(sequences, cache_len)]

                def baseline_decode(decode=decode, holder=holder):
                    out, holder[0] = decode(params, tokens, positions, holder[0], STEPS)
                    return out

                times[name] = median_wall_ms(baseline_decode, repeats=5) / STEPS
                del holder[0]
            context = start + STEPS / 2
            nbytes = weight_bytes_per_gpu(config, tp) + kv_bytes_per_gpu(
                config, tp, sequences, context
            )
            roof = nbytes / HBM_BYTES_PER_S * 1e3
            results.append(
                (
                    label,
                    f"decode {sequences} @ {cache_len}",
                    times["project"],
                    times["cuDNN"],
                    times["jnp"],
                    times["cuDNN"] / times["project"],
                    times["jnp"] / times["project"],
                    f"{100 * roof / times['project']:.0f}% HBM",
                    "-",
                )
            )
            print(results[-1], flush=True)


def attention_kernels() -> None:
    """Decode attention alone, one GPU, TP-2-local heads (16 query, 4 kv): cache read rate."""
    from .common import kernel_ms

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
            jax.jit(lambda q, k, v, p: _decode_jnp(q, k, v, p - 1)),
        ):
            ms = kernel_ms(fn, [(q, k, v, lengths)])
            cells.append(f"{ms * 1e3:.1f} us ({nbytes / ms / 1e9:.2f} TB/s)")
        print(f"| {sequences} @ {length} | " + " | ".join(cells) + " |")


def generate_check(config: DecoderConfig, tp: int) -> None:
    """generate() per token (the decode part) against the jitted decode loop it calls."""
    topology = bj.Topology(attn_tp=tp)
    mesh = bj.make_mesh(topology)
    runner = ShardedCausalLM(
        build_model(config, topology, BuildOptions(dtype=jnp.bfloat16), mesh=mesh), mesh
    )
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, 64).tolist() for _ in range(64)]
    new = 129
    for n in (1, new):
        runner.generate(prompts, n)  # compile
    one = median_wall_ms(lambda: runner.generate(prompts, 1), repeats=3)
    full = median_wall_ms(lambda: runner.generate(prompts, new), repeats=3)
    per_token = (full - one) / (new - 1)
    rows, batch = _decode_inputs(runner, 64, 64)
    caches = [runner.new_caches(64, 256)]

    def loop():
        out, caches[0] = runner.decode(
            rows, batch, caches[0], jax.random.key(0), new - 1, capacity=128
        )
        return out

    step = median_wall_ms(loop, repeats=3) / (new - 1)
    print(
        f"\ngenerate(): 64 prompts of 64 tokens, {config.num_layers} layers TP {tp}: "
        f"{per_token:.3f} ms per new token (generate({new}) - generate(1)) / {new - 1}; "
        f"jitted decode loop at the same shapes {step:.3f} ms per step: "
        f"ratio {per_token / step:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[8])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-generate", action="store_true")
    parser.add_argument("--kernels", action="store_true", help="decode attention kernels only")
    parser.add_argument("--smoke", action="store_true", help="a tiny config (CPU check)")
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
    if args.quantize == "fp8":
        from . import bench_fp8  # it imports this module's helpers

        fp8_args = ["--parts", "e2e", "--layers", str(args.layers[0])]
        fp8_args += ["--smoke"] if args.smoke else []
        bench_fp8.main(fp8_args + (["--cases", *args.cases] if args.cases else []))
        return
    print(header("bench_e2e"))
    if args.kernels:
        attention_kernels()
        return
    results, memory = [], []
    for layers in args.layers:
        for tp in args.tp:
            config = dataclasses.replace(LLAMA3_8B, num_layers=layers)
            if args.smoke:
                config = dataclasses.replace(
                    config,
                    vocab_size=512,
                    hidden_size=128,
                    intermediate_size=256,
                    num_heads=4,
                    num_kv_heads=2,
                    head_dim=32,
                )
            for fusions in args.fusions:
                gc.collect()  # the previous model and caches hold reference cycles
                run_config(config, tp, results, memory, args.cases, args.scan, fusions)
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
        generate_check(config, max(args.tp))


if __name__ == "__main__":
    main()
