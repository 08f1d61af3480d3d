"""Decoder layers: what the layers that start with an attention stage share (entering the layer,
plainly or captured, and attending on the step's token rows), and the attention + FFN layer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import boundary_jax as bj

from ..inputs.rows import TokenRows
from ..layers.attention.kv_cache import KVCache
from ..layers.attention.self_attention import O_PROJ_BIAS, Attention
from ..layers.mlp import DOWN_PROJ_BIAS, SwiGLU
from ..layers.ungated_mlp import UngatedMlp
from .designs import LayerDesign, StageDesigns

Declare = Callable[[StageDesigns], tuple[bj.StageDeclaration, ...]]
"""A layer's stage declarations, from what its residual design built (`CausalLM.stage_facts`)."""


def declared_counts(
    boundary: bj.StageBoundary, name: str, stream: bj.ResidualStream
) -> bool | jax.Array | None:
    """Whether this rank adds the replicated part `name` of `boundary`'s stage
    (`StageBoundary.counts`), or None where the stage declares no such part."""
    declared = {part.name for part in boundary.declaration.replicated}
    return boundary.counts(name, stream) if name in declared else None


def attend_rows(
    attn: nnx.Module,
    h: jax.Array,
    rows: TokenRows,
    cache: Any,
    boundary: bj.StageBoundary,
    stream: bj.ResidualStream,
    adapters: jax.Array | None = None,
) -> tuple[jax.Array, Any]:
    """An attention's compute on `h`'s rows: its o_proj partial, and its updated cache. Where
    its stage (`boundary`) declares the o projection's bias replicated, the bias is added on
    the ranks the boundary counts it on; with `adapters` ([T] LoRA adapter of each of `h`'s
    rows) each row's adapter joins it."""
    counts_bias = declared_counts(boundary, O_PROJ_BIAS, stream)
    call = functools.partial(
        attn,
        h,
        rows.positions,
        rows.segment_ids,
        cache,
        phase=rows.phase,
        max_sequence_rows=rows.max_sequence_rows,
        window_rows=rows.window_rows,
        slots=rows.slots,
        counts_bias=counts_bias,
    )
    return call() if adapters is None else call(adapters=adapters)


class AttentionFirstLayer(nnx.Module):
    """A layer whose first stage is an attention (`attn_boundary`): entering it, plainly or
    captured, then `run_stages` (the subclass's) from the attention's input."""

    def __call__(
        self,
        x: jax.Array | bj.OwedOutput,
        stream: bj.ResidualStream,
        rows: TokenRows,
        cache: Any,
    ) -> tuple[bj.OwedOutput, bj.ResidualStream, Any]:
        h, stream = self.attn_boundary.prepare(x, stream)
        return self.run_stages(h, stream, rows, cache)

    def captured(
        self,
        x: jax.Array | bj.OwedOutput,
        stream: bj.ResidualStream,
        rows: TokenRows,
        cache: Any,
    ) -> tuple[bj.OwedOutput, bj.ResidualStream, Any, jax.Array]:
        """`__call__`, also returning the residual stream entering this layer (an auxiliary
        hidden state, as EAGLE-3 drafting reads it) on the attention's rows.

        For layer i that is transformers' `output_hidden_states[i]`: the stack input (the
        embedding output) for layer 0, else the residual after layer i - 1's update. The sum
        the previous stage owes completes unfused before the attention's add + norm (the same
        collectives run); a residual on attention-TP slices is gathered for the capture.
        """
        h, stream, hidden = self.attn_boundary.prepare_captured(x, stream, gathered=True)
        x, stream, cache = self.run_stages(h, stream, rows, cache)
        return x, stream, cache, hidden


class DecoderLayer(AttentionFirstLayer):
    """Attention + an FFN, joined to its neighbours by two stage boundaries; the norms around
    them are the layer's own modules, placed as the model's residual design says.

    Attributes:
      attn: Self-attention returning its o_proj partial.
      mlp: The FFN (a SwiGLU here) returning its down_proj partial.
      attn_boundary: The boundary before and after attention.
      ffn_boundary: The boundary before and after the FFN.
      input_norm, post_attn_norm, ...: The residual design's modules (`designs.LayerDesign`):
        HF `input_layernorm` is `input_norm`, `post_attention_layernorm` `post_attn_norm`,
        `pre_feedforward_layernorm` `pre_ffn_norm`, `post_feedforward_layernorm`
        `post_ffn_norm`.
    """

    def __init__(
        self,
        attn: Attention,
        mlp: nnx.Module,
        *,
        design: LayerDesign,
        declare: Declare,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        self.attn = attn
        self.mlp = mlp
        stages = design.attach(self, dtype=dtype, rngs=rngs)
        attn_stage, ffn_stage = declare(stages)
        self.attn_boundary, self.ffn_boundary = bj.append_stages(
            (attn_stage, stages.attn_norm), (ffn_stage, stages.ffn_norm), owner=self
        )

    def stages(self) -> tuple[tuple[str, bj.StageBoundary], ...]:
        """The layer's stage boundaries by name, in stack order (for plan reports)."""
        return ("attention", self.attn_boundary), ("ffn", self.ffn_boundary)

    def run_stages(
        self, h: jax.Array, stream: bj.ResidualStream, rows: TokenRows, cache: KVCache | None
    ) -> tuple[bj.OwedOutput, bj.ResidualStream, KVCache | None]:
        """The layer after its attention input: attention and its exit, the FFN's input, the
        FFN and its exit. Rows that name LoRA adapters carry them to each stage's compute rows
        (`bj.adapters.lora_rows`)."""
        if rows.adapters is None:
            y, cache = self.attend(h, rows, cache, stream)
        else:
            adapters = bj.adapters.lora_rows(self.attn_boundary, stream, rows.adapters)
            y, cache = attend_rows(
                self.attn, h, rows, cache, self.attn_boundary, stream, adapters=adapters
            )
        x, stream = self.attn_boundary.finish(y, stream)
        h, stream = self.ffn_boundary.prepare(x, stream)
        if rows.adapters is None or not isinstance(self.mlp, SwiGLU | UngatedMlp):
            # A MoE FFN takes no adapters (a model with experts adapts its attention only).
            x, stream = self.run_ffn(h, stream)
        else:
            adapters = bj.adapters.lora_rows(self.ffn_boundary, stream, rows.adapters)
            y = self.mlp(h, adapters=adapters, **self.mlp_bias_counts(stream))
            x, stream = self.ffn_boundary.finish(y, stream)
        return x, stream, cache

    def attend(
        self, h: jax.Array, rows: TokenRows, cache: KVCache | None, stream: bj.ResidualStream
    ) -> tuple[jax.Array, KVCache | None]:
        """The attention's compute: its o_proj partial on `h`'s rows, and the updated cache."""
        return attend_rows(self.attn, h, rows, cache, self.attn_boundary, stream)

    def mlp_bias_counts(self, stream: bj.ResidualStream) -> dict[str, bool | jax.Array]:
        """The keyword a dense MLP with biases takes: whether this rank adds its down
        projection's bias (`counts_bias`); empty where the FFN stage declares no such bias."""
        counts = declared_counts(self.ffn_boundary, DOWN_PROJ_BIAS, stream)
        return {} if counts is None else {"counts_bias": counts}

    def run_ffn(
        self, h: jax.Array, stream: bj.ResidualStream
    ) -> tuple[bj.OwedOutput, bj.ResidualStream]:
        """The FFN's compute and exit; a layer whose FFN may hand on a finalize overrides it."""
        return self.ffn_boundary.finish(self.ffn_compute(h, stream), stream)

    def ffn_compute(self, h: jax.Array, stream: bj.ResidualStream) -> jax.Array:
        """The FFN's compute alone on the stream its stage prepared, its output finalized (for
        an exit run apart from compute, as two-batch overlap's `complete_now`)."""
        return self.mlp(h, **self.mlp_bias_counts(stream))
