"""Qwen3 and Llama (also Mistral-style) decoders built only from stage boundaries.

Each layer appends an attention stage and an FFN stage to the model's layer stack; the model
enters the stack with the vocab-parallel embedding's partial sum and leaves it through the final
norm. Compute never sums: every sum a stage owes is completed by a boundary. Where the norms sit
around each stage is the model's declaration (`CausalLM.stage_facts`, `CausalLM.read_norms`): the
post-norm and sandwich-norm families (`models.norm_decoders`) change only those.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import boundary_jax as bj
from boundary_jax import residual

from .attention import Attention, AttentionImpl, KVCache
from .config import Architecture, DecoderConfig
from .layers import ParallelLMHead, VocabParallelEmbedding
from .mlp import SwiGLU
from .rows import TokenRows

ReadNorms = tuple[bj.RMSNorm | None, bj.RMSNorm | None]


def stage_facts(layer_index: int) -> tuple[bj.StageDeclaration, bj.StageDeclaration]:
    """The stages every dense decoder layer declares, in order: the model's shared declaration
    function (a stack holding part of the layers binds its edges from it)."""
    del layer_index
    return bj.declare_attn(), bj.declare_ffn()


class DecoderLayer(nnx.Module):
    """Attention + an FFN, joined to its neighbours by two stage boundaries (pre-norm unless the
    declarations and `read_norms` say otherwise).

    Attributes:
      attn: Self-attention returning its o_proj partial.
      mlp: The FFN (a SwiGLU here) returning its down_proj partial; built by `make_mlp` after
        the attention, so a mesh that fits neither reports the heads first.
      attn_boundary: The boundary before and after attention; owns its input norm (HF
        `input_layernorm`), and its update and output transform.
      ffn_boundary: The boundary before and after the FFN; owns its input norm (HF
        `post_attention_layernorm`; Gemma 3's `pre_feedforward_layernorm`), and its update and
        output transform.
    """

    def __init__(
        self,
        config: DecoderConfig,
        declarations: tuple[bj.StageDeclaration, bj.StageDeclaration],
        make_mlp: Callable[[], nnx.Module],
        *,
        topology: bj.Topology,
        dtype: jnp.dtype,
        attention: AttentionImpl = AttentionImpl.XLA,
        layer_index: int = 0,
        read_norms: ReadNorms | None = None,
        rngs: nnx.Rngs,
    ):
        if read_norms is None:
            read_norms = pre_norms(config, dtype)
        input_norm, post_attn_norm = read_norms
        self.attn = Attention(
            config,
            topology=topology,
            dtype=dtype,
            impl=attention,
            layer_index=layer_index,
            rngs=rngs,
        )
        self.mlp = make_mlp()
        attn, ffn = declarations
        self.attn_boundary, self.ffn_boundary = bj.append_stages(
            (attn, input_norm), (ffn, post_attn_norm)
        )

    @property
    def input_norm(self) -> bj.RMSNorm | None:
        """The attention stage's input norm (None: it reads the residual as is)."""
        return self.attn_boundary.norm

    @property
    def post_attn_norm(self) -> bj.RMSNorm | None:
        """The FFN stage's input norm (None: it reads the residual as is)."""
        return self.ffn_boundary.norm

    def __call__(
        self,
        x: jax.Array | bj.OwedOutput,
        stream: bj.ResidualStream,
        rows: TokenRows,
        cache: KVCache | None,
    ) -> tuple[bj.OwedOutput, bj.ResidualStream, KVCache | None]:
        h, stream = self.attn_boundary.prepare(x, stream)
        y, cache = self.attn(h, rows.positions, rows.segment_ids, cache, phase=rows.phase)
        x, stream = self.attn_boundary.finish(y, stream)
        h, stream = self.ffn_boundary.prepare(x, stream)
        x, stream = self.run_ffn(h, stream)
        return x, stream, cache

    def run_ffn(
        self, h: jax.Array, stream: bj.ResidualStream
    ) -> tuple[bj.OwedOutput, bj.ResidualStream]:
        """The FFN's compute and exit; a layer whose FFN may hand on a finalize overrides it."""
        return self.ffn_boundary.finish(self.mlp(h), stream)


def pre_norms(config: DecoderConfig, dtype: jnp.dtype) -> ReadNorms:
    """Fresh input norms of a layer's attention and FFN stages (`1 + w` where the config says)."""
    return tuple(
        bj.RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, gemma=config.gemma_norms, param_dtype=dtype
        )
        for _ in range(2)
    )


class CausalLM(nnx.Module):
    """A dense decoder LM over packed token rows; runs inside `jax.shard_map` on its topology.

    Attributes:
      config: The architecture.
      topology: The parallel topology the weights are split for and the stack is bound on.
      embed: Vocab-parallel embedding; its partial sum is owed to the first boundary.
      layers: The decoder layers, one layer stack.
      final_norm: The norm the stack leaves through.
      lm_head: Vocab-parallel LM head (tied to `embed` when the config says so).
      fusions: The stack's fusion provider (`bj.fusions.NO_FUSIONS`: the built-in path).
      attention: The attention kernel of every layer.
      param_dtype: The dtype of every parameter.
    """

    architectures: tuple[Architecture, ...] = (
        Architecture.QWEN3,
        Architecture.LLAMA,
        Architecture.MISTRAL,
    )

    def __init__(
        self,
        config: DecoderConfig,
        topology: bj.Topology,
        *,
        reduction: bj.ReductionPolicy = bj.ReductionPolicy.AUTO,
        fusions: bj.fusions.FusionProvider = bj.fusions.NO_FUSIONS,
        dtype: jnp.dtype = jnp.float32,
        attention: AttentionImpl = AttentionImpl.XLA,
        rngs: nnx.Rngs,
    ):
        if config.architecture not in self.architectures:
            names = ", ".join(a.value for a in self.architectures)
            raise ValueError(
                f"{type(self).__name__} builds {names}; got a {config.architecture.value} config"
            )
        common = {"topology": topology, "dtype": dtype, "rngs": rngs}
        self.config = config
        self.topology = topology
        self.fusions = fusions
        self.attention = attention
        self.param_dtype = dtype
        self.embed = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, scale=config.embedding_scale, **common
        )
        with bj.layer_stack(
            topology,
            reduction=reduction,
            architecture=config.architecture.value,
            input_sum=bj.SumGroup.ATTN_TP,
            fusions=fusions,
            stage_facts=self.stage_facts,
            num_layers=config.num_layers,
        ):
            self.layers = nnx.List(
                [self.make_layer(config, i, **common) for i in range(config.num_layers)]
            )
        self.final_norm = bj.RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, gemma=config.gemma_norms, param_dtype=dtype
        )
        self.lm_head = ParallelLMHead(
            config.hidden_size,
            config.vocab_size,
            tied_embedding=self.embed if config.tie_word_embeddings else None,
            **common,
        )

    def stage_facts(self, layer_index: int) -> tuple[bj.StageDeclaration, ...]:
        """The model's shared declaration function: layer `layer_index`'s stages, in order."""
        return stage_facts(layer_index)

    def read_norms(self) -> ReadNorms:
        """Fresh input norms of one layer's attention and FFN stages."""
        return pre_norms(self.config, self.param_dtype)

    def make_layer(self, config: DecoderConfig, index: int, **common) -> nnx.Module:
        """Decoder layer `index` (inside the open layer stack), with this model's attention
        kernel; `common` holds `topology`, `dtype` and `rngs`."""

        def make_mlp():
            return SwiGLU(
                config.hidden_size,
                config.intermediate_size,
                activation=config.activation,
                **common,
            )

        return DecoderLayer(
            config,
            self.stage_facts(index),
            make_mlp,
            attention=self.attention,
            layer_index=index,
            read_norms=self.read_norms(),
            **common,
        )

    def __call__(
        self,
        rows: TokenRows,
        batch: bj.BatchFacts,
        caches: tuple[KVCache, ...] | None = None,
        last_rows: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[KVCache, ...] | None]:
        """Logits of this attention-DP rank's rows (or of chosen rows), and the updated caches.

        Args:
          rows: This DP rank's block of packed rows.
          batch: The batch facts (variant and per-DP-rank token counts).
          caches: One KV cache per layer, or None to attend within `rows` alone.
          last_rows: None for logits of every row; else [R] int32 row indices (within this
            rank's block) whose logits alone the LM head computes, -1 for none (zero logits).

        Returns:
          ([rows or R, vocab] float32 logits, zero on padding rows; the caches or None).
        """
        hidden, caches_out = self.hidden(rows, batch, caches, last_rows)
        return self.lm_head(hidden).astype(jnp.float32), caches_out

    def hidden(
        self,
        rows: TokenRows,
        batch: bj.BatchFacts,
        caches: tuple[KVCache, ...] | None = None,
        last_rows: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[KVCache, ...] | None]:
        """The final-norm output [rows or R, hidden] that `__call__` feeds to the LM head
        (same arguments), and the updated caches; for callers that apply the head themselves
        (e.g. `lm_head.greedy`)."""
        stream = residual.start(batch)
        x = self.embed(rows.ids)
        updated = []
        for index, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{index}"):
                cache = None if caches is None else caches[index]
                x, stream, cache = layer(x, stream, rows, cache)
            updated.append(cache)
        hidden = residual.final_norm(x, stream, self.final_norm, skip_empty=True)
        if last_rows is not None:
            # The LM head is the largest matmul of a decode step: run it on the rows asked for.
            picked = jnp.take(hidden, jnp.clip(last_rows, 0, hidden.shape[0] - 1), axis=0)
            hidden = jnp.where((last_rows >= 0)[:, None], picked, 0)
        return hidden, None if caches is None else tuple(updated)


class Qwen3ForCausalLM(CausalLM):
    """Qwen3: q/k RMSNorm per head before RoPE, usually tied embeddings."""

    architectures = (Architecture.QWEN3,)


class LlamaForCausalLM(CausalLM):
    """Llama (with llama3 RoPE scaling) and Mistral-style configs."""

    architectures = (Architecture.LLAMA, Architecture.MISTRAL)
