"""Shapes that requests are rounded up to, so that nearby requests share compiled programs; the
decode loop's blocks of static trip count, and its step counts placed once."""

from __future__ import annotations

import dataclasses
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
CUBLAS_DECODE_ROWS = 64
"""Rows per device from which a one-GPU decode program multiplies through cuBLAS
(`CUBLAS_DECODE_OPTIONS`)."""
CUBLAS_DECODE_OPTIONS = {
    "xla_gpu_enable_triton_gemm": False,
    "xla_disable_hlo_passes": "dot-merger",
}
"""XLA's compiler options for a decode program whose products read their weights at cuBLAS's
bandwidth rather than at that of XLA's autotuned Triton GEMMs. On an H100 at 64 rows XLA's
choice multiplied by Llama-3-8B's q and o weights 2x slower than cuBLAS alone, by down 1.15x;
at 8 rows it was level. The dot merger goes off with them: it joins the products that share an
input (q and kv) by concatenating their weights, which a Triton GEMM reads in place but cuBLAS
needs written, every step. Llama-3-8B's 32-layer decode at 64 sequences took 8.94 ms a step
against 9.29; at 8, 16 and 32 sequences cuBLAS took 6.40 / 6.72 / 7.47 against XLA's
6.05 / 6.45 / 7.36 (benchmarks/RESULTS.md runs 47 and 48), hence the threshold."""


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
    """The decode program's loop form and compilation (`decode_loop`).

    Attributes:
      block: Steps per loop of static trip count, or None for one loop (`blocked_fori_loop`).
      options: XLA's compiler options for the program alone, as sorted (name, value) pairs;
        empty for XLA's defaults.
    """

    block: int | None = None
    options: tuple[tuple[str, object], ...] = ()

    @property
    def compiler_options(self) -> dict[str, object] | None:
        """`options` as `jax.jit` takes them (None for XLA's defaults)."""
        return dict(self.options) or None


def decode_loop(platform: str, capacity: int, devices: int, rows: int) -> DecodeLoop:
    """The decode loop's form for `rows` decode rows per device.

    On one GPU, one loop under `DECODE_GRAPH_OPTIONS`, its condition read on the device, and
    from `CUBLAS_DECODE_ROWS` rows its products through cuBLAS (`CUBLAS_DECODE_OPTIONS`). On a
    GPU mesh of several devices, whose collectives keep the loop out of CUDA graphs, blocks of
    DECODE_BLOCK steps (at most `capacity`). Elsewhere one loop under XLA's defaults.
    """
    if platform != "gpu":
        return DecodeLoop()
    if devices > 1:
        return DecodeLoop(block=min(capacity, DECODE_BLOCK))
    options = dict(DECODE_GRAPH_OPTIONS)
    if rows >= CUBLAS_DECODE_ROWS:
        options.update(CUBLAS_DECODE_OPTIONS)
    return DecodeLoop(options=tuple(sorted(options.items())))


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
