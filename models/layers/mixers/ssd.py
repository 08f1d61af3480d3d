"""The pure per-row math of Mamba2 over packed token rows: the selective state-space
recurrence (SSD) as a sequential reference, in its chunked matmul form and as a one-token decode
step; the causal depthwise convolution (packed and decode forms); the time step; and the gated
group RMSNorm.

Per head h with head_dim P and state size N, row t of a sequence updates the state
[P, N] and reads it out:

    state_t = exp(dt_t * a_h) * state_{t-1} + dt_t * x_t B_t^T
    y_t     = state_t C_t + d_h * x_t

B and C come in `groups` groups, each shared by heads // groups consecutive heads: head h
reads group h // (heads // groups), as Hugging Face's `repeat_interleave` does. Rows are one
attention-DP rank's packed sequences (`TokenRows`): a row starts a new sequence, with a zero
state, where its segment id differs from the row before it or its position is 0. Padding rows
(segment id -1) contribute nothing and read out zeros. The state and all sums are float32, or
float64 for float64 inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ...inputs.rows import RowsPhase


def accumulation_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """Float32, or the input's dtype where that is wider (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def sequence_starts(positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """bool [T]: the rows that start a sequence (first row, a new segment id, or position 0)."""
    changed = jnp.concatenate([jnp.ones((1,), bool), segment_ids[1:] != segment_ids[:-1]])
    return changed | (positions == 0)


def sequence_runs(positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """int32 [T]: a number per contiguous sequence (run) of rows, increasing down the rows."""
    return jnp.cumsum(sequence_starts(positions, segment_ids), dtype=jnp.int32)


def last_rows(segment_ids: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array]:
    """The last row of each slot's rows and whether the slot has any: int32 [S], bool [S]."""
    rows = segment_ids.shape[0]
    slot = jnp.where(segment_ids >= 0, segment_ids, num_slots)
    last = jax.ops.segment_max(jnp.arange(rows), slot, num_slots + 1)[:num_slots]
    present = last >= 0
    return jnp.where(present, last, 0).astype(jnp.int32), present


def _check_shapes(x, dt, a, b, c, d, positions, segment_ids) -> None:
    rows, heads, _ = x.shape
    groups = b.shape[1]
    if (
        dt.shape != (rows, heads)
        or a.shape != (heads,)
        or d.shape != (heads,)
        or b.ndim != 3
        or c.shape != b.shape
        or b.shape[0] != rows
        or heads % groups
        or positions.shape != (rows,)
        or segment_ids.shape != (rows,)
    ):
        raise ValueError(
            "SSD inputs must be x [T, heads, P], dt [T, heads], a and d [heads], b and c "
            "[T, groups, N] with groups dividing heads, positions and segment_ids [T]; got "
            f"{x.shape=}, {dt.shape=}, {a.shape=}, {b.shape=}, {c.shape=}, {d.shape=}, "
            f"{positions.shape=}, {segment_ids.shape=}"
        )


@functools.partial(jax.jit, static_argnames=("num_slots",))
def ssd_reference(
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    num_slots: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence one row at a time (`lax.scan` over rows): the spec of `ssd_chunked_scan`.

    Args:
      x: [T, heads, P] inputs.
      dt: [T, heads] time steps (after softplus and limits).
      a: [heads] state decay rates (negative: `-exp(A_log)`).
      b: [T, groups, N] input projections of the state.
      c: [T, groups, N] output projections of the state.
      d: [heads] skip weights.
      positions: [T] int32 position of each row within its sequence.
      segment_ids: [T] int32 slot of each row's sequence; -1 marks padding.
      num_slots: Static: how many per-slot final states to return.

    Returns:
      (y [T, heads, P], final states [num_slots, heads, P, N]): the state after each slot's
      last row, zero for a slot without rows; both in the accumulation dtype.
    """
    _check_shapes(x, dt, a, b, c, d, positions, segment_ids)
    acc = accumulation_dtype(x.dtype)
    rows, heads, head_dim = x.shape
    per_group = heads // b.shape[1]
    valid = segment_ids >= 0
    dt = jnp.where(valid[:, None], dt, 0).astype(acc)
    starts = sequence_starts(positions, segment_ids)

    def step(carry, row):
        state, finals = carry
        x_t, dt_t, b_t, c_t, start, slot = row
        state = jnp.where(start, 0, state)
        b_h = jnp.repeat(b_t, per_group, axis=0)  # [heads, N]
        c_h = jnp.repeat(c_t, per_group, axis=0)
        update = (dt_t[:, None] * x_t)[:, :, None] * b_h[:, None, :]
        state = jnp.exp(dt_t * a)[:, None, None] * state + update
        y = jnp.einsum("hpn,hn->hp", state, c_h) + d[:, None] * x_t
        finals = finals.at[jnp.where(slot >= 0, slot, num_slots)].set(state, mode="drop")
        return (state, finals), jnp.where(slot >= 0, y, 0)

    state = jnp.zeros((heads, head_dim, b.shape[2]), acc)
    finals = jnp.zeros((num_slots, *state.shape), acc)
    inputs = (x.astype(acc), dt, b.astype(acc), c.astype(acc), starts, segment_ids)
    (_, finals), y = lax.scan(step, (state, finals), inputs)
    return y, finals


def _pad_rows(x: jax.Array, rows: int, fill=0) -> jax.Array:
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=fill)


def _segment_sums(log_decay: jax.Array) -> jax.Array:
    """[..., L, H] -> [..., L(t), L(s), H]: the sum of log_decay over rows s < k <= t.

    A masked cumulative sum, not a difference of cumulative sums, so that a long chunk's
    large partial sums do not cancel (the stable form Hugging Face's `segment_sum` uses).
    Entries with t < s are 0; callers mask them.
    """
    length = log_decay.shape[-2]
    after = jnp.arange(length)[:, None] > jnp.arange(length)[None, :]  # [k, s]: k > s
    after = after.reshape((1,) * (log_decay.ndim - 2) + (length, length, 1))
    spread = jnp.where(after, log_decay[..., :, None, :], 0)
    return jnp.cumsum(spread, axis=-3)


@functools.partial(jax.jit, static_argnames=("chunk_size", "num_slots"))
def ssd_chunked_scan(
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    chunk_size: int,
    num_slots: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence of `ssd_reference` in chunks of rows, as matmuls (Mamba2's SSD form).

    Rows are padded to whole chunks of `chunk_size`. Within a chunk, outputs come from a
    causal, decay-weighted [L, L] score matrix C B^T (like attention); each chunk also
    summarizes its rows into the state at its end. The states entering the chunks then follow
    from one [chunks, chunks] decay-weighted sum of those summaries, and each row reads its
    chunk's entering state. A sequence start (`sequence_starts`) cuts every decay across it,
    so packed sequences never see each other, wherever the chunk boundaries fall.

    Args:
      x, dt, a, b, c, d, positions, segment_ids, num_slots: As `ssd_reference`.
      chunk_size: Static rows per chunk (any size; 128 or 256 on accelerators).

    Returns:
      As `ssd_reference`: (y [T, heads, P], final states [num_slots, heads, P, N]).

    Raises:
      ValueError: Mismatched shapes, or chunk_size < 1.
    """
    _check_shapes(x, dt, a, b, c, d, positions, segment_ids)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1; got {chunk_size=}")
    acc = accumulation_dtype(x.dtype)
    rows, heads, head_dim = x.shape
    groups, state_size = b.shape[1:]
    per_group = heads // groups
    length = chunk_size
    chunks = -(-rows // length)
    padded = chunks * length
    valid = segment_ids >= 0
    dt = jnp.where(valid[:, None], dt, 0).astype(acc)
    # Padding rows appended here each start their own run.
    run = _pad_rows(sequence_runs(positions, segment_ids), padded)
    run = jnp.where(jnp.arange(padded) < rows, run, rows + 1 + jnp.arange(padded))

    def chunked(value: jax.Array) -> jax.Array:
        return _pad_rows(value.astype(acc), padded).reshape(chunks, length, *value.shape[1:])

    x_dt = chunked(x * dt[:, :, None]).reshape(chunks, length, groups, per_group, head_dim)
    b, c = chunked(b), chunked(c)  # [C, L, G, N]
    log_decay = chunked(dt * a[None])  # [C, L, H]
    run = run.reshape(chunks, length)
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
    same_run = (run[:, :, None] == run[:, None, :]) & causal[None]  # [C, t, s]
    decay = jnp.where(same_run[..., None], jnp.exp(_segment_sums(log_decay)), 0)
    decay = decay.reshape(chunks, length, length, groups, per_group)

    # Within each chunk: y_t += sum_s (C_t . B_s) decay[t, s] dt_s x_s.
    scores = jnp.einsum("ctgn,csgn->ctsg", c, b)[..., None] * decay
    y = jnp.einsum("ctsgr,csgrp->ctgrp", scores, x_dt)

    # Each chunk's own rows, summarized into the state at its end (of its last row's run).
    summaries = jnp.einsum("csgr,csgrp,csgn->cgrpn", decay[:, -1], x_dt, b)

    # The run of the row before each chunk; rows still in it carry the entering state.
    before = jnp.concatenate([jnp.full((1,), -1, run.dtype), run[:-1, -1]])
    carries = run == before[:, None]  # [C, L]
    cumulative = jnp.cumsum(log_decay, axis=1)  # [C, L, H], from the chunk's start
    # Entering state of chunk z: sum over c < z of summaries[c], decayed through chunks
    # c+1 .. z-1, each of which must carry its whole length (no start inside).
    whole = carries[:, -1]
    log_whole = jnp.where(whole[:, None], cumulative[:, -1], 0)  # [C, H]
    through = _segment_sums(log_whole)  # [z, c]: chunks c+1 .. z
    through = jnp.concatenate([jnp.zeros_like(through[:1]), through[:-1]])  # c+1 .. z-1
    weights = jnp.where(_open_paths(whole)[..., None], jnp.exp(through), 0)  # [z, c, H]
    weights = weights.reshape(chunks, chunks, groups, per_group)
    entering = jnp.einsum("zcgr,cgrpn->zgrpn", weights, summaries)

    # Rows still in the run from before their chunk read its entering state, decayed to them.
    read_decay = jnp.where(carries[..., None], jnp.exp(cumulative), 0)
    read_decay = read_decay.reshape(chunks, length, groups, per_group)
    y = y + read_decay[..., None] * jnp.einsum("ctgn,cgrpn->ctgrp", c, entering)

    y = y.reshape(padded, heads, head_dim)[:rows] + d[None, :, None] * x.astype(acc)
    y = jnp.where(valid[:, None, None], y, 0)
    finals = _final_states(x_dt, b, decay, read_decay, entering, segment_ids, num_slots, length)
    return y, finals.reshape(num_slots, heads, head_dim, state_size)


def _open_paths(whole: jax.Array) -> jax.Array:
    """bool [z, c]: c < z and every chunk strictly between them carries its whole length
    (`whole` [C]: no sequence starts inside the chunk), so chunk c's state reaches chunk z."""
    breaks = jnp.cumsum(~whole)  # chunks 0..k with a start inside
    before = jnp.concatenate([jnp.zeros_like(breaks[:1]), breaks[:-1]])  # breaks[z - 1]
    index = jnp.arange(whole.shape[0])
    return (index[:, None] > index[None, :]) & (before[:, None] == breaks[None, :])


def _final_states(x_dt, b, decay, read_decay, entering, segment_ids, num_slots, length):
    """[S, G, R, P, N]: each slot's state after its last row, from that row's chunk alone."""
    last, present = last_rows(segment_ids, num_slots)
    chunk, row = last // length, last % length
    own = jnp.einsum("slgr,slgrp,slgn->sgrpn", decay[chunk, row], x_dt[chunk], b[chunk])
    carried = read_decay[chunk, row][..., None, None] * entering[chunk]
    return jnp.where(present[:, None, None, None, None], own + carried, 0)


@jax.jit
def ssd_step(
    state: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
    valid: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One decode row per slot: the recurrence's step from each slot's state.

    Args:
      state: [S, heads, P, N] states (float32 or wider).
      x: [S, heads, P]; dt: [S, heads]; a, d: [heads]; b, c: [S, groups, N].
      valid: bool [S]: slots with a row this step; the others keep their state.

    Returns:
      (y [S, heads, P] in the accumulation dtype, zero for idle slots; the new states).
    """
    acc = state.dtype
    per_group = x.shape[1] // b.shape[1]
    dt = jnp.where(valid[:, None], dt, 0).astype(acc)
    b_h = jnp.repeat(b.astype(acc), per_group, axis=1)  # [S, heads, N]
    c_h = jnp.repeat(c.astype(acc), per_group, axis=1)
    x = x.astype(acc)
    update = (dt[:, :, None] * x)[..., None] * b_h[:, :, None, :]
    new = jnp.exp(dt * a[None])[:, :, None, None] * state + update
    new = jnp.where(valid[:, None, None, None], new, state)
    y = jnp.einsum("shpn,shn->shp", new, c_h) + d[None, :, None] * x
    return jnp.where(valid[:, None, None], y, 0), new


@functools.partial(jax.jit, static_argnames=("limit",))
def time_step(dt: jax.Array, dt_bias: jax.Array, limit: tuple[float, float]) -> jax.Array:
    """`clip(softplus(dt + dt_bias), *limit)` in float32 or wider: [T, heads]."""
    acc = accumulation_dtype(dt.dtype)
    return jnp.clip(jax.nn.softplus(dt.astype(acc) + dt_bias.astype(acc)[None]), *limit)


@jax.jit
def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    positions: jax.Array,
    segment_ids: jax.Array,
) -> jax.Array:
    """Causal depthwise convolution over packed rows, restarting at each sequence start.

    out[t] = bias + sum_k weight[k] * x[t - (K - 1) + k], where rows before the start of row
    t's sequence read as zeros (Hugging Face's zero left padding of each sequence).

    Args:
      x: [T, channels] inputs.
      weight: [K, channels] kernel; weight[K - 1] multiplies the current row.
      bias: [channels], or None.
      positions, segment_ids: [T] rows' positions and sequences (`models.ssd.sequence_starts`).

    Returns:
      [T, channels] in the accumulation dtype, before the activation.
    """
    acc = accumulation_dtype(x.dtype)
    kernel = weight.shape[0]
    run = sequence_runs(positions, segment_ids)
    x = x.astype(acc)
    out = jnp.zeros_like(x) if bias is None else jnp.broadcast_to(bias.astype(acc), x.shape)
    for shift in range(kernel):
        earlier = jnp.pad(x, ((shift, 0), (0, 0)))[: x.shape[0]]
        same = jnp.pad(run, (shift, 0), constant_values=-1)[: x.shape[0]] == run
        out = out + jnp.where(same[:, None], earlier, 0) * weight[kernel - 1 - shift][None]
    return out


@functools.partial(jax.jit, static_argnames=("num_slots", "width"))
def conv_states(
    x: jax.Array, positions: jax.Array, segment_ids: jax.Array, *, num_slots: int, width: int
) -> jax.Array:
    """[num_slots, width, channels]: each slot's last `width` conv inputs, oldest first.

    Rows before the start of the slot's last sequence, and slots without rows, are zeros: the
    state a decode step (`causal_conv1d_step`) continues from.
    """
    last, present = last_rows(segment_ids, num_slots)
    run = sequence_runs(positions, segment_ids)
    rows = last[:, None] - (width - 1) + jnp.arange(width)[None]  # [S, width]
    inside = (rows >= 0) & (run[jnp.maximum(rows, 0)] == run[last][:, None]) & present[:, None]
    return jnp.where(inside[..., None], x[jnp.maximum(rows, 0)], 0).astype(x.dtype)


def prefill_slot_states(
    conv_cache: jax.Array,
    state_cache: jax.Array,
    conv_input: jax.Array,
    finals: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """A mixer's per-slot caches after a prefill: each slot this call's rows reach takes its
    sequence's last conv inputs (`conv_states` of `conv_input`, as wide as `conv_cache`) and its
    final recurrent state (`finals` [slots, ...]); the other slots keep theirs."""
    slots, width = conv_cache.shape[:2]
    present = last_rows(segment_ids, slots)[1]
    states = conv_states(conv_input, positions, segment_ids, num_slots=slots, width=width)
    conv = jnp.where(present[:, None, None], states.astype(conv_cache.dtype), conv_cache)
    at = present.reshape(-1, *(1,) * (state_cache.ndim - 1))
    return conv, jnp.where(at, finals.astype(state_cache.dtype), state_cache)


@jax.jit
def causal_conv1d_step(
    state: jax.Array,
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    valid: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One decode row per slot through the convolution.

    Args:
      state: [S, K - 1, channels]: each slot's previous K - 1 inputs, oldest first.
      x: [S, channels] this step's inputs.
      weight, bias: As `causal_conv1d`.
      valid: bool [S]: slots with a row this step; the others keep their state.

    Returns:
      ([S, channels] outputs in the accumulation dtype, the new [S, K - 1, channels] state).
    """
    acc = accumulation_dtype(x.dtype)
    window = jnp.concatenate([state, x[:, None].astype(state.dtype)], axis=1)  # [S, K, C]
    out = jnp.einsum("skc,kc->sc", window.astype(acc), weight.astype(acc))
    if bias is not None:
        out = out + bias.astype(acc)[None]
    return out, jnp.where(valid[:, None, None], window[:, 1:], state)


@functools.partial(jax.jit, static_argnames=("group_size", "eps"))
def gated_rms_norm(
    y: jax.Array, z: jax.Array, weight: jax.Array, *, group_size: int, eps: float
) -> jax.Array:
    """Hugging Face's `MambaRMSNormGated` with groups: y * silu(z), RMS-normalized over each
    run of `group_size` channels, times `weight`. [T, channels] -> [T, channels] in y's dtype
    (the normalization in float32 or wider)."""
    acc = accumulation_dtype(y.dtype)
    gated = y.astype(acc) * jax.nn.silu(z.astype(acc))
    grouped = gated.reshape(*gated.shape[:-1], -1, group_size)
    mean_square = jnp.mean(grouped * grouped, axis=-1, keepdims=True)
    normed = (grouped * lax.rsqrt(mean_square + eps)).reshape(gated.shape)
    return weight[None] * normed.astype(y.dtype)


def extend_chunks(
    step: Callable[[Any, Any, jax.Array], tuple[jax.Array, Any]],
    rows: Any,
    positions: jax.Array,
    segment_ids: jax.Array,
    states: Any,
) -> tuple[jax.Array, Any]:
    """A recurrence over a serving step's EXTEND rows, every chunk's rows side by side.

    A step's rows are chunks: each slot's tokens, one run of consecutive rows at consecutive
    positions. Iteration j steps the j-th row of every chunk at once (`step` batched over the
    chunks), as many iterations as the longest chunk has rows: a decode step (one row per
    chunk) is one batched step, not one step per row. Each chunk starts from its slot's state
    (zero at position 0) and leaves its final state in its slot.

    Args:
      step: `(states [C, ...], rows [C, ...], valid bool [C]) -> (out [C, ...], states)`: one
        row of each of C chunks; a chunk without a row this iteration (not `valid`) keeps its
        state.
      rows: A pytree of [T, ...] per-row inputs.
      positions, segment_ids: [T]; segment id -1 marks padding.
      states: A pytree of [slots, ...] per-slot states.

    Returns:
      ([T, ...] outputs, zero on padding rows; the states with each chunk's slot updated).
    """
    count = positions.shape[0]
    chunks = min(count, jax.tree.leaves(states)[0].shape[0])
    valid = segment_ids >= 0
    index = jnp.arange(count, dtype=jnp.int32)
    before_segment = jnp.concatenate([jnp.full((1,), -2, jnp.int32), segment_ids[:-1]])
    before_position = jnp.concatenate([jnp.full((1,), -2, jnp.int32), positions[:-1]])
    opens = valid & ((segment_ids != before_segment) | (positions != before_position + 1))
    chunk = jnp.where(valid, jnp.cumsum(opens) - 1, chunks)
    first = jnp.zeros((chunks,), jnp.int32).at[jnp.where(opens, chunk, chunks)].set(index)
    length = jnp.zeros((chunks,), jnp.int32).at[chunk].add(1, mode="drop")
    live = length > 0
    slot = jnp.where(live, jnp.maximum(segment_ids[first], 0), 0)
    fresh = positions[first] == 0

    def entering(state):
        held = state[slot]
        return jnp.where(_rows_mask(fresh, held), 0, held)

    def iteration(j, carry):
        chunk_states, out = carry
        taken = (j < length) & live
        at = jnp.minimum(first + j, count - 1)
        inputs = jax.tree.map(lambda x: x[at], rows)
        result, chunk_states = step(chunk_states, inputs, taken)
        out = out.at[jnp.where(taken, at, count)].set(result.astype(out.dtype), mode="drop")
        return chunk_states, out

    chunk_states = jax.tree.map(entering, states)
    shape = jax.eval_shape(step, chunk_states, jax.tree.map(lambda x: x[:chunks], rows), live)[0]
    out = jnp.zeros((count, *shape.shape[1:]), shape.dtype)
    # The first iteration outside the loop types the outputs as the rows vary (in shard_map).
    carry = iteration(0, (chunk_states, out))
    chunk_states, out = lax.fori_loop(1, jnp.max(length), iteration, carry)
    target = jnp.where(live, slot, jax.tree.leaves(states)[0].shape[0])
    states = jax.tree.map(
        lambda state, final: state.at[target].set(final.astype(state.dtype), mode="drop"),
        states,
        chunk_states,
    )
    return out, states


def _rows_mask(mask: jax.Array, like: jax.Array) -> jax.Array:
    """`mask` [C] shaped to broadcast over `like` [C, ...]."""
    return mask.reshape(mask.shape + (1,) * (like.ndim - 1))


def check_stepped_rows(
    h: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    phase: RowsPhase,
    slots: int | None,
) -> None:
    """Refuses a recurrent mixer's call whose rows do not fit it: positions or segment ids not
    [T] for h [T, hidden], a DECODE call without a cache (`slots` None) or with other than one
    row per slot, an EXTEND call without a cache (both step the slots' states).

    Raises:
      ValueError: As said.
    """
    rows = h.shape[0]
    if positions.shape != (rows,) or segment_ids.shape != (rows,):
        raise ValueError(
            f"positions and segment_ids must be [T] for h [T, hidden]; got {h.shape=}, "
            f"{positions.shape=}, {segment_ids.shape=}"
        )
    if phase is RowsPhase.EXTEND and slots is None:
        raise ValueError("an EXTEND call steps its slots' states; it needs a cache")
    if phase is RowsPhase.DECODE and slots != rows:
        raise ValueError(
            "a DECODE call needs a cache and one row per cache slot (row i is slot i); "
            f"got {rows} rows and cache slots {slots}. Use `decode_rows` to lay them out."
        )
