"""Shapes that requests are rounded up to, so that nearby requests share compiled programs; the
decode loop's blocks of static trip count, and its step counts placed once."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import boundary_jax as bj

from ..inputs.rows import PackedBatch, pack_sequences

CACHE_LENGTHS = tuple(2**i for i in range(7, 18))
"""Cache lengths a request's prompt + new tokens are rounded up to (capped at the model's
max_position_embeddings)."""
MIN_ROWS = 16
"""The smallest prefill block per DP rank that `pack(bucketed=True)` uses."""
MIN_STEPS = 16
"""The smallest decode token buffer (`capacity`) that `generate` uses."""
DECODE_BLOCK = 16
"""Decode steps per loop of static trip count on GPU (see `blocked_fori_loop`)."""
PLACED_COUNTS = 256
"""Python step counts and indices a `PlacedCounts` keeps (the oldest goes first)."""


def bucket(size: int, multiple: int = 1) -> int:
    """The power of two >= `size` (and >= `multiple`), rounded up to a multiple of `multiple`."""
    power = 1 << max(size - 1, 0).bit_length()
    power = max(power, multiple)
    return -(-power // multiple) * multiple


def cache_length(tokens: int, limit: int) -> int:
    """The cache bucket for `tokens` positions: the smallest of CACHE_LENGTHS, at most `limit`."""
    return min(next((n for n in CACHE_LENGTHS if n >= tokens), tokens), limit)


def pack_bucketed(
    sequences: Sequence[Sequence[int]],
    topology: bj.Topology,
    *,
    bucketed: bool = False,
    adapters: Sequence[int] | None = None,
) -> PackedBatch:
    """Packs sequences (each with its LoRA adapter index, given `adapters`) onto the DP ranks;
    `bucketed` rounds the prefill rows and the cache slots per rank up to powers of two (see
    `bucket`), so that batches share programs."""
    exact = pack_sequences(sequences, topology, adapters=adapters)
    if not bucketed:
        return exact
    tp = topology.attn_tp
    return pack_sequences(
        sequences,
        topology,
        rows_per_rank=bucket(max(exact.rows_per_rank, MIN_ROWS), topology.attn_cp * tp),
        slots_per_rank=bucket(exact.decode_rows_per_rank, tp),
        adapters=adapters,
    )


DECODE_GRAPH_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    "xla_gpu_graph_min_graph_size": 1,
}
"""XLA's compiler options that put a one-GPU decode program's loop, its condition included, into
CUDA graphs: XLA's default command types (fusions, cuBLAS, cuDNN, custom calls) plus WHILE and
CONDITIONAL, so no step waits for the host to read the loop's condition. On an H100 the 8-layer
GPT-OSS-20B decode took 0.5-0.8% less per step than with 16-step blocks (benchmarks/RESULTS.md
run 43)."""


def decode_loop(
    platform: str, capacity: int, devices: int
) -> tuple[int | None, dict[str, object] | None]:
    """The decode loop's form: (its block of static trip count, or None for one loop; the decode
    program's XLA compiler options, or None for XLA's defaults).

    On one GPU, one loop under `DECODE_GRAPH_OPTIONS`, its condition read on the device. On a
    GPU mesh of several devices, whose collectives keep the loop out of CUDA graphs, blocks of
    DECODE_BLOCK steps (at most `capacity`). Elsewhere one loop under XLA's defaults.
    """
    if platform != "gpu":
        return None, None
    if devices == 1:
        return None, dict(DECODE_GRAPH_OPTIONS)
    return min(capacity, DECODE_BLOCK), None


def blocked_fori_loop(count: jax.Array, body: Callable, carry, block: int | None):
    """`lax.fori_loop(0, count, body, carry)` for a traced `count`, run as loops of `block`
    steps (a static trip count) and then the remainder; one loop where `block` is None.

    XLA:GPU copies a loop's condition to the host every iteration unless it knows the trip
    count or runs the loop in a CUDA graph (`decode_loop`); a step then waits for
    the previous one before its kernels launch (on an H200, about 0.1 ms per Nemotron-H-8B
    decode step). Here that wait comes once per `block` steps. The price is the body traced and
    compiled twice, which other platforms need not pay.
    """
    if block is None:
        return lax.fori_loop(0, count, body, carry)
    blocks = count // block

    def run_block(index, carry):
        return lax.fori_loop(0, block, lambda i, carry: body(index * block + i, carry), carry)

    carry = lax.fori_loop(0, blocks, run_block, carry)
    return lax.fori_loop(blocks * block, count, body, carry)


class PlacedCounts:
    """Decode step counts and indices as replicated int32 scalars on `mesh`, a Python int placed
    once: a decode call then copies nothing from the host (on an H200 the GPU idled for those
    copies, 1-2% of an 8-layer GPT-OSS decode call of 32 steps: `benchmarks/RESULTS.md` run
    38)."""

    def __init__(self, mesh: jax.sharding.Mesh):
        self._sharding = NamedSharding(mesh, PartitionSpec())
        self._placed: dict[int, jax.Array] = {}

    def __call__(self, value: int | jax.Array) -> jax.Array:
        if not isinstance(value, int):
            return jnp.asarray(value, jnp.int32)
        if value not in self._placed:
            if len(self._placed) >= PLACED_COUNTS:
                self._placed.pop(next(iter(self._placed)))
            self._placed[value] = jax.device_put(np.int32(value), self._sharding)
        return self._placed[value]
