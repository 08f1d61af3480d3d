"""Decode under attention context parallelism keeps the KV cache where a CP prefill wrote it:
each CP rank's shard holds the keys of its own positions, decode rows attend to every shard
through one merge, and new tokens land on the CP rank that owns their position. Greedy tokens,
logits and the cache contents equal one device's (CP 2 and 4, both attention modes, with
attention TP and attention DP)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import boundary_jax as bj
from models.build import build_model
from models.config import PRESETS
from models.distributed import fetch
from models.inputs.rows import decode_rows
from models.layers.attention.context_parallel import CpAttentionMode
from models.layers.attention.kv_cache import KVCache
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

CONFIGS = {
    name: dataclasses.replace(PRESETS[name], num_layers=1)
    for name in ("tiny-qwen3", "tiny-mistral")
}
"""tiny-mistral attends within a sliding window of 16 positions."""
CONFIG = CONFIGS["tiny-qwen3"]
LENGTHS = (13, 3, 22, 7)
"""Ragged prompts: one (3 tokens) shorter than 2C zigzag chunks at CP 2 and 4."""
NEW_TOKENS = 6
TOL = 1e-5
G, R = CpAttentionMode.ALL_GATHER, CpAttentionMode.RING


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in LENGTHS]


@functools.cache
def runner(
    dp: int, cp: int, tp: int, mode: CpAttentionMode, preset: str = "tiny-qwen3"
) -> ShardedCausalLM:
    topology = bj.Topology(attn_dp=dp, attn_cp=cp, attn_tp=tp)
    mesh = bj.make_mesh(topology)
    model = build_model(CONFIGS[preset], topology, BuildOptions(cp_attention=mode), mesh=mesh)
    return ShardedCausalLM(model, mesh)


@functools.cache
def served(
    dp: int, cp: int, tp: int, mode: CpAttentionMode, preset: str = "tiny-qwen3"
) -> tuple[np.ndarray, list]:
    """Greedy tokens [sequences, NEW_TOKENS] through the runtime's placed prefill and decode
    programs, and every layer's cache after them: per sequence {position: (key, value, CP
    rank)}."""
    run = runner(dp, cp, tp, mode, preset)
    packed = run.pack(prompts(), bucketed=True)
    caches = run.new_caches(packed.decode_rows_per_rank, 64)
    key = jax.random.key(0)
    last_rows = run.place_array(packed.last_row_index())
    first, caches = run.prefill(*run.place(packed), caches, last_rows, key)
    lengths = np.asarray(packed.lengths, np.int32)
    rows, batch = run.place(decode_rows(packed, np.zeros_like(lengths), lengths))
    rows = dataclasses.replace(rows, ids=first)
    out, caches = run.decode(rows, batch, caches, key, NEW_TOKENS - 1, capacity=8)
    order = packed.slot_order()
    tokens = np.concatenate([fetch(first)[None], fetch(out)[: NEW_TOKENS - 1]])[:, order].T
    slots = packed.decode_rows_per_rank
    stored = []
    for cache in caches:
        k, v = fetch(cache.k), fetch(cache.v)
        positions = None if cache.positions is None else fetch(cache.positions)
        per_sequence = []
        for rank, slot in zip(packed.rank, packed.slot, strict=True):
            index = rank * slots + slot
            held = np.arange(k.shape[1]) if positions is None else positions[index]
            per_sequence.append(
                {
                    int(p): (k[index, row], v[index, row], row // (k.shape[1] // cp))
                    for row, p in enumerate(held)
                    if p >= 0
                }
            )
        stored.append(per_sequence)
    return tokens, stored


@functools.cache
def stepped_logits(
    dp: int, cp: int, tp: int, mode: CpAttentionMode, preset: str = "tiny-qwen3"
) -> np.ndarray:
    """float32 logits [1 + decode steps, sequences, vocab] of the prefill's last rows, then of
    each decode step fed one device's greedy tokens (`model(rows, batch, caches, last_rows)`
    under the runner's mesh)."""
    run = runner(dp, cp, tp, mode, preset)
    module = bj.ShardedModule(run.model, run.mesh)
    rows_spec = run.topology.row_spec(run.topology.attention_rows())
    logits_spec = PartitionSpec(rows_spec[0], None)
    facts = bj.BatchFacts(bj.BatchVariant.ORDINARY, run.topology, PartitionSpec())
    caches_spec = run.model.cache_specs()
    prefill = module.program(
        lambda model, rows, batch, caches, last: model(rows, batch, caches, last),
        in_specs=(rows_spec, facts, caches_spec, rows_spec),
        out_specs=(logits_spec, caches_spec),
    )
    decode = module.program(
        lambda model, rows, batch, caches: model(rows, batch, caches),
        in_specs=(rows_spec, facts, caches_spec),
        out_specs=(logits_spec, caches_spec),
    )
    want_tokens = served(1, 1, 1, G, preset)[0]
    packed = run.pack(prompts(), bucketed=True)
    order = packed.slot_order()
    caches = run.new_caches(packed.decode_rows_per_rank, 64)
    logits, caches = prefill(
        module.leaves, *run.place(packed), caches, run.place_array(packed.last_row_index())
    )
    steps = [fetch(logits)[order]]
    lengths = np.asarray(packed.lengths, np.int32)
    for step in range(NEW_TOKENS - 1):
        rows = decode_rows(packed, want_tokens[:, step], lengths + step)
        logits, caches = decode(module.leaves, *run.place(rows), caches)
        steps.append(fetch(logits)[order])
    return np.stack(steps)


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


CASES = [
    pytest.param(1, 4, 1, R, id="cp4-ring", marks=pytest.mark.slow),
    pytest.param(1, 2, 2, G, id="cp2-tp2-all_gather"),
    pytest.param(2, 2, 1, R, id="dp2-cp2-ring", marks=pytest.mark.slow),
    pytest.param(1, 2, 1, G, id="cp2-all_gather", marks=pytest.mark.slow),
    pytest.param(1, 2, 1, R, id="cp2-ring", marks=pytest.mark.slow),
    pytest.param(1, 4, 1, G, id="cp4-all_gather", marks=pytest.mark.slow),
    pytest.param(1, 2, 2, R, id="cp2-tp2-ring", marks=pytest.mark.slow),
    pytest.param(2, 2, 1, G, id="dp2-cp2-all_gather", marks=pytest.mark.slow),
    pytest.param(2, 2, 2, R, id="dp2-cp2-tp2-ring", marks=pytest.mark.slow),
    pytest.param(1, 4, 2, G, id="cp4-tp2-all_gather", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("dp", "cp", "tp", "mode"), CASES)
def test_cp_generation_equals_one_device(dp, cp, tp, mode):
    """Greedy tokens after a CP prefill equal one device's, every step."""
    np.testing.assert_array_equal(served(dp, cp, tp, mode)[0], served(1, 1, 1, G)[0])


@pytest.mark.parametrize(("dp", "cp", "tp", "mode"), CASES)
def test_cp_cache_shards_hold_one_devices_keys_once_and_evenly(dp, cp, tp, mode):
    """Each written position's key and value sit on exactly one CP rank and equal one device's
    cache at that position; every prompt and decode position is there; the CP ranks' shares of
    each sequence are at most 3 rows apart (zigzag chunks differ by one row each, and the
    round robin of decode positions adds at most one)."""
    _, want = served(1, 1, 1, G)
    _, got = served(dp, cp, tp, mode)
    for layer, (got_layer, want_layer) in enumerate(zip(got, want, strict=True)):
        for index, length in enumerate(LENGTHS):
            written = range(length + NEW_TOKENS - 1)
            assert sorted(got_layer[index]) == list(written), (layer, index)
            for position in written:
                k, v, _ = got_layer[index][position]
                want_k, want_v, _ = want_layer[index][position]
                assert relative(k, want_k) <= TOL and relative(v, want_v) <= TOL
            shares = np.bincount([r for *_, r in got_layer[index].values()], minlength=cp)
            assert shares.max() - shares.min() <= 3, (layer, index, shares)


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "cp", "tp", "mode"), CASES)
def test_cp_decode_logits_equal_one_device(dp, cp, tp, mode):
    """The prefill's last-row logits and each decode step's logits equal one device's within
    1e-5 (relative to the largest)."""
    want = stepped_logits(1, 1, 1, G)
    got = stepped_logits(dp, cp, tp, mode)
    for step in range(len(want)):
        assert relative(got[step], want[step]) <= TOL, step


@pytest.mark.slow
def test_cp_decode_within_a_sliding_window_equals_one_device():
    """tiny-mistral (a 16-position window; a prompt of 22 tokens) under CP 4 ring: each step's
    logits equal one device's, so the decode masks the window by the cached positions."""
    want = stepped_logits(1, 1, 1, G, "tiny-mistral")
    got = stepped_logits(1, 4, 1, R, "tiny-mistral")
    assert relative(got, want) <= TOL


def test_cp_cache_is_split_over_cp_ranks():
    """A CP cache holds ceil(max_len / C) + 2 rows per CP rank, split over attention CP, with
    every row's position (-1: empty) beside it."""
    topology = bj.Topology(attn_dp=2, attn_cp=4, attn_tp=1)
    assert KVCache.global_shape(CONFIG, topology, slots=4, max_len=30)[1] == 4 * (8 + 2)
    cache = KVCache.create(CONFIG, topology, slots=4, max_len=30, mesh=bj.make_mesh(topology))
    assert cache.positions.shape == (4, 40) and (np.asarray(cache.positions) == -1).all()
    assert cache.k.sharding.spec == PartitionSpec("attn_dp", "attn_cp", None, None)
    assert KVCache.specs(bj.Topology()).positions is None
