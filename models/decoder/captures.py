"""The forward that also returns the residual stream entering chosen layers (auxiliary hidden
states, as EAGLE-3 drafting reads them), under `jit` and `lax.scan` alike."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

import boundary_jax as bj
from boundary_jax import residual_stream

from ..inputs.rows import TokenRows
from .model import CausalLM


def hidden_captured(
    model: CausalLM, rows: TokenRows, batch: bj.BatchFacts, capture_layers: Sequence[int]
) -> tuple[jax.Array, jax.Array]:
    """`model.hidden` (without caches), also returning the auxiliary hidden states of
    `capture_layers`, on this rank's attention rows.

    Capture index i < num_layers is the residual stream entering layer i (transformers'
    `output_hidden_states[i]`; 0 is the embedding output); i = num_layers is the residual
    the final norm reads (transformers' last hidden state is that residual after the norm,
    which is the first returned value). Captures are returned values, so they survive
    `jit` and `lax.scan`: in a scanned run every layer captures, and the wanted ones are
    picked after.

    Args:
      rows: This DP rank's block of packed rows.
      batch: The batch facts.
      capture_layers: Capture indices in [0, num_layers], in the order wanted (repeats
        allowed).

    Returns:
      (the final-norm output [rows, hidden], the captures [len(capture_layers), rows,
      hidden] in the residual's dtype; rows past the DP rank's token count are zero in
      both).

    Raises:
      ValueError: A capture index outside [0, num_layers].
      NotImplementedError: The model has hyper-connections (its residual is `hc_mult`
        streams per row, and the stack input is not), or its layers do not capture
        (`captures_hidden_states`).
    """
    if not model.captures_hidden_states:
        raise NotImplementedError(
            f"captured hidden states of {type(model).__name__} are not supported: only a "
            "mixer's input captures, and an MLP or MoE layer may start any layer of its pattern"
        )
    model.require_whole("hidden_captured")
    count = model.config.num_layers
    capture_layers = tuple(capture_layers)
    bad = [i for i in capture_layers if not isinstance(i, int) or not 0 <= i <= count]
    if bad or not capture_layers:
        raise ValueError(
            f"capture layers must be a non-empty list of indices in [0, {count}] (i < "
            f"{count}: the residual entering layer i; {count}: the residual the final norm "
            f"reads); got {list(capture_layers)}"
        )
    if model.options.hyper_connections is not None:
        raise NotImplementedError(
            "captures of a decoder with hyper-connections are not supported: its residual "
            "is hc_mult streams per row, not one hidden state"
        )
    wanted = frozenset(capture_layers)

    def captured(layer, carry, _):
        x, stream, _, hidden = layer.captured(*carry, rows, None)
        return (x, stream), hidden

    carry = (model.embed(rows.ids), residual_stream.start(batch))
    captures: dict[int, jax.Array] = {}
    for layers, block in model.blocks():
        if isinstance(block, bj.StackedLayers):
            carry, stacked = block.scan(captured, carry)
            captures.update(zip(layers, stacked, strict=True))
            continue
        with jax.named_scope(f"layer_{layers.start}"):
            if layers.start in wanted:
                carry, captures[layers.start] = captured(block, carry, None)
            else:
                x, stream, _ = block(*carry, rows, None)
                carry = (x, stream)
    hidden, captures[count] = residual_stream.final_norm_captured(
        *carry, model.final_read, skip_empty=True
    )
    mask = batch.valid_rows(hidden.shape[0])
    stacked = jnp.stack([captures[i] for i in capture_layers])
    if mask is not None:
        stacked = jnp.where(mask[None, :, None], stacked, jnp.zeros((), stacked.dtype))
    return hidden, stacked
