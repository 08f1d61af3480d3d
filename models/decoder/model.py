"""The causal LM every family builds on: one layer stack of attention + FFN layers between a
vocab-parallel embedding and a final norm, built only from stage boundaries.

Each layer appends its stages to the model's layer stack; the model enters the stack with the
embedding's partial sum and leaves it through the final norm. Compute never sums: every sum a
stage owes is completed by a boundary. Where the norms sit around each stage is the config's
residual design (`models.decoder.designs`): each layer builds it as its own modules and declares
its stages with the model's `stage_facts`. A family's file subclasses `CausalLM` with its
Hugging Face form (`models.decoder.family.FamilyBase`) and the layers it brings.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import boundary_jax as bj
from boundary_jax import residual_stream

from ..config import DecoderConfig, ResidualDesign
from ..inputs.rows import TokenRows
from ..layers.attention.context_parallel import share_over_cp
from ..layers.attention.kv_cache import KVCache
from ..layers.attention.self_attention import Attention, HeadSplit, replicated_parts
from ..layers.fp8_linear import Fp8Linears
from ..layers.linear import DENSE_LINEARS, Linears, ParallelLMHead, VocabParallelEmbedding
from ..layers.mlp import SwiGLU
from ..layers.mlp import replicated_parts as mlp_parts
from ..options import BuildOptions, Remat
from .designs import (
    HyperConnected,
    LayerDesign,
    NormSpec,
    PostNorm,
    PreNorm,
    Sandwich,
    StageDesigns,
)
from .family import FamilyBase
from .layer import DecoderLayer
from .quantized import quantized_reads


class CausalLM(FamilyBase, nnx.Module):
    """A decoder LM over packed token rows; runs inside `jax.shard_map` on its topology.

    Attributes:
      config: The architecture.
      topology: The parallel topology the weights are split for and the stack is bound on.
      options: How the model is built and run (`BuildOptions`, its attention kernel resolved).
      embed: Vocab-parallel embedding; its partial sum is owed to the first boundary.
      layers: The decoder layers, one layer stack, in the blocks `config.layer_blocks(
        options.scan_layers)` says: a `DecoderLayer` per unscanned layer, a
        `bj.StackedLayers` (its parameters stacked on a leading layer axis, run by one
        `lax.scan`) per scanned run.
      final_norm: The norm the stack leaves through.
      lm_head: Vocab-parallel LM head (tied to `embed` when the config says so).
      hyper_head: With hyper-connections, the head collapsing the streams before `final_norm`.
      linears: What makes the layers' projections (dense, or FP8 with `options.quantization`).
      design: Where every layer's norms sit (the config's residual design, or pre-norm behind
        MHC hyper-connections).
      layer_range: The model layers this module holds: all of them, or a pipeline stage's
        share [a, b) (`models.pipeline`). A stage holds the embedding only when it holds layer
        0 (or the last layer, under tied embeddings, for its LM head), and `final_norm`,
        `hyper_head` and `lm_head` only when it holds the last layer; the others are None.
    """

    layer_class: type[nnx.Module] = DecoderLayer

    def __init__(
        self,
        config: DecoderConfig,
        topology: bj.Topology,
        options: BuildOptions = BuildOptions(),
        *,
        layer_range: range | None = None,
        rngs: nnx.Rngs,
    ):
        if config.architecture not in self.architectures:
            names = ", ".join(self.architectures)
            raise ValueError(
                f"{type(self).__name__} builds {names}; got a {config.architecture} config"
            )
        self.check_build(config, topology, options)
        options = options.for_platform(jax.default_backend())
        dtype = options.dtype
        self.config = config
        self.topology = topology
        self.options = options
        quantization = options.quantization
        self.linears: Linears = DENSE_LINEARS if quantization is None else Fp8Linears(quantization)
        self.layer_range = _layer_range(config, layer_range, options.scan_layers)
        first, last = self.holds_first, self.holds_last
        self.design = self.layer_design()
        self.embed = (
            VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                scale=config.embedding_scale,
                topology=topology,
                dtype=dtype,
                init_std=config.initializer_range,
                padding_id=config.padding_id,
                rngs=rngs,
            )
            if first or (last and config.tie_word_embeddings)
            else None
        )
        with bj.layer_stack(
            topology,
            reduction=options.reduction,
            architecture=config.architecture,
            input_sum=bj.SumGroup.ATTN_TP,
            fusions=options.fusions,
            stage_facts=self.stage_facts,
            num_layers=config.num_layers,
            layers=self.layer_range,
        ):
            layers = {i: self.make_layer(i, dtype=dtype, rngs=rngs) for i in self.layer_range}
        self.layers = nnx.List(
            [
                bj.StackedLayers([layers[i] for i in block], start=block.start)
                if scanned
                else layers[block.start]
                for block, scanned in self._layer_blocks()
            ]
        )
        self.final_norm = (
            bj.RMSNorm(
                config.hidden_size,
                eps=config.rms_norm_eps,
                unit_offset=config.unit_offset_norms,
                param_dtype=dtype,
            )
            if last
            else None
        )
        hyper_connections = options.hyper_connections
        self.hyper_head = (
            hyper_connections.head(
                config.hidden_size, norm_eps=config.rms_norm_eps, dtype=dtype, rngs=rngs
            )
            if last and hyper_connections is not None
            else None
        )
        self.lm_head = (
            ParallelLMHead(
                config.hidden_size,
                config.vocab_size,
                tied_embedding=self.embed if config.tie_word_embeddings else None,
                topology=topology,
                dtype=dtype,
                init_std=config.initializer_range,
                rngs=rngs,
            )
            if last
            else None
        )

    @property
    def holds_first(self) -> bool:
        """This module holds layer 0: its stack starts from the embedding."""
        return self.layer_range.start == 0

    @property
    def holds_last(self) -> bool:
        """This module holds the last layer: its stack leaves through the final norm."""
        return self.layer_range.stop == self.config.num_layers

    def _layer_blocks(self) -> list[tuple[range, bool]]:
        """`config.layer_blocks` of the layers this module holds."""
        return [
            (block, scanned)
            for block, scanned in self.config.layer_blocks(self.options.scan_layers)
            if block.start in self.layer_range
        ]

    def stage_facts(
        self, layer_index: int, stages: StageDesigns | None = None
    ) -> tuple[bj.StageDeclaration, ...]:
        """The model's shared declaration function: layer `layer_index`'s stages, in order.

        `stages` is what the layer's residual design built (its own modules); None declares
        their capabilities only, which is what the stack binds a neighbour against.
        """
        del layer_index
        stages = self.quantized(self.design.facts() if stages is None else stages)
        return (
            stages.attn.declare_attn(replicated=replicated_parts(self.config.o_bias)),
            stages.ffn.declare_ffn(replicated=mlp_parts(self.config.mlp_bias)),
        )

    def quantized(self, stages: StageDesigns, *, ffn: bool = True) -> StageDesigns:
        """`stages` with quantized reads (`quantized_reads`) where the model is FP8: the
        attention's, and with `ffn` the FFN's; as they are otherwise."""
        if self.options.quantization is None:
            return stages
        return quantized_reads(stages, self.options.quantization, ffn=ffn)

    def layer_design(self) -> LayerDesign:
        """Where every layer's norms sit: the family's residual design, or pre-norm behind
        MHC hyper-connections."""
        config = self.config
        norm = NormSpec(config.hidden_size, config.rms_norm_eps, config.unit_offset_norms)
        if self.options.hyper_connections is not None:
            return HyperConnected(norm, self.options.hyper_connections)
        return {
            ResidualDesign.PRE_NORM: PreNorm,
            ResidualDesign.POST_NORM: PostNorm,
            ResidualDesign.SANDWICH: Sandwich,
        }[config.residual_design](norm)

    def make_mlp(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Layer `index`'s FFN: the dense gated MLP here."""
        del index
        config = self.config
        return SwiGLU(
            config.hidden_size,
            config.intermediate_size,
            activation=config.activation,
            bias=config.mlp_bias,
            topology=self.topology,
            dtype=dtype,
            init_std=config.initializer_range,
            linears=self.linears,
            lora=self.options.lora,
            rngs=rngs,
        )

    def make_layer(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Decoder layer `index` (inside the open layer stack), with this model's attention
        kernel and residual design."""
        attn = Attention(
            self.config.attention_spec(index),
            topology=self.topology,
            dtype=dtype,
            impl=self.options.attention,
            cp_mode=self.options.cp_attention,
            linears=self.linears,
            lora=self.options.lora,
            rngs=rngs,
        )
        return self.layer_class(
            attn,
            self.make_mlp(index, dtype=dtype, rngs=rngs),
            design=self.design,
            declare=lambda stages: self.stage_facts(index, stages),
            dtype=dtype,
            rngs=rngs,
        )

    def block_cache_specs(self, *, stacked: bool = False) -> KVCache:
        """The `PartitionSpec` tree of one block's decode cache (`stacked`: a scanned run's,
        with a leading layer axis); a family with another cache overrides it and `block_cache`."""
        return KVCache.specs(self.topology, stacked=stacked)

    def block_cache(
        self, *, slots: int, max_len: int, dtype: jnp.dtype, mesh: Mesh | None, layers: int | None
    ) -> KVCache:
        """One block's zero decode cache (`layers`: a scanned run's, stacked), as
        `KVCache.create` makes it."""
        return KVCache.create(
            self.config,
            self.topology,
            slots=slots,
            max_len=max_len,
            dtype=dtype,
            mesh=mesh,
            layers=layers,
        )

    def cache_bytes_per_token(self, dtype: jnp.dtype) -> int:
        """Bytes one token takes in one layer's decode cache on one device (its kv heads' keys
        and values; under attention CP a token is on one of the CP ranks, with its int32
        position, so the average over them)."""
        heads = HeadSplit.of(self.config, self.topology)
        token = 2 * heads.local_kv_heads * self.config.head_dim * jnp.dtype(dtype).itemsize
        cp = self.topology.attn_cp
        return token if cp == 1 else -(-(token + 4) // cp)

    def token_cache_layers(self) -> int:
        """How many layers keep a cache that grows by `cache_bytes_per_token` per token (every
        layer here; a family whose other layers keep a fixed-size state says fewer)."""
        return self.config.num_layers

    def state_bytes_per_slot(self, dtype: jnp.dtype) -> int:
        """Bytes of fixed-size decode state (a recurrent mixer's) one sequence slot takes on one
        device over all layers: none here."""
        del dtype
        return 0

    @property
    def final_read(self) -> Callable[[jax.Array], jax.Array]:
        """The norm the stack's final read applies: the `RMSNorm` itself without
        hyper-connections (so the fused add + norm, and fusion candidates, recognise it), else
        `final_read_norm`."""
        return self.final_norm if self.hyper_head is None else self.final_read_norm

    def final_read_norm(self, residual_rows: jax.Array) -> jax.Array:
        """What the stack's final read applies to the residual: the final norm, after the
        hyper-connections' head collapses the streams when the model has them."""
        if self.hyper_head is not None:
            residual_rows = self.hyper_head(residual_rows)
        return self.final_norm(residual_rows)

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
          caches: One KV cache per block of `layers` (a scanned run's stacked on a leading
            layer axis; `ShardedCausalLM.new_caches`), or None to attend within `rows` alone.
          last_rows: None for logits of every row; else [R] int32 row indices (within this
            rank's block) whose logits alone the LM head computes, -1 for none (zero logits).

        Returns:
          ([rows or R, vocab] float32 logits, zero on padding rows; the caches or None).
        """
        hidden, caches_out = self.hidden(rows, batch, caches, last_rows)
        return self.lm_head(hidden).astype(jnp.float32), caches_out

    def loss(self, rows: TokenRows, batch: bj.BatchFacts, labels: jax.Array) -> jax.Array:
        """The mean next-token cross-entropy over every labelled row of the batch (all DP
        ranks): a float32 scalar alike on every rank.

        Args:
          rows: This DP rank's block of packed rows (attention within the batch, no caches).
          batch: The batch facts.
          labels: [rows] int32 target id per row (the next token of its sequence), -1 where
            nothing is predicted (a sequence's last row, padding).
        """
        hidden, _ = self.hidden(rows, batch)
        losses = self.lm_head.cross_entropy(hidden, labels)
        count = bj.ops.total_over_rows((labels >= 0).astype(jnp.float32), self.topology)
        return bj.ops.total_over_rows(losses, self.topology) / jnp.maximum(count, 1)

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
        self.require_whole("hidden")
        x, stream, caches = self.run_layers(
            self.embed(rows.ids), residual_stream.start(batch), rows, caches
        )
        return self.read_out(x, stream, last_rows), caches

    def run_layers(
        self,
        x: jax.Array | bj.OwedOutput,
        stream: bj.ResidualStream,
        rows: TokenRows,
        caches: tuple[KVCache, ...] | None = None,
    ) -> tuple[bj.OwedOutput, bj.ResidualStream, tuple[KVCache, ...] | None]:
        """Every layer this module holds, in order, from the stack input (or what a pipeline
        receive rebuilt) to the last layer's output: `(handle, stream, caches)`; `caches` as
        for `hidden`, one per block of `layers`."""
        if rows.adapters is not None and self.options.lora is None:
            raise ValueError(
                "the rows name LoRA adapters (TokenRows.adapters), but the model was built "
                "without adapter stacks; load it with adapters (BuildOptions.lora)"
            )
        updated = []
        for index, (layers, block) in enumerate(self.blocks()):
            cache = None if caches is None else caches[index]
            if isinstance(block, bj.StackedLayers):
                x, stream, cache = self._scan_run(block, x, stream, rows, cache)
            else:
                with jax.named_scope(f"layer_{layers.start}"):
                    if caches is None:
                        x, stream, cache = self._run_layer(block, x, stream, rows)
                    else:
                        x, stream, cache = block(x, stream, rows, cache)
            updated.append(cache)
        return x, stream, None if caches is None else tuple(updated)

    def read_out(
        self,
        x: bj.OwedOutput,
        stream: bj.ResidualStream,
        last_rows: jax.Array | None = None,
    ) -> jax.Array:
        """The final-norm output of the last layer's `(x, stream)`: every row's, or the rows of
        `last_rows` (as for `hidden`; under attention CP each picked row is on the CP rank that
        holds it, -1 on the others, and the result is alike on every CP rank)."""
        hidden = residual_stream.final_norm(x, stream, self.final_read, skip_empty=True)
        hidden = pick_rows(hidden, last_rows)
        if last_rows is not None:
            # Under CP each row lies on one CP rank; the decode after it runs alike on all.
            hidden = share_over_cp(hidden, self.topology)
        return hidden

    def cache_specs(self) -> tuple:
        """Per block of `layers` (this module's), its decode cache's `PartitionSpec` tree
        (`new_caches`)."""
        return tuple(self.block_cache_specs(stacked=scanned) for _, scanned in self._layer_blocks())

    def new_caches(
        self, *, slots: int, max_len: int, dtype: jnp.dtype, mesh: Mesh | None = None
    ) -> tuple[KVCache, ...]:
        """Zero decode caches for `slots` sequences (over all attention-DP ranks) of `max_len`
        positions: one KV cache per block of `layers` (this module's: a pipeline stage's
        share), a scanned run's stacked on a leading layer axis; on `mesh`, each device
        allocates only its shard."""
        return tuple(
            self.block_cache(
                slots=slots,
                max_len=max_len,
                dtype=dtype,
                mesh=mesh,
                layers=len(block) if scanned else None,
            )
            for block, scanned in self._layer_blocks()
        )

    def blocks(self) -> list[tuple[range, nnx.Module]]:
        """Each block of `layers` with the model layers it holds (`config.layer_blocks`)."""
        ranges = [block for block, _ in self._layer_blocks()]
        return list(zip(ranges, self.layers, strict=True))

    def require_whole(self, what: str) -> None:
        if len(self.layer_range) != self.config.num_layers:
            raise ValueError(
                f"{what}() runs a whole model; this module holds the layers {self.layer_range} "
                f"of {self.config.num_layers} (a pipeline stage). Run the stages with "
                "models.pipeline.PipelineCausalLM"
            )

    def check_batch_variant(self, variant: bj.BatchVariant) -> None:
        """Raises unless every stage of this model's layers bound a path for `variant` (an
        input-scattered batch where a stage reads only whole rows, or where branches move
        ordinary rows only).

        Raises:
          NotImplementedError: The first stage without one, with the binder's reason.
        """
        for index in self.layer_range:
            for name, boundary in self.layer_structure(index).stages():
                plan = boundary.plan
                if any(path.variant is variant for path in plan.paths):
                    continue
                reason = dict(plan.rejected).get(variant)
                kinds = ", ".join(_batch_kind(path.variant) for path in plan.paths)
                raise NotImplementedError(
                    f"{self.config.architecture} does not run {_batch_kind(variant)} batches: "
                    f"layer {index}'s {name} stage binds only {kinds} batches"
                    + (f" ({reason})" if reason else "")
                    + ". Run it without input scattering"
                )

    def layer_structure(self, index: int) -> nnx.Module:
        """The module that runs layer `index`, for its structure (bound plans, options): the
        layer itself, or in a scanned run the run's layer (whose parameters hold every layer of
        the run)."""
        for layers, block in self.blocks():
            if index in layers:
                return block.layer if isinstance(block, bj.StackedLayers) else block
        raise ValueError(f"layer must be in {self.layer_range}; got {index}")

    def _scan_run(
        self,
        run: bj.StackedLayers,
        x,
        stream: bj.ResidualStream,
        rows: TokenRows,
        cache: KVCache | None,
    ):
        """A scanned run of layers; `cache` is the run's stacked KV cache, or None (then the
        layers run under `jax.checkpoint` as `remat` says)."""

        def call(layer, carry, cache):
            x, stream, cache = layer(*carry, rows, cache)
            return (x, stream), cache

        remat = cache is None and self.options.remat is not Remat.NONE
        (x, stream), cache = run.scan(
            call,
            (x, stream),
            cache,
            in_place=cache is not None,
            remat=remat,
            policy=self.options.remat.policy() if remat else None,
        )
        return x, stream, cache

    def _run_layer(self, layer: nnx.Module, x, stream: bj.ResidualStream, rows: TokenRows):
        """One layer without a cache, under `jax.checkpoint` as `remat` says."""
        if self.options.remat is Remat.NONE:
            return layer(x, stream, rows, None)
        graphdef, state = nnx.split(layer)

        def run(state, x, stream, rows):
            x, stream, _ = nnx.merge(graphdef, state)(x, stream, rows, None)
            return x, stream

        x, stream = jax.checkpoint(run, policy=self.options.remat.policy())(state, x, stream, rows)
        return x, stream, None


def pick_rows(hidden: jax.Array, last_rows: jax.Array | None) -> jax.Array:
    """The rows of `hidden` that `last_rows` names (zero for -1), or every row for None."""
    if last_rows is None:
        return hidden
    # The LM head is the largest matmul of a decode step: run it on the rows asked for.
    picked = jnp.take(hidden, jnp.clip(last_rows, 0, hidden.shape[0] - 1), axis=0)
    return jnp.where((last_rows >= 0)[:, None], picked, 0)


def _layer_range(config: DecoderConfig, layers: range | None, scan_layers: bool) -> range:
    """The layers a `CausalLM` holds, checked: all of them by default."""
    count = config.num_layers
    if layers is None:
        return range(count)
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= count:
        raise ValueError(
            f"layer_range must be a non-empty range [a, b) within [0, {count}); got {layers}"
        )
    if scan_layers and len(layers) != count:
        raise NotImplementedError(
            f"scan_layers is not built for a pipeline stage's share of the layers ({layers} of "
            f"{count}); build the stages unscanned"
        )
    return layers


def _batch_kind(variant: bj.BatchVariant) -> str:
    return variant.value.lower().replace("_", "-")
