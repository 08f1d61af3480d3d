"""Model-facing sharded tensor operations: shard indices, gathers over the last dimension, norms,
losses and argmaxes over split columns, totals over rows. Models call these instead of naming
mesh axes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..layout import SumGroup, Topology


def shard_index(topology: Topology, group: SumGroup) -> jax.Array | int:
    """This rank's index among the ranks of `group` (0 when the group has one rank).

    For models that split a weight over `group` (`Topology.shard_entry(group)`) and need to
    know which slice they hold, e.g. a vocab-parallel embedding's row offset.
    """
    names = topology.group_names(group)
    return lax.axis_index(names) if names else 0


class ReducingModule:
    """A compute module that may complete its own output's sum (SGLang's
    `reduce_results=True`), for a use outside stage boundaries. Under a boundary compute never
    sums its stage's output: `append_stages` refuses a layer holding one that does
    (`reduces_output`), unless a stage it appends declares `output_complete`.
    """

    @property
    def reduces_output(self) -> bool:
        """Whether this module's call completes the sum its output owes."""
        raise NotImplementedError(f"{type(self).__name__} must say whether it reduces its output")


def sum_over_group(x: jax.Array, topology: Topology, group: SumGroup) -> jax.Array:
    """The sum of `x` over the ranks of `group`: for a `ReducingModule` that completes its own
    output outside a stage boundary."""
    names = topology.group_names(group)
    return lax.psum(x, names) if names else x


def is_first_rank(ranks: tuple[str, ...]) -> bool | jax.Array:
    """Whether this rank is the first of the mesh axes `ranks` (a traced bool inside
    `shard_map`; True for no axes). For a bound `plan.CountedOnce`: where a replicated part is
    added."""
    return lax.axis_index(ranks) == 0 if ranks else True


def gather_last_dim(x: jax.Array, topology: Topology, group: SumGroup) -> jax.Array:
    """Concatenates the last dimension of `x` over the ranks of `group`, in rank order.

    For outputs split column-wise over `group`, e.g. vocab-parallel logits.
    """
    names = topology.group_names(group)
    if not names:
        return x
    return lax.all_gather(x, names, axis=x.ndim - 1, tiled=True, to="invarying")


def sharded_rms_norm(
    x: jax.Array, weight: jax.Array, topology: Topology, group: SumGroup, *, eps: float
) -> jax.Array:
    """RMSNorm over a last dimension split column-wise over the ranks of `group`.

    Each rank holds its columns of `x` [rows, width / ranks] and its slice of `weight`; the mean
    of squares is summed over the group (one small all-reduce of [rows, 1]), in FP32 or wider.
    For a norm over a whole projection whose heads are split over attention TP (OLMo 2's q/k
    norm). Call inside `shard_map`.
    """
    return sharded_rms_norms((x,), (weight,), topology, group, eps=eps)[0]


def sharded_rms_norms(
    xs: tuple[jax.Array, ...],
    weights: tuple[jax.Array, ...],
    topology: Topology,
    group: SumGroup,
    *,
    eps: float,
) -> tuple[jax.Array, ...]:
    """`sharded_rms_norm` of several inputs over the same rows, their sums in one all-reduce.

    Each `xs[i]` [rows, width_i / ranks] is normalized over its whole width with `weights[i]`
    (this rank's slice); the [rows, len(xs)] sums of squares cross the group together (OLMo 2's
    q and k norms: one small all-reduce per layer, not two). A rank may hold the same columns as
    other ranks (a kv head shared by `r` ranks): its squares then count `r` times, and so does
    its width, so the mean is still that of the whole projection. Call inside `shard_map`.

    Raises:
      ValueError: The inputs and weights differ in number, or the inputs in their rows.
    """
    if len(xs) != len(weights) or not xs or len({x.shape[:-1] for x in xs}) != 1:
        raise ValueError(
            "sharded_rms_norms takes as many weights as inputs, the inputs over the same rows; "
            f"got inputs {[x.shape for x in xs]} and weights {[w.shape for w in weights]}"
        )
    names = topology.group_names(group)
    acc = functools.reduce(jnp.promote_types, [x.dtype for x in xs], jnp.dtype(jnp.float32))
    wide = [x.astype(acc) for x in xs]
    squares = jnp.concatenate([jnp.sum(w * w, axis=-1, keepdims=True) for w in wide], axis=-1)
    if names:
        squares = lax.psum(squares, names)
    ranks = topology.group_size(group)
    out = []
    for index, (x, value, weight) in enumerate(zip(xs, wide, weights, strict=True)):
        mean = squares[..., index : index + 1] / (x.shape[-1] * ranks)
        scale = weight.astype(acc).reshape((1,) * (x.ndim - 1) + weight.shape)
        out.append((value * lax.rsqrt(mean + eps) * scale).astype(x.dtype))
    return tuple(out)


def vocab_parallel_cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    topology: Topology,
    group: SumGroup,
    *,
    vocab_size: int,
) -> jax.Array:
    """Per-row cross-entropy of logits whose vocabulary columns are split over `group`, without
    gathering them: a max and a sum of exponentials per row over the local columns, completed
    over the group (two [rows] collectives and one for the label's logit).

    Args:
      logits: [rows, columns] this rank's block of vocabulary columns (rank r of `group` holds
        ids r * columns ... (r + 1) * columns - 1); columns at ids >= `vocab_size` are padding
        and never count.
      labels: [rows] int target ids; rows with a label outside [0, vocab_size) (e.g. -1) are
        masked: their loss is zero and they give no gradient.
      topology: The parallel topology the columns are split for.
      group: The group the columns are split over (a vocab-parallel LM head: attention TP).
      vocab_size: Number of real ids.

    Returns:
      float32 [rows] `logsumexp(logits) - logits[label]` per row, alike on every rank of
      `group`; zero on masked rows.
    """
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            "vocab_parallel_cross_entropy takes logits [rows, columns] and labels [rows]; got "
            f"{logits.shape=}, {labels.shape=}"
        )
    axes = topology.group_names(group)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    columns = logits.shape[1]
    ids = shard_index(topology, group) * columns + jnp.arange(columns)
    real = ids < vocab_size
    # The max only keeps exp() in range: it cancels in the loss, so it carries no gradient.
    peak = lax.stop_gradient(jnp.max(jnp.where(real[None, :], logits, -jnp.inf), axis=1))
    if axes:
        peak = lax.pmax(peak, axes)
    exps = jnp.sum(jnp.where(real[None, :], jnp.exp(logits - peak[:, None]), 0), axis=1)
    target = jnp.sum(jnp.where(ids[None, :] == labels[:, None], logits, 0), axis=1)
    if axes:
        exps = lax.psum(exps, axes)
        target = lax.psum(target, axes)
    valid = (labels >= 0) & (labels < vocab_size)
    return jnp.where(valid, jnp.log(exps) + peak - target, 0)


def vocab_parallel_argmax(
    logits: jax.Array, topology: Topology, group: SumGroup, *, vocab_size: int
) -> jax.Array:
    """Each row's id of its largest logit, of logits whose vocabulary columns are split over
    `group`, without gathering them: each rank takes the argmax of its own columns and only the
    [rows] maxima and their ids cross the group. Ties go to the lowest id, as with `argmax` of
    the gathered logits.

    Args:
      logits: [rows, columns] this rank's block of vocabulary columns (as for
        `vocab_parallel_cross_entropy`); columns at ids >= `vocab_size` never win.
      topology: The parallel topology the columns are split for.
      group: The group the columns are split over (a vocab-parallel LM head: attention TP).
      vocab_size: Number of real ids.

    Returns:
      int32 [rows] token ids, alike on every rank of `group`.
    """
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    columns = logits.shape[-1]
    first = shard_index(topology, group) * columns
    ids = first + jnp.arange(columns)
    logits = jnp.where(ids < vocab_size, logits, -jnp.inf)
    best = jnp.max(logits, axis=-1)
    token = (first + jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    names = topology.group_names(group)
    if not names:
        return token
    best = lax.all_gather(best, names, axis=0, to="invarying")  # [ranks, rows]
    token = lax.all_gather(token, names, axis=0, to="invarying")
    rank = jnp.argmax(best, axis=0)  # the first rank with the maximum: the lowest id
    return jnp.take_along_axis(token, rank[None], axis=0)[0]


def total_over_rows(values: jax.Array, topology: Topology) -> jax.Array:
    """The sum of per-row `values` over every row of the batch: a scalar alike on every rank.

    `values` [rows, ...] are on the attention's rows (each attention-DP rank its own rows, alike
    over attention TP, as a stack output and its per-row losses are); the local sum is
    completed over attention DP only, so no row counts twice.
    """
    total = jnp.sum(values)
    axes = topology.mesh_names(topology.attention_rows().sharded)
    return lax.psum(total, axes) if axes else total
