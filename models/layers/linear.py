"""Tensor-parallel linear layers, a vocab-parallel embedding and the LM head: none of them sums.

Each layer is built outside `jax.shard_map` with its global shape; its parameter carries the
`PartitionSpec` entries of `Topology.shard_entry`, and inside `shard_map` it sees its local shard.
A layer whose output is a partial sum returns it unreduced: the caller's boundary completes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from boundary_jax import SumGroup, Topology
from boundary_jax.initializers import Normal, ZeroPadded, param
from boundary_jax.ops import (
    ReducingModule,
    gather_last_dim,
    shard_index,
    sum_over_group,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)

from ..config import padded_vocab


def group_size(topology: Topology, group: SumGroup | None) -> int:
    """Number of ranks a weight split over `group` is divided among (1 for None)."""
    return 1 if group is None else topology.group_size(group)


def weight_init(std: float | None, fan_in: int) -> Normal:
    """N(0, std^2) weights; std None: N(0, 1/fan_in). A model passes its family's std (Hugging
    Face's `initializer_range`); the 1/fan_in default keeps a layer's outputs of order one."""
    return Normal(1 / np.sqrt(fan_in) if std is None else std)


def _split_entry(topology: Topology, group: SumGroup | None, size: int, what: str):
    shards = group_size(topology, group)
    if size % shards:
        raise ValueError(
            f"{what} ({size}) must divide evenly over the {shards} ranks of "
            f"{group.value if group else 'no group'}; got {size=}, {shards=}"
        )
    return None if group is None else topology.shard_entry(group)


class ColumnParallelLinear(nnx.Module):
    """`x @ kernel (+ bias)` with the output features split over `group`: each rank computes its
    columns (and adds its slice of the bias; the output owes no sum, so every rank adds it).

    With `parts`, one kernel holds several projections of the same input (k and v; gate and
    up), stacked on a parts axis before the split features, so each rank's block of all of them
    is one contiguous [in_features, parts x local out_features] matrix: one matmul instead of
    one per projection (on an H200 at decode sizes, fewer and wider matmuls read the weights
    faster: benchmarks/RESULTS.md run 8).

    Attributes:
      kernel: [in_features, out_features] global, local [in_features, out_features / ranks];
        with parts, [in_features, parts, out_features] split on the last axis. Drawn from
        N(0, init_std^2) (`weight_init`; None: std 1/sqrt(in_features)).
      bias: [out_features] (with parts, [parts, out_features]) split as the kernel's columns;
        None without a bias. Drawn like the kernel (not zeros, as Hugging Face does), so a
        dropped or mis-sharded bias shows in tests.
      group: The group the output features are split over; None keeps the kernel replicated.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: SumGroup | None,
        topology: Topology,
        parts: int | None = None,
        bias: bool = False,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        entry = _split_entry(topology, group, out_features, "out_features")
        stacked = () if parts is None else (parts,)
        init = weight_init(init_std, in_features)
        self.kernel = param(
            init,
            (in_features, *stacked, out_features),
            dtype,
            rngs=rngs,
            sharding=(None, *(None for _ in stacked), entry),
        )
        # Drawn like the kernel where Hugging Face draws zeros: a dropped or mis-sharded bias
        # changes the output, so the tests see it.
        self.bias = (
            param(
                init,
                (*stacked, out_features),
                dtype,
                rngs=rngs,
                sharding=(*(None for _ in stacked), entry),
            )
            if bias
            else None
        )
        self.group = group

    def __call__(self, x: jax.Array) -> jax.Array:
        """[T, in_features] -> this rank's [T, local out_features] (with parts, [T, parts,
        local out_features]); complete, nothing owed."""
        return project(x, self.kernel[...], None if self.bias is None else self.bias[...])

    def columns(self, x: jax.Array, start: jax.Array, size: int) -> jax.Array:
        """Only this rank's output columns [start, start + size) of each part (`start` may be
        traced): e.g. the one kv head a rank computes where the kv heads are shared."""
        kernel = lax.dynamic_slice_in_dim(self.kernel[...], start, size, axis=-1)
        bias = None
        if self.bias is not None:
            bias = lax.dynamic_slice_in_dim(self.bias[...], start, size, axis=-1)
        return project(x, kernel, bias)


def project(x: jax.Array, kernel: jax.Array, bias: jax.Array | None) -> jax.Array:
    """`x @ kernel + bias` for a local [in, out] kernel, or one matmul over a stacked [in, parts,
    out] kernel returning [T, parts, out]."""
    y = x @ kernel.reshape(kernel.shape[0], -1)
    y = y.reshape(x.shape[0], *kernel.shape[1:])
    return y if bias is None else y + bias[None]


class RowParallelLinear(nnx.Module, ReducingModule):
    """`x @ kernel (+ bias)` with the input features split over `group`: returns this rank's
    partial sum.

    Attributes:
      kernel: [in_features, out_features] global; local [in_features / ranks, out_features].
        Drawn from N(0, init_std^2) (`weight_init`).
      bias: [out_features], whole on every rank of `group`, or None. Every rank holds it: a
        replicated part of the stage's output (`boundary_jax.declare.Replicated`), added only
        where the stage boundary counts it (`__call__`'s `counts_bias`), so the one sum over the
        group counts it once. Drawn like the kernel, so a bias counted on every rank shows in
        tests.
      group: The group the input features are split over; the output owes a sum over it.
      topology: The parallel topology.
      reduce_results: The call completes the sum over `group` itself, for a use outside stage
        boundaries; under one, `append_stages` refuses it (the boundary owns the sum).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: SumGroup,
        topology: Topology,
        bias: bool = False,
        reduce_results: bool = False,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ):
        entry = _split_entry(topology, group, in_features, "in_features")
        init = weight_init(init_std, in_features)
        self.kernel = param(
            init, (in_features, out_features), dtype, rngs=rngs, sharding=(entry, None)
        )
        self.bias = (
            param(init, (out_features,), dtype, rngs=rngs, sharding=(None,)) if bias else None
        )
        self.group = group
        self.topology = topology
        self.reduce_results = reduce_results

    @property
    def reduces_output(self) -> bool:
        return self.reduce_results

    def __call__(self, x: jax.Array, *, counts_bias: bool | jax.Array | None = None) -> jax.Array:
        """This rank's [T, local in_features] -> [T, out_features] partial, unreduced over group
        (summed over it with `reduce_results`).

        Args:
          x: This rank's input features.
          counts_bias: With a bias, whether this rank adds it: the stage boundary's
            `counts(name, stream)` for the bias the stage declares replicated. Required then;
            None without a bias.

        Raises:
          ValueError: A bias without `counts_bias`, or `counts_bias` without a bias.
        """
        y = x @ self.kernel[...]
        if (self.bias is None) != (counts_bias is None):
            raise ValueError(
                "a row-parallel projection's bias is a replicated part of its stage's output: "
                "pass counts_bias (the stage boundary's counts(name, stream) for the bias the "
                "stage declares with declare.Replicated) exactly when the projection has a bias; "
                f"got bias={self.bias is not None}, {counts_bias=}"
            )
        if self.bias is not None:
            bias = self.bias[...]
            y = y + jnp.where(counts_bias, bias, jnp.zeros_like(bias))[None]
        return sum_over_group(y, self.topology, self.group) if self.reduce_results else y

    def of_activation(
        self, x: jax.Array, activation: Callable[[jax.Array], jax.Array]
    ) -> jax.Array:
        """The projection of `activation(x)` ([T, local in]), or of `activation(gate) * up` for
        [T, 2, local in], computed in the model's dtype."""
        return self(activation(x[:, 0]) * x[:, 1] if x.ndim == 3 else activation(x))


class Linears(Protocol):
    """Makes a layer's tensor-parallel projections (`DenseLinears`, `fp8_linear.Fp8Linears`).

    `column` returns a module whose call gives the complete output features of its rank (with
    `columns(x, start, size)` for a slice of them); `row` one whose call gives a partial sum
    (with `of_activation(x, activation)` for the sum of an activation of `x`, which a quantized
    projection fuses into its input's quantization).
    """

    def column(
        self,
        in_features: int,
        out_features: int,
        *,
        group: SumGroup | None,
        topology: Topology,
        parts: int | None = None,
        bias: bool = False,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ) -> nnx.Module: ...

    def row(
        self,
        in_features: int,
        out_features: int,
        *,
        group: SumGroup,
        topology: Topology,
        bias: bool = False,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ) -> nnx.Module: ...


@dataclasses.dataclass(frozen=True)
class DenseLinears:
    """Makes a layer's tensor-parallel projections in the model's dtype; a model passes another
    maker with the same calls (`fp8_linear.Fp8Linears`) to quantize them."""

    def column(
        self,
        in_features: int,
        out_features: int,
        *,
        group: SumGroup | None,
        topology: Topology,
        parts: int | None = None,
        bias: bool = False,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ) -> ColumnParallelLinear:
        """A `ColumnParallelLinear`."""
        return ColumnParallelLinear(
            in_features,
            out_features,
            group=group,
            topology=topology,
            parts=parts,
            bias=bias,
            dtype=dtype,
            init_std=init_std,
            rngs=rngs,
        )

    def row(
        self,
        in_features: int,
        out_features: int,
        *,
        group: SumGroup,
        topology: Topology,
        bias: bool = False,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
    ) -> RowParallelLinear:
        """A `RowParallelLinear`."""
        return RowParallelLinear(
            in_features,
            out_features,
            group=group,
            topology=topology,
            bias=bias,
            dtype=dtype,
            init_std=init_std,
            rngs=rngs,
        )


DENSE_LINEARS = DenseLinears()
"""The default projections: dense, in the model's dtype."""


class VocabParallelEmbedding(nnx.Module):
    """Token embedding whose table rows are split over attention TP.

    The table has `padded_vocab(vocab_size, attn_tp)` rows; the padding rows are zero and no id
    selects them. A rank returns the embeddings of the ids in its row range and zeros elsewhere,
    so the sum over attention TP (owed to the first boundary) is the full embedding.

    Attributes:
      embedding: [padded vocab, hidden] global; local [padded vocab / attn_tp, hidden]. Drawn
        from N(0, init_std^2) (a model passes its family's `initializer_range`).
      vocab_size: Number of real token ids.
      topology: The parallel topology the table is split for.
      scale: A factor the embeddings are multiplied by, rounded to the table's dtype first (as
        a scaled embedding does), or None.
      padding_id: A token whose row takes no gradient from lookups (`nn.Embedding`'s
        `padding_idx`; a tied head's gradient still reaches it), or None.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        topology: Topology,
        dtype: jnp.dtype = jnp.float32,
        scale: float | None = None,
        init_std: float = 1.0,
        padding_id: int | None = None,
        rngs: nnx.Rngs,
    ):
        rows = padded_vocab(vocab_size, group_size(topology, SumGroup.ATTN_TP))
        # Drawn at the real vocabulary size, so a seed gives the same table on every mesh.
        self.embedding = param(
            ZeroPadded(Normal(init_std), (vocab_size, hidden_size)),
            (rows, hidden_size),
            dtype,
            rngs=rngs,
            sharding=(topology.shard_entry(SumGroup.ATTN_TP), None),
        )
        self.vocab_size = vocab_size
        self.topology = topology
        self.scale = scale
        self.padding_id = padding_id

    def __call__(self, ids: jax.Array) -> jax.Array:
        """[T] int ids -> [T, hidden]: this rank's partial, owing a sum over attention TP.

        Ids outside [0, vocab_size) (e.g. -1 on padding rows) give zeros on every rank.
        """
        table = self.embedding[...]
        rows = table.shape[0]
        local = ids - shard_index(self.topology, SumGroup.ATTN_TP) * rows
        mine = (local >= 0) & (local < rows) & (ids < self.vocab_size)
        gathered = jnp.take(table, jnp.where(mine, local, 0), axis=0)
        if self.padding_id is not None:
            padding = (ids == self.padding_id)[:, None]
            gathered = jnp.where(padding, lax.stop_gradient(gathered), gathered)
        if self.scale is not None:
            # Only the owning rank's row is nonzero, so scaling before the sum scales the sum.
            gathered = gathered * jnp.asarray(self.scale, table.dtype)
        return jnp.where(mine[:, None], gathered, 0)


class ParallelLMHead(nnx.Module):
    """Logits over the real vocabulary from vocab-parallel columns, gathered over attention TP.

    Attributes:
      kernel: [hidden, padded vocab] global (padding columns zero), split over attention TP;
        None when the head is tied to an embedding. Drawn from N(0, init_std^2)
        (`weight_init`).
      tied_embedding: The embedding whose table (transposed) is the head's weight, or None.
      vocab_size: Number of real token ids; the logits have this many columns.
      topology: The parallel topology the columns are split for.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        topology: Topology,
        dtype: jnp.dtype = jnp.float32,
        init_std: float | None = None,
        rngs: nnx.Rngs,
        tied_embedding: VocabParallelEmbedding | None = None,
    ):
        columns = padded_vocab(vocab_size, group_size(topology, SumGroup.ATTN_TP))
        if tied_embedding is None:
            self.kernel = param(
                ZeroPadded(weight_init(init_std, hidden_size), (hidden_size, vocab_size)),
                (hidden_size, columns),
                dtype,
                rngs=rngs,
                sharding=(None, topology.shard_entry(SumGroup.ATTN_TP)),
            )
        else:
            table_shape = tied_embedding.embedding.shape
            if tied_embedding.vocab_size != vocab_size or table_shape != (columns, hidden_size):
                raise ValueError(
                    "a tied LM head needs an embedding of the same vocab and hidden size, split "
                    f"over the same topology; got {vocab_size=}, {hidden_size=} and an embedding "
                    f"of vocab {tied_embedding.vocab_size} with table {table_shape}"
                )
            self.kernel = None
        self.tied_embedding = tied_embedding
        self.vocab_size = vocab_size
        self.topology = topology

    def __call__(self, x: jax.Array) -> jax.Array:
        """[T, hidden] complete rows (alike on every attention-TP rank) -> [T, vocab_size] logits.

        The local [T, padded / attn_tp] logits are gathered over attention TP (one all-gather)
        and sliced to the real vocabulary, so padding columns never reach the caller.
        """
        tied = self.kernel is None
        weight = self.tied_embedding.embedding[...].T if tied else self.kernel[...]
        logits = gather_last_dim(x @ weight, self.topology, SumGroup.ATTN_TP)
        return logits[:, : self.vocab_size]

    def cross_entropy(self, x: jax.Array, labels: jax.Array) -> jax.Array:
        """[T, hidden] complete rows and [T] target ids -> float32 [T] per-row cross-entropy.

        The logits stay split over attention TP (`bj.ops.vocab_parallel_cross_entropy` completes a
        max and a sum of exponentials per row instead of gathering them); padding columns never
        count. Rows labelled -1 (or any id outside the vocabulary) lose nothing.
        """
        tied = self.kernel is None
        weight = self.tied_embedding.embedding[...].T if tied else self.kernel[...]
        return vocab_parallel_cross_entropy(
            x @ weight, labels, self.topology, SumGroup.ATTN_TP, vocab_size=self.vocab_size
        )

    def greedy(self, x: jax.Array) -> jax.Array:
        """[T, hidden] complete rows -> int32 [T] argmax token ids, without gathering logits.

        Each rank takes the argmax of its own vocab columns (padding columns excluded); only
        the [T] maxima and their ids cross attention TP. Ties go to the lowest id, as with
        `argmax` of the gathered logits.
        """
        tied = self.kernel is None
        weight = self.tied_embedding.embedding[...].T if tied else self.kernel[...]
        logits = (x @ weight).astype(jnp.float32)
        return vocab_parallel_argmax(
            logits, self.topology, SumGroup.ATTN_TP, vocab_size=self.vocab_size
        )
