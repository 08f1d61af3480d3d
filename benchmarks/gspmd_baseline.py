"""The GSPMD baseline: the project's Llama as plain `jnp` over global arrays, one `jax.jit`.

The obvious alternative a user writes first: the same model as one jitted function over global
arrays whose `NamedSharding`s are the project's own (the weights are the project model's placed
state, viewed on a mesh of Auto axes), with XLA's GSPMD inserting the collectives. `bench_e2e`
times its prefill and decode, `bench_train` its train step (from the same layer pieces),
`profile_e2e` its kernels; `bench_deepseek` and `bench_gpt_oss` reuse the mesh and array helpers
and time their own baselines' cases with `compare_with_baseline`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj
from models.config import DecoderConfig
from models.inputs.rows import pack_sequences
from models.layers.attention.cudnn import decode_attention_cudnn
from models.layers.attention.kv_cache import KVCache
from models.layers.attention.rope import apply_rope, rope_inv_freq
from models.serving.runtime import ShardedCausalLM

from .common import attention_kernel, decode_ids, decode_inputs, paired_wall_ms, relative_error

# -- the project's placed state, seen by a GSPMD program ------------------------------------


def auto_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The same devices and axis names with Auto axes: the GSPMD baseline's mesh."""
    return jax.sharding.Mesh(
        mesh.devices,
        mesh.axis_names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names),
    )


def rewrap(x: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
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
    flat = {path: rewrap(variable[...], mesh) for path, variable in nnx.to_flat_state(runner.state)}
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


def path_params(runner: ShardedCausalLM, mesh: jax.sharding.Mesh) -> dict:
    """The project's placed weights on the Auto-axes `mesh` (the same buffers): the embedding,
    final norm and LM head, and each layer's weights by their path inside the layer
    ("attn/q_proj/kernel"), for baselines of families whose layers `baseline_params` does not
    know."""
    flat = {path: rewrap(v[...], mesh) for path, v in nnx.to_flat_state(runner.state)}
    layers = [
        {
            "/".join(str(key) for key in path[2:]): value
            for path, value in flat.items()
            if path[:2] == ("layers", index)
        }
        for index in range(runner.config.num_layers)
    ]
    return {
        "embed": flat[("embed", "embedding")],
        "layers": layers,
        "final_norm": flat[("final_norm", "weight")],
        "lm_head": flat[("lm_head", "kernel")],
    }


def baseline_caches(
    config: DecoderConfig,
    topology: bj.Topology,
    mesh: jax.sharding.Mesh,
    *,
    slots: int,
    length: int,
    scan: bool,
):
    """Zero bf16 (k, v) caches for `make_baseline`'s programs on the Auto-axes `mesh`, sharded
    as the project's: one pair per layer, or with `scan` one pair stacked over the layers."""
    spec = KVCache.partition_spec(topology)
    sharding = NamedSharding(mesh, PartitionSpec(None, *spec) if scan else spec)
    shape = KVCache.global_shape(config, topology, slots=slots, max_len=length)
    if scan:
        shape = (config.num_layers, *shape)
    zeros = lambda: jnp.zeros(shape, jnp.bfloat16, device=sharding)  # noqa: E731
    if scan:
        return (zeros(), zeros())
    return [(zeros(), zeros()) for _ in range(config.num_layers)]


# -- the layer pieces, plain jnp ------------------------------------------------------------


def rms_norm(x, weight, eps):
    """RMSNorm in float32, back in `x`'s dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def mlp_residual(layer, x, eps):
    """x + the layer's SwiGLU MLP of its normed `x` (weights by `_layer_weights`' roles)."""
    h = rms_norm(x, layer["ffn_norm"], eps)
    return x + (jax.nn.silu(h @ layer["wg"]) * (h @ layer["wu"])) @ layer["wd"]


def qkv(layer, h, positions, config: DecoderConfig):
    """h [R, hidden], positions [R] -> q [R, heads, D], k, v [R, kv heads, D] after RoPE."""
    d = config.head_dim
    inv_freq = rope_inv_freq(d, config.rope_theta, config.rope_scaling)
    q = (h @ layer["wq"]).reshape(h.shape[0], -1, d)
    k = (h @ layer["wk"]).reshape(h.shape[0], -1, d)
    v = (h @ layer["wv"]).reshape(h.shape[0], -1, d)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def causal_attention(q, k, v):
    """[B, L, H, D] queries, [B, L, K, D] keys/values: causal GQA with float32 scores."""
    b, length, heads, d = q.shape
    q = q.reshape(b, length, k.shape[2], heads // k.shape[2], d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * d**-0.5
    causal = jnp.tril(jnp.ones((length, length), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, length, heads, d).astype(q.dtype)


def decode_attention(q, k_cache, v_cache, positions):
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


def _decode_attention_kernel(q, k_cache, v_cache, positions):
    """The project's own cuDNN decode call (the "same kernels" baseline); plain jnp off GPU."""
    if attention_kernel() != "cudnn":
        return decode_attention(q, k_cache, v_cache, positions)
    return decode_attention_cudnn(q, k_cache, v_cache, (positions + 1).astype(jnp.int32))


def _logits(params, x, config):
    x = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    return (x @ params["lm_head"])[..., : config.vocab_size].astype(jnp.float32)


# -- the programs ---------------------------------------------------------------------------


def make_baseline(config: DecoderConfig, cudnn: bool, scan: bool = False):
    """(logits of prefill, prefill, decode) jitted over global arrays; caches are donated.

    `cudnn`: the project's attention kernels (cuDNN on GPU; XLA's own attention on CPU), else
    plain `jnp` attention. `scan`: the layers and caches are stacked on a leading axis and run
    as one `lax.scan`.
    """
    eps = config.rms_norm_eps
    kernel = attention_kernel()

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
            h = rms_norm(x, layer["attn_norm"], eps)
            q, k, v = qkv(layer, h, positions, config)
            q, k, v = (a.reshape(batch, length, *a.shape[1:]) for a in (q, k, v))
            if cache is not None:
                k_cache, v_cache = cache
                k_cache = lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, 0, 0, 0))
                v_cache = lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, 0, 0, 0))
                cache = (k_cache, v_cache)
            if cudnn:
                out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=kernel)
            else:
                out = causal_attention(q, k, v)
            x = x + out.reshape(batch * length, -1) @ layer["wo"]
            return mlp_residual(layer, x, eps), cache

        x, updated = over_layers(layer_fn, x, params["layers"], caches)
        last = x.reshape(batch, length, -1)[:, -1]
        logits = _logits(params, last, config)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, updated

    def prefill_step(params, ids, caches):
        tokens, _, caches = prefill(params, ids, caches)
        return tokens, caches

    attend = _decode_attention_kernel if cudnn else decode_attention

    def decode(params, tokens, positions, caches, steps):
        rows = jnp.arange(tokens.shape[0])

        def step(_, carry):
            tokens, positions, caches = carry
            x = params["embed"][tokens]

            def layer_fn(layer, x, cache):
                h = rms_norm(x, layer["attn_norm"], eps)
                q, k, v = qkv(layer, h, positions, config)
                k_cache = cache[0].at[rows, positions].set(k.astype(cache[0].dtype))
                v_cache = cache[1].at[rows, positions].set(v.astype(cache[1].dtype))
                out = attend(q, k_cache, v_cache, positions)
                x = x + out.reshape(x.shape[0], -1) @ layer["wo"]
                return mlp_residual(layer, x, eps), (k_cache, v_cache)

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


@dataclasses.dataclass(frozen=True)
class JitBaseline:
    """The same model as one `jax.jit` over global arrays, for `compare_with_baseline`.

    Attributes:
      params: Its weights (the project's buffers, on an Auto-axes mesh).
      logits_of: `(params, ids [S, L]) -> logits [S, vocab]` of each sequence's last row.
      prefill: `(params, ids, caches) -> (tokens, caches)`: writes the caches, samples each last
        row (its caches donated).
      decode: `(params, tokens [S], positions [S], caches, steps) -> (tokens, caches)`: `steps`
        greedy steps in one jitted loop (its caches donated).
      zero_caches: `(sequences, length) -> caches` for `length` positions.
    """

    params: dict
    logits_of: Callable
    prefill: Callable
    decode: Callable
    zero_caches: Callable[[int, int], object]


def compare_with_baseline(
    runner: ShardedCausalLM,
    baseline: JitBaseline,
    *,
    prefills: Sequence[tuple[int, int]],
    decodes: Sequence[int],
    cache: int,
    steps: int,
    repeats: int,
    prefill_roof_ms: Callable[[int, int], float],
    decode_roof_ms: Callable[[int, float], float],
    label: str = "",
) -> list[tuple]:
    """Times the project's prefill and decode against `baseline`'s, case by case (in turn, as
    `paired_wall_ms` does), and returns table rows: (case, project ms, baseline ms, ratio,
    project's share of the roofline, last-row logit error of the prefill).

    Prefills are (sequences, length) of random prompts, into caches of at least `length`
    positions; decodes are `steps` greedy steps of that many sequences ending near `cache`
    (times per step). `prefill_roof_ms(sequences, length)` and `decode_roof_ms(sequences,
    context)` give the roofline times; `label` names the variant in the profiles.
    """
    replicated = NamedSharding(auto_mesh(runner.mesh), PartitionSpec())
    key = jax.device_put(jax.random.key(0), NamedSharding(runner.mesh, PartitionSpec()))
    prefix = f"{label} " if label else ""
    rng = np.random.default_rng(0)
    results = []
    for sequences, length in prefills:
        prompts = rng.integers(0, runner.config.vocab_size, (sequences, length)).astype(np.int32)
        times, error = _time_prefill(
            runner, baseline, jax.device_put(prompts, replicated), key, cache, repeats, prefix
        )
        roof = prefill_roof_ms(sequences, length)
        results.append(
            (
                f"prefill {sequences} x {length}",
                *times,
                times[1] / times[0],
                f"{100 * roof / times[0]:.0f}% FLOP",
                f"{error:.1e}",
            )
        )
        print(results[-1], flush=True)
    for sequences in decodes:
        start = cache - steps - 1
        times = _time_decode(
            runner, baseline, sequences, start, replicated, key, (cache, steps), repeats, prefix
        )
        roof = decode_roof_ms(sequences, start + steps / 2)
        results.append(
            (
                f"decode {sequences} @ {cache}",
                *times,
                times[1] / times[0],
                f"{100 * roof / times[0]:.0f}% HBM",
                "-",
            )
        )
        print(results[-1], flush=True)
    return results


def _time_prefill(runner, baseline, ids, key, cache, repeats, prefix):
    """(project ms, baseline ms) of a prefill of the prompts `ids` [S, L], and the relative
    error of the baseline's last-row logits against the project's forward."""
    sequences, length = ids.shape
    packed = pack_sequences(list(np.asarray(ids)), runner.topology, max_sequence_rows=length)
    rows, batch = runner.place(packed)
    last_rows = runner.place_array(packed.last_row_index())
    want = np.asarray(runner.forward_placed(rows, batch))[packed.last_row_index()]
    error = relative_error(baseline.logits_of(baseline.params, ids), want)
    positions = max(cache, length)
    holder = [
        runner.new_caches(packed.decode_rows_per_rank, positions),
        baseline.zero_caches(sequences, positions),
    ]

    def project():
        tokens, holder[0] = runner.prefill(rows, batch, holder[0], last_rows, key)
        return tokens

    def jitted():
        tokens, holder[1] = baseline.prefill(baseline.params, ids, holder[1])
        return tokens

    labels = [f"{who} {prefix}prefill {sequences}x{length}" for who in ("project", "gspmd")]
    return paired_wall_ms([project, jitted], repeats, labels=labels), error


def _time_decode(runner, baseline, sequences, start, replicated, key, shape, repeats, prefix):
    """(project ms, baseline ms) per step of `steps` greedy decode steps of `sequences` from
    position `start`, over caches of `cache` positions (`shape` = (cache, steps))."""
    cache, steps = shape
    rows, batch = decode_inputs(runner, sequences, start)
    holder = [runner.new_caches(sequences, cache), baseline.zero_caches(sequences, cache)]
    tokens = jax.device_put(decode_ids(runner.config.vocab_size, sequences), replicated)
    positions = jax.device_put(np.full(sequences, start, np.int32), replicated)

    def project():
        out, holder[0] = runner.decode(rows, batch, holder[0], key, steps, capacity=steps)
        return out

    def jitted():
        out, holder[1] = baseline.decode(baseline.params, tokens, positions, holder[1], steps)
        return out

    labels = [f"{who} {prefix}decode {sequences}" for who in ("project", "gspmd")]
    return [ms / steps for ms in paired_wall_ms([project, jitted], repeats, labels=labels)]
