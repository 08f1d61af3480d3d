"""The pure per-row math of the gated delta rule (Gated DeltaNet's linear attention) over packed
token rows: the recurrence one row at a time (the spec), its chunked form (the WY / UT
transform over chunks of rows) for prefill and training, and the one-row decode step.

Per value head h, with the key head it reads (k-head h // (v_heads // k_heads)), row t of a
sequence updates the state S [k_dim, v_dim] and reads it out:

    S   = exp(g_t) * S                              (the gate, before the update)
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T      (the delta rule)
    o_t = S^T q_t

where q and k are L2-normalized over k_dim (eps 1e-6 inside the root) and q is scaled by
k_dim^-1/2. The log gate g_t is a scalar per value head (Gated DeltaNet) or one per key channel
of each value head (Kimi Delta Attention: it scales the state's rows, `exp(g_t)[:, None] * S`).
Rows are one attention-DP rank's packed sequences (`TokenRows`): a row starts a new
sequence, with a zero state, where its segment id differs from the row before it or its
position is 0 (`models.layers.mixers.ssd.sequence_starts`). Padding rows (segment id -1)
contribute nothing and read out zeros. The state and all sums are float32, or float64 for
float64 inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from pallas_kernels.delta_rule_scan import chunk_state_scan
from pallas_kernels.vjp import with_reference_vjp

from .ssd import accumulation_dtype, last_rows, sequence_runs, sequence_starts

SCANS = ("jnp", "pallas", "interpret")
"""How `gated_delta_rule_chunked` carries the state across chunks: a `lax.scan` of `jnp` matmuls
(the outputs inside the loop), the Pallas Triton kernel `pallas_kernels.delta_rule_scan.
chunk_state_scan` (GPU, scalar gate; the state alone in the loop, the outputs batched matmuls
after it), or that kernel in the Pallas interpreter (CPU tests)."""


def default_scan(g: jax.Array, beta: jax.Array) -> str:
    """The `SCANS` entry a prefill takes by default: the Pallas kernel on a GPU for a scalar gate
    per head (24-26x a row-by-row `lax.scan` against the `jnp` scan's 16x on an H200,
    `benchmarks/RESULTS.md` run 36), the `jnp` scan elsewhere and for per-channel gates."""
    return "pallas" if jax.default_backend() == "gpu" and g.shape == beta.shape else "jnp"


L2_EPS = 1e-6
"""The epsilon inside the root of the q/k L2 norm (flash-linear-attention's and transformers')."""


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    """`x / sqrt(sum(x^2) + eps)` over the last axis, in x's dtype."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _check_shapes(q, k, v, g, beta, positions, segment_ids) -> None:
    rows, heads = v.shape[:2]
    if (
        q.ndim != 3
        or k.shape != q.shape
        or q.shape[0] != rows
        or heads % q.shape[1]
        or g.shape not in ((rows, heads), (rows, heads, q.shape[2]))
        or beta.shape != (rows, heads)
        or positions.shape != (rows,)
        or segment_ids.shape != (rows,)
    ):
        raise ValueError(
            "gated delta rule inputs must be q and k [T, k_heads, k_dim], v [T, v_heads, v_dim] "
            "with k_heads dividing v_heads, g [T, v_heads] or [T, v_heads, k_dim], beta "
            "[T, v_heads], positions and segment_ids "
            f"[T]; got {q.shape=}, {k.shape=}, {v.shape=}, {g.shape=}, {beta.shape=}, "
            f"{positions.shape=}, {segment_ids.shape=}"
        )


def _by_value_head(x: jax.Array, v_heads: int) -> jax.Array:
    """[N, k_heads, ...] per key head expanded to [N, v_heads, ...] (value head h reads key head
    h // (v_heads // k_heads))."""
    return jnp.repeat(x, v_heads // x.shape[1], axis=1)


def _prepared(q, k, v, g, beta, segment_ids):
    """q, k normalized (q scaled), per key head; v, and g and beta zero on padding rows; all in
    the accumulation dtype."""
    acc = accumulation_dtype(v.dtype)
    q = l2_normalize(q.astype(acc)) * q.shape[-1] ** -0.5
    k = l2_normalize(k.astype(acc))
    valid = (segment_ids >= 0)[:, None]
    g = jnp.where(valid if g.ndim == 2 else valid[..., None], g, 0).astype(acc)
    beta = jnp.where(valid, beta, 0).astype(acc)
    return q, k, v.astype(acc), g, beta


@functools.partial(jax.jit, static_argnames=("num_slots",))
def gated_delta_rule_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    num_slots: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence one row at a time (`lax.scan` over rows): the spec of
    `gated_delta_rule_chunked`.

    Args:
      q: [T, k_heads, k_dim] queries, before the L2 norm.
      k: [T, k_heads, k_dim] keys, before the L2 norm.
      v: [T, v_heads, v_dim] values; v_heads a multiple of k_heads.
      g: [T, v_heads] log gates (<= 0: the state is multiplied by exp(g)), or [T, v_heads,
        k_dim] per key channel (row c of the state by exp(g[..., c])).
      beta: [T, v_heads] write strengths (in (0, 1) after a sigmoid).
      positions: [T] int32 position of each row within its sequence.
      segment_ids: [T] int32 slot of each row's sequence; -1 marks padding.
      num_slots: Static: how many per-slot final states to return.

    Returns:
      (o [T, v_heads, v_dim], final states [num_slots, v_heads, k_dim, v_dim]): the state
      after each slot's last row, zero for a slot without rows; both in the accumulation dtype.
    """
    _check_shapes(q, k, v, g, beta, positions, segment_ids)
    q, k, v, g, beta = _prepared(q, k, v, g, beta, segment_ids)
    q, k = (_by_value_head(x, v.shape[1]) for x in (q, k))
    starts = sequence_starts(positions, segment_ids)

    def step(carry, row):
        state, finals = carry
        q_t, k_t, v_t, g_t, beta_t, start, slot = row
        state = jnp.where(start, 0, state) * jnp.exp(g_t)[..., None]
        delta = beta_t[:, None] * (v_t - jnp.einsum("hkv,hk->hv", state, k_t))
        state = state + k_t[:, :, None] * delta[:, None, :]
        out = jnp.einsum("hkv,hk->hv", state, q_t)
        finals = finals.at[jnp.where(slot >= 0, slot, num_slots)].set(state, mode="drop")
        return (state, finals), jnp.where(slot >= 0, out, 0)

    state = jnp.zeros((v.shape[1], q.shape[2], v.shape[2]), v.dtype)
    finals = jnp.zeros((num_slots, *state.shape), v.dtype)
    rows = (q, k, v, _channel_gates(g, beta), beta, starts, segment_ids)
    (_, finals), out = lax.scan(step, (state, finals), rows)
    return out, finals


def _channel_gates(g: jax.Array, beta: jax.Array) -> jax.Array:
    """The log gates as [..., H, k_dim] or, for a scalar gate per head (g shaped as beta),
    [..., H, 1]: either scales a state [..., H, k_dim, v_dim] by `exp(gates)[..., None]`."""
    return g[..., None] if g.shape == beta.shape else g


def _pad_rows(x: jax.Array, rows: int, fill=0) -> jax.Array:
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=fill)


@functools.partial(jax.jit, static_argnames=("chunk_size", "num_slots", "scan", "storage"))
def gated_delta_rule_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    chunk_size: int = 64,
    num_slots: int = 0,
    scan: str = "jnp",
    storage: DTypeLike | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence of `gated_delta_rule_reference` in chunks of rows, as matmuls.

    Rows are padded to whole chunks of `chunk_size`. Within a chunk the delta rule's updates
    compose into one lower-triangular solve (the WY / UT transform): with A[t, s] =
    beta_t (k_t . k_s) exp(G_t - G_s) for s < t in the same sequence (G the gates' sum from the
    chunk's start), U = (I + A)^-1 (beta v) are the values to write before the entering state
    is subtracted, and W = (I + A)^-1 (beta k exp(G)) what reads that state. A `lax.scan` over
    the chunks then carries the state: each chunk's corrected values are U - W S, its outputs
    its rows' read of S plus the causal, decay-weighted q k^T of its own rows, and its state at
    its end S exp(G_last) + sum_s k_s exp(G_last - G_s) (U - W S)_s.

    A sequence start cuts every term across it: A, the causal scores and the end-of-chunk
    update only pair rows of one sequence, and only rows still in the sequence the chunk
    entered read (and decay) the carried state, wherever the chunk boundaries fall.

    The gates, A and its inverse, the carried state and every matmul's sums are in the
    accumulation dtype (float32, or float64 for float64 inputs). The row-sized terms between
    the matmuls (q and k, U and W, the decayed keys and queries, the scores, the corrected
    values and each chunk's entering state) are stored in `storage`: by default v's dtype
    where it is narrower (bf16 inputs: bf16, as flash-linear-attention's kernels store them),
    else the accumulation dtype. At Qwen3-Next's shape on an H100 bf16 storage took the rule
    with the kernel from 1.16 to 0.79 ms at 4096 rows, its relative error against the float32
    recurrence from 5.8e-4 (float32 storage, TF32 products) to 5.1e-3 (benchmarks/RESULTS.md
    run 41).

    Args:
      q, k, v, g, beta, positions, segment_ids, num_slots: As `gated_delta_rule_reference`.
      chunk_size: Static rows per chunk (64, as flash-linear-attention's kernels).
      scan: Static, one of `SCANS`: how the state crosses chunks. The kernel's gradient is the
        `jnp` scan's.
      storage: Static float dtype of the row-sized terms between the matmuls, no wider than
        the accumulation dtype; None: v's dtype where narrower, else the accumulation dtype.

    Returns:
      As `gated_delta_rule_reference`: (o [T, v_heads, v_dim], final states [num_slots,
      v_heads, k_dim, v_dim]).

    Raises:
      ValueError: Mismatched shapes, chunk_size < 1, an unknown scan, the kernel asked for a
        per-channel gate, or a storage dtype that is no float or wider than the accumulation.
    """
    _check_shapes(q, k, v, g, beta, positions, segment_ids)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1; got {chunk_size=}")
    if scan not in SCANS or (scan != "jnp" and g.shape != beta.shape):
        raise ValueError(
            f"scan must be one of {SCANS}, and the Pallas scan takes only a scalar gate per "
            f"head (Kimi's per-channel gate keeps the jnp scan); got {scan=}, {g.shape=}"
        )
    acc = accumulation_dtype(v.dtype)
    store = _storage_dtype(storage, v.dtype, acc)
    q, k, v, g, beta = _prepared(q, k, v, g, beta, segment_ids)
    rows, heads, v_dim = v.shape
    k_dim = k.shape[-1]
    length = chunk_size
    chunks = -(-rows // length)
    padded = chunks * length
    # Padding rows appended here each start their own run.
    run = _pad_rows(sequence_runs(positions, segment_ids), padded)
    run = jnp.where(jnp.arange(padded) < rows, run, rows + 1 + jnp.arange(padded))
    run = run.reshape(chunks, length)

    def chunked(value: jax.Array) -> jax.Array:  # [T, H, ...] -> [C, H, L, ...]
        value = _pad_rows(value, padded).reshape(chunks, length, *value.shape[1:])
        return jnp.moveaxis(value, 1, 2)

    def kept(value: jax.Array) -> jax.Array:
        return value.astype(store)

    dot = functools.partial(jnp.einsum, preferred_element_type=acc)
    g = _channel_gates(g, beta)  # [T, H, 1] for a scalar gate, else [T, H, k_dim]
    q_keys, k_keys, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    q, k = (_by_value_head(x, heads) for x in (q_keys, k_keys))  # [C, H, L, k_dim]
    cumulative = jnp.cumsum(g, axis=2)  # [C, H, L, 1 or k_dim]: G_t, from the chunk's start
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
    same = (run[:, :, None] == run[:, None, :]) & causal[None]  # [C, t, s]
    # Rows still in the run the chunk entered read (and decay) the carried state.
    before = jnp.concatenate([jnp.full((1,), -1, run.dtype), run[:-1, -1]])
    carries = (run == before[:, None])[:, None, :, None]  # [C, 1, L, 1]
    entering = jnp.where(carries, jnp.exp(cumulative), 0)
    k_beta = k * beta[..., None]
    v_beta = kept(v * beta[..., None])
    q_entering = kept(q * entering)
    # The end-of-chunk state sums the rows of the chunk's last run, decayed to its end.
    in_last = (run == run[:, -1:])[:, None, :, None]  # [C, 1, L, 1]
    k_end = kept(k * jnp.where(in_last, jnp.exp(cumulative[:, :, -1:] - cumulative), 0))
    carried = jnp.where(carries[:, :, -1], jnp.exp(cumulative[:, :, -1]), 0)  # [C, H, 1 | k]
    per_channel = g.shape[-1] > 1
    if per_channel:
        # Per-channel decays pair every two rows in every key channel: [H, L, L, k_dim] per
        # chunk, made inside the scan so that only one chunk's are alive at a time.
        intra = (kept(q), kept(k), kept(k_beta), v_beta, entering, cumulative, same)
    else:
        # q k^T and k k^T per key head, then decayed and weighted per value head.
        pair = _pair_decays(cumulative[..., 0], same[:, None])  # [C, H, t, s]
        q_k, k_k = (dot("cgtk,cgsk->cgts", kept(x), kept(k_keys)) for x in (q_keys, k_keys))
        scores = kept(_by_value_head(q_k, heads) * pair)
        products = _by_value_head(k_k, heads) * (beta[..., None] * pair)
        values, reads = _ut_transform(products, v_beta, kept(k_beta * entering))
        intra = (values, reads, scores)

    def step(state, chunk):
        intra, q_entering, k_end, carried = chunk
        if per_channel:
            q, k, k_beta, v_beta, entering, cumulative, same = intra
            pair = _pair_decays(jnp.moveaxis(cumulative, -1, 0), same[None, None])  # [c, H, t, s]
            scores = kept(dot("htc,hsc,chts->hts", q, k, pair))
            products = dot("htc,hsc,chts->hts", k_beta, k, pair)
            values, reads = _ut_transform(products, v_beta, kept(k_beta * entering))
        else:
            values, reads, scores = intra
        entered = kept(state)
        new = kept(values - dot("htk,hkv->htv", reads, entered))
        out = dot("htk,hkv->htv", q_entering, entered) + dot("hts,hsv->htv", scores, new)
        end = state * carried[..., None] + dot("htk,htv->hkv", k_end, new)
        return end, (out, new, entered if num_slots else None)

    def jnp_scan(intra, q_entering, k_end, carried):
        # Zeros shaped from the inputs, so that under shard_map the carry varies as they do.
        state = jnp.zeros_like(k_end[0, :, 0, :, None] * v_beta[0, :, 0, None, :], acc)
        return lax.scan(step, state, (intra, q_entering, k_end, carried))[1]

    if scan == "jnp":
        out, new, states = jnp_scan(intra, q_entering, k_end, carried)
    else:

        def pallas_scan(intra, q_entering, k_end, carried):
            values, reads, scores = intra
            new, states = chunk_state_scan(
                values, reads, k_end, carried[..., 0], interpret=scan == "interpret"
            )
            out = dot("chtk,chkv->chtv", q_entering, states)
            out = out + dot("chts,chsv->chtv", scores, new)
            return out, new, states if num_slots else None

        kernel = with_reference_vjp(pallas_scan, jnp_scan)
        out, new, states = kernel(intra, q_entering, k_end, carried)
    o = jnp.moveaxis(out, 2, 1).reshape(padded, heads, v_dim)[:rows]
    o = jnp.where((segment_ids >= 0)[:, None, None], o, 0)
    if not num_slots:
        return o, jnp.zeros((0, heads, k_dim, v_dim), acc)
    return o, _final_states(k, new, states, cumulative, entering, run, segment_ids, num_slots)


def _storage_dtype(storage: DTypeLike | None, dtype: jnp.dtype, acc: jnp.dtype) -> jnp.dtype:
    """`gated_delta_rule_chunked`'s storage dtype: `storage`, checked, or by default `dtype`
    (v's) where it is narrower than the accumulation dtype `acc`, else `acc`."""
    if storage is None:
        return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize < jnp.dtype(acc).itemsize else acc
    storage = jnp.dtype(storage)
    if not jnp.issubdtype(storage, jnp.floating) or storage.itemsize > jnp.dtype(acc).itemsize:
        raise ValueError(
            f"storage must be a float dtype no wider than the accumulation dtype {acc}; "
            f"got {storage=}"
        )
    return storage


def _pair_decays(cumulative: jax.Array, same: jax.Array) -> jax.Array:
    """exp(G_t - G_s) [..., t, s] from cumulative log gates [..., L], zero where `same`
    (broadcast to [..., t, s]) says the rows are not of one sequence with s <= t; the exponent
    is masked first, so nothing overflows."""
    gap = cumulative[..., :, None] - cumulative[..., None, :]
    return jnp.where(same, jnp.exp(jnp.where(same, gap, 0)), 0)


def _ut_transform(
    products: jax.Array, v_beta: jax.Array, k_reads: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """U = (I + A)^-1 (beta v) and W = (I + A)^-1 (beta k exp(G)), A the strictly lower part of
    `products` [..., t, s] (beta_t (k_t . k_s) decayed from s to t), U and W in `v_beta`'s and
    `k_reads`' (the storage) dtype.

    The inverse is built at HIGHEST precision in `products`' dtype; its two applications run
    at the ambient one from the inverse in the storage dtype (TF32 or bf16 on a GPU, where
    flash-linear-attention multiplies in bf16): on an H200 at Qwen3-Next's shape the rule then
    took 1.05 against 1.08 ms at 4096 rows with an error against the recurrence no larger
    (float32 storage, benchmarks/RESULTS.md run 40)."""
    length = products.shape[-1]
    strictly_lower = jnp.tril(jnp.ones((length, length), bool), -1)
    inverse = _unit_lower_inverse(jnp.where(strictly_lower, products, 0))
    inverse = inverse.astype(v_beta.dtype)

    def apply(x: jax.Array) -> jax.Array:
        out = jnp.einsum("...ts,...sd->...td", inverse, x, preferred_element_type=products.dtype)
        return out.astype(x.dtype)

    return apply(v_beta), apply(k_reads)


def _unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """(I + N)^-1 [..., L, L] for N strictly lower triangular, by doubling blocks: the inverses
    of the diagonal blocks of size b give those of size 2b, the new corner being
    -inv(bottom) N21 inv(top). Batched matmuls where a batched triangular solve (cuBLAS's, the
    GPU's) runs one small system at a time; as stable as substitution (no powers of N)."""
    length = lower.shape[-1]
    full = 1 << (length - 1).bit_length()
    if full != length:  # identity rows and columns past L leave the top-left block alone
        pad = [(0, 0)] * (lower.ndim - 2) + [(0, full - length)] * 2
        lower = jnp.pad(lower, pad)
    batch = lower.shape[:-2]
    product = functools.partial(jnp.einsum, "...ij,...jk->...ik", precision=lax.Precision.HIGHEST)
    inverse = jnp.ones((*batch, full, 1, 1), lower.dtype)  # the diagonal blocks of size 1
    size = 1
    while size < full:
        pairs = full // (2 * size)
        top, bottom = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        starts = 2 * size * jnp.arange(pairs)[:, None] + jnp.arange(size)[None, :]
        corner = lower[..., (starts + size)[:, :, None], starts[:, None, :]]  # [..., pairs, b, b]
        corner = -product(product(bottom, corner), top)
        upper = jnp.concatenate([top, jnp.zeros_like(top)], axis=-1)
        below = jnp.concatenate([corner, bottom], axis=-1)
        inverse = jnp.concatenate([upper, below], axis=-2)
        size *= 2
    return inverse[..., 0, :length, :length]


def _final_states(k, new, states, cumulative, entering, run, segment_ids, num_slots):
    """[S, H, k_dim, v_dim]: each slot's state after its last row, from that row's chunk: its
    entering state decayed to the row, plus the row's run's own writes up to it."""
    length = run.shape[1]
    last, present = last_rows(segment_ids, num_slots)
    chunk, row = last // length, last % length
    mine = (run[chunk] == run[chunk, row][:, None]) & (jnp.arange(length)[None] <= row[:, None])
    mine = mine[:, None, :, None]  # [S, 1, L, 1]
    gap = cumulative[chunk, :, row][:, :, None] - cumulative[chunk]  # [S, H, L, 1 | k]
    weight = jnp.where(mine, jnp.exp(jnp.where(mine, gap, 0)), 0)
    own = jnp.einsum("shlk,shlv->shkv", weight * k[chunk], new[chunk])
    read = entering[chunk, :, row][..., None] * states[chunk]
    return jnp.where(present[:, None, None, None], own + read, 0)


@jax.jit
def gated_delta_rule_step(
    state: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    valid: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One decode row per slot: the recurrence's step from each slot's state.

    Args:
      state: [S, v_heads, k_dim, v_dim] states (float32 or wider).
      q, k: [S, k_heads, k_dim] (before the L2 norm); v: [S, v_heads, v_dim]; g: [S, v_heads]
        or per key channel [S, v_heads, k_dim]; beta: [S, v_heads].
      valid: bool [S]: slots with a row this step; the others keep their state.

    Returns:
      (o [S, v_heads, v_dim] in the state's dtype, zero for idle slots; the new states).
    """
    acc = state.dtype
    q = l2_normalize(q.astype(acc)) * q.shape[-1] ** -0.5
    k = l2_normalize(k.astype(acc))
    q, k = (_by_value_head(x, v.shape[1]) for x in (q, k))
    decayed = state * jnp.exp(_channel_gates(g, beta).astype(acc))[..., None]
    delta = beta.astype(acc)[..., None] * (v.astype(acc) - jnp.einsum("shkv,shk->shv", decayed, k))
    new = decayed + k[..., :, None] * delta[..., None, :]
    new = jnp.where(valid[:, None, None, None], new, state)
    out = jnp.einsum("shkv,shk->shv", new, q)
    return jnp.where(valid[:, None, None], out, 0), new
