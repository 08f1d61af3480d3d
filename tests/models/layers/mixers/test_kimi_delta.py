"""Kimi Delta Attention (the per-channel gated delta rule's mixer) equals transformers'
`KimiLinearDeltaAttention` (golden), one device and split over attention TP, prefill over
packed sequences and decode steps from its cache."""

import functools
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from models.config import KimiDeltaSpec
from models.inputs.rows import RowsPhase
from models.layers.mixers.gated_deltanet import DeltaCache
from models.layers.mixers.kimi_delta import KimiDeltaAttention
from tests.models import make_mesh, row_spec, run_sharded, sum_over
from tests.models.layers.mixers.test_mamba2 import layout_rows

GOLDEN = dict(np.load(Path(__file__).parents[3] / "golden" / "kimi_delta_mixer" / "mixer.npz"))
SPEC = KimiDeltaSpec(
    hidden_size=int(GOLDEN["hidden_size"].item()),
    num_heads=int(GOLDEN["num_heads"].item()),
    head_dim=int(GOLDEN["head_dim"].item()),
    conv_kernel=int(GOLDEN["conv_kernel"].item()),
    chunk_size=8,  # the golden sequences cross chunks
    eps=float(GOLDEN["eps"].item()),
)
ROWS, STEPS = 32, 3


def golden_params() -> dict:
    """The golden mixer's parameters, by this mixer's paths (global values)."""
    width = SPEC.width
    conv = GOLDEN["conv1d.weight"]
    return {
        "qkv_proj": {"kernel": np.stack([GOLDEN[f"{p}_proj.weight"].T for p in "qkv"], axis=1)},
        "conv": {"weight": conv.reshape(3, width, 1, SPEC.conv_kernel)},
        "f_a_proj": {"kernel": GOLDEN["forget_gate.f_a_proj.weight"].T},
        "f_b_proj": {"kernel": GOLDEN["forget_gate.f_b_proj.weight"].T},
        "dt_bias": GOLDEN["forget_gate.dt_bias"],
        "a_log": GOLDEN["forget_gate.A_log"],
        "b_proj": {"kernel": GOLDEN["b_proj.weight"].T},
        "g_a_proj": {"kernel": GOLDEN["g_a_proj.weight"].T},
        "g_b_proj": {"kernel": GOLDEN["g_b_proj.weight"].T},
        "norm_weight": GOLDEN["o_norm.weight"],
        "o_proj": {"kernel": GOLDEN["o_proj.weight"].T},
    }


@functools.cache
def golden_run(tp: int):
    """The golden prefill (each sequence's first `lengths` rows, packed) and STEPS decode
    steps from its cache, on attention TP `tp`, summed over it: (prefill [ROWS, hidden],
    steps [STEPS, slots, hidden])."""
    topology = bj.Topology(attn_tp=tp)
    mixer = KimiDeltaAttention(SPEC, topology=topology, rngs=nnx.Rngs(0))
    state = nnx.state(mixer, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(np.asarray, golden_params()))
    nnx.update(mixer, state)
    lengths = [int(n) for n in GOLDEN["lengths"]]
    slots = len(lengths)
    rows = np.zeros((ROWS, SPEC.hidden_size), np.float32)
    rows[: sum(lengths)] = np.concatenate([GOLDEN["rows"][s, :n] for s, n in enumerate(lengths)])
    positions, segments = layout_rows(tuple(enumerate(lengths)), ROWS - sum(lengths))
    steps = np.stack(
        [GOLDEN["rows"][np.arange(slots), np.asarray(lengths) + i] for i in range(STEPS)]
    )
    cache = DeltaCache.create(SPEC.cache_spec(), topology, slots=slots)
    slot_ids = np.arange(slots, dtype=np.int32)

    def body(module, h, positions, segments, steps, cache):
        done = lambda v: sum_over(v, topology, bj.SumGroup.ATTN_TP)  # noqa: E731
        out, cache = module(h, positions, segments, cache)
        decoded = []
        for i in range(STEPS):
            now = jax.numpy.asarray(lengths, jax.numpy.int32) + i
            y, cache = module(steps[i], now, slot_ids, cache, phase=RowsPhase.DECODE)
            decoded.append(done(y))
        return done(out), jax.numpy.stack(decoded)

    specs = (row_spec(topology, None), row_spec(topology), row_spec(topology))
    cache_specs = DeltaCache.specs(topology)
    return run_sharded(
        mixer,
        make_mesh(1, tp),
        body,
        (rows, positions, segments, steps, cache),
        (*specs, jax.sharding.PartitionSpec(), cache_specs),
        (specs[0], jax.sharding.PartitionSpec()),
    )


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_prefill_and_decode_equal_transformers(tp):
    """A prefill of packed sequences (crossing chunks of 8) and three decode steps from the
    conv and per-channel-gated state equal each sequence run alone through transformers'
    mixer; at attention TP 2 each rank's heads, conv channels, gates and state."""
    prefill, decoded = golden_run(tp)
    lengths = [int(n) for n in GOLDEN["lengths"]]
    want = np.concatenate([GOLDEN["output"][s, :n] for s, n in enumerate(lengths)])
    scale = np.abs(GOLDEN["output"]).max()
    np.testing.assert_allclose(prefill[: len(want)], want, atol=2e-5 * scale)
    assert not np.asarray(prefill[len(want) :]).any()
    for i in range(STEPS):
        want = GOLDEN["output"][np.arange(len(lengths)), np.asarray(lengths) + i]
        np.testing.assert_allclose(decoded[i], want, atol=2e-5 * scale)


def test_rejects_heads_that_do_not_split():
    """The heads must split evenly over attention TP."""
    with pytest.raises(ValueError, match="num_heads .* multiple of the attention-TP"):
        KimiDeltaAttention(SPEC, topology=bj.Topology(attn_tp=8), rngs=nnx.Rngs(0))
