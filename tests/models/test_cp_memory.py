"""Context parallelism splits a long prefill's memory: from the compiled memory statistics
(compiled only, never run), a 32k-token prefill's per-device memory under CP 4 is at most 0.35x
that on one device, in both attention modes."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import boundary_jax as bj
from boundary_jax import make_mesh
from models.build import build_model
from models.config import PRESETS
from models.layers.attention.context_parallel import CpAttentionMode
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

TOKENS = 32768
CONFIG = dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=1, max_position_embeddings=TOKENS)


@functools.cache
def device_bytes(cp: int, mode: CpAttentionMode) -> int:
    """Per-device bytes of the compiled prefill of one `TOKENS`-token sequence: its
    temporaries, arguments and outputs (`compiled.memory_analysis()`)."""
    topology = bj.Topology(attn_cp=cp)
    model = build_model(CONFIG, topology, BuildOptions(cp_attention=mode))
    lowered = ShardedCausalLM(model, make_mesh(topology)).lower_forward([[1] * TOKENS])
    stats = lowered.compile().memory_analysis()
    return stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes


@pytest.mark.parametrize("mode", tuple(CpAttentionMode), ids=lambda m: m.name)
def test_cp4_prefill_needs_at_most_035x_of_one_device(mode):
    one = device_bytes(1, CpAttentionMode.ALL_GATHER)
    assert device_bytes(4, mode) <= 0.35 * one
