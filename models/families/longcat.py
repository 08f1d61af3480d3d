"""LongCat-Flash (Hugging Face `LongcatFlashForCausalLM`) built only from stage boundaries, its
shortcut-connected MoE a branch of the residual stream.

A layer, as transformers' `LongcatFlashDecoderLayer`:

    x1 = x + attn_0(input_norm_0(x))
    h = post_attn_norm_0(x1)
    x2 = x1 + mlps_0(h)                      # the dense branch reads the MoE's input
    x3 = x2 + attn_1(input_norm_1(x2))
    out = x3 + mlps_1(post_attn_norm_1(x3)) + mlp(h)    # the MoE's output joins at the end

The main chain is the latent attention `attn_0` and the MoE `mlp` (DeepSeek's MoE with LongCat's
router: softmax, correction bias, zero-computation experts); the model's `stage_facts` lists only
these two. The dense FFN `mlps_0`, the latent attention `attn_1` and the dense FFN `mlps_1` are a
branch appended with `prepared_from=` the MoE stage: `branch_input` hands `mlps_0` the MoE's
normalized input `h` (moved onto the dense FFN's rows, never normalized twice: the branch's first
norm, the MoE's own, is never applied) and forks the residual the MoE's read wrote (`x1`); the
branch's stages add into their own residual (`x2`, `x3`, ...), `branch_output` completes what
the branch's output owes where the merge cannot take it unsummed, and `merge_branch` adds the
MoE's output to the branch's residual: the next layer's input completes both sums in the one
collective it runs anyway.

Each layer holds two latent caches (`LongcatCache`), one per attention.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import boundary_jax as bj

from ..config import Architecture, DecoderConfig
from ..decoder.designs import StageDesigns
from ..decoder.layer import AttentionFirstLayer, attend_rows
from ..decoder.model import Remat
from ..decoder.moe import MoeCausalLM
from ..inputs.rows import TokenRows
from ..layers.attention.latent import LatentCache, MultiHeadLatentAttention
from ..layers.attention.self_attention import AttentionImpl
from ..layers.hyper_connections import HyperConnections
from ..layers.mlp import SwiGLU
from ..layers.moe.deepseek_router import DeepseekMoeFfn
from ..layers.moe.sparse import GroupedMatmulImpl


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["attn_0", "attn_1"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class LongcatCache:
    """One LongCat-Flash layer's decode cache: the latent cache of each of its two attentions.

    Attributes:
      attn_0: The first attention's `LatentCache` (its `PartitionSpec` in a spec tree).
      attn_1: The second attention's.
    """

    attn_0: LatentCache
    attn_1: LatentCache


class LongcatDecoderLayer(AttentionFirstLayer):
    """Two latent attentions, two dense FFNs and one MoE: the attention and the MoE on the main
    chain, the dense FFN, attention and dense FFN a branch prepared from the MoE's input.

    Attributes (HF names in parentheses):
      attn_0, attn_1: `MultiHeadLatentAttention` (`self_attn.0`, `self_attn.1`).
      mlp: The MoE, `DeepseekMoeFfn` (`mlp`).
      mlps_0, mlps_1: Dense `SwiGLU`s over the full TP group (`mlps.0`, `mlps.1`).
      input_norm_0, post_attn_norm_0, input_norm_1, post_attn_norm_1: The stages' RMSNorms
        (`input_layernorm.{0,1}`, `post_attention_layernorm.{0,1}`); `post_attn_norm_0` is the
        MoE's and (never applied) the branch's first.
      attn_boundary, moe_boundary: The main chain's boundaries.
      mlps_0_boundary, attn_1_boundary, mlps_1_boundary: The branch's.
    """

    def __init__(
        self,
        config: DecoderConfig,
        topology: bj.Topology,
        main: tuple[bj.StageDeclaration, bj.StageDeclaration],
        *,
        moe_dispatch: bj.MoeDispatch,
        moe_capacity: int | None,
        grouped_matmul: GroupedMatmulImpl,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        attn = functools.partial(
            MultiHeadLatentAttention, config.mla, topology=topology, dtype=dtype, rngs=rngs
        )
        dense = functools.partial(
            SwiGLU,
            config.hidden_size,
            config.intermediate_size,
            topology=topology,
            dtype=dtype,
            init_std=config.initializer_range,
            rngs=rngs,
        )
        norm = functools.partial(
            bj.RMSNorm, config.hidden_size, eps=config.rms_norm_eps, param_dtype=dtype
        )
        self.attn_0, self.attn_1 = attn(), attn()
        self.mlp = DeepseekMoeFfn(
            config.hidden_size,
            config.moe,
            topology,
            dispatch=moe_dispatch,
            capacity=moe_capacity,
            impl=grouped_matmul,
            dtype=dtype,
            rngs=rngs,
        )
        self.mlps_0, self.mlps_1 = dense(), dense()
        self.input_norm_0, self.post_attn_norm_0 = norm(), norm()
        self.input_norm_1, self.post_attn_norm_1 = norm(), norm()
        attn_stage, moe_stage = main
        self.attn_boundary, self.moe_boundary = bj.append_stages(
            (attn_stage, self.input_norm_0), (moe_stage, self.post_attn_norm_0), owner=self
        )
        self.mlps_0_boundary, self.attn_1_boundary, self.mlps_1_boundary = bj.append_stages(
            (bj.declare_ffn(), self.post_attn_norm_0),  # never applied: the MoE's input is read
            (bj.declare_attn(), self.input_norm_1),
            (bj.declare_ffn(), self.post_attn_norm_1),
            owner=self,
            prepared_from=self.moe_boundary,
        )

    def stages(self) -> tuple[tuple[str, bj.StageBoundary], ...]:
        """The layer's stage boundaries by name: the main chain, then the branch."""
        return (
            ("attention", self.attn_boundary),
            ("moe", self.moe_boundary),
            ("branch ffn 0", self.mlps_0_boundary),
            ("branch attention", self.attn_1_boundary),
            ("branch ffn 1", self.mlps_1_boundary),
        )

    def run_stages(
        self, h: jax.Array, stream: bj.ResidualStream, rows: TokenRows, cache: LongcatCache | None
    ) -> tuple[bj.OwedOutput, bj.ResidualStream, LongcatCache | None]:
        """The layer after its first attention's input: attention, the MoE's input, the branch
        forked from it, the MoE, the branch's stages, and the merge."""
        y, cache_0 = attend_rows(self.attn_0, h, rows, None if cache is None else cache.attn_0)
        x, stream = self.attn_boundary.finish(y, stream)
        h, stream = self.moe_boundary.prepare(x, stream)
        g, stream, branch = bj.branch_input(self.mlps_0_boundary, self.moe_boundary, h, stream)
        exit = self.moe_boundary.exit(stream)
        x, stream = exit.finish(self.mlp(h, defer=exit.defer_moe_finalize), stream)
        y, branch = self.mlps_0_boundary.finish(self.mlps_0(g), branch)
        g, branch = self.attn_1_boundary.prepare(y, branch)
        y, cache_1 = attend_rows(self.attn_1, g, rows, None if cache is None else cache.attn_1)
        y, branch = self.attn_1_boundary.finish(y, branch)
        g, branch = self.mlps_1_boundary.prepare(y, branch)
        y, branch = self.mlps_1_boundary.finish(self.mlps_1(g), branch)
        y, branch = bj.branch_output(self.mlps_1_boundary, y, branch)
        x, stream = bj.merge_branch(x, stream, y, branch)
        return x, stream, None if cache is None else LongcatCache(cache_0, cache_1)


class LongcatFlashForCausalLM(MoeCausalLM):
    """LongCat-Flash: layers of two latent attentions, two dense FFNs and a shortcut MoE with
    zero-computation experts, the dense FFN, attention and dense FFN a branch of the MoE's
    input (`LongcatDecoderLayer`). Every layer is sparse.

    Not built (each rejected when the model is built): hyper-connections, scanned runs of
    layers, pipeline stages and FP8; a stack with branches binds no input-scattered path.
    """

    architectures = (Architecture.LONGCAT_FLASH,)
    quantizable = False

    def __init__(
        self,
        config: DecoderConfig,
        topology: bj.Topology,
        *,
        moe_dispatch: bj.MoeDispatch = bj.MoeDispatch.GATHER,
        moe_capacity: int | None = None,
        grouped_matmul: GroupedMatmulImpl | None = None,
        reduction: bj.ReductionPolicy = bj.ReductionPolicy.AUTO,
        fusions: bj.fusions.FusionProvider = bj.fusions.NO_FUSIONS,
        dtype: jnp.dtype = jnp.float32,
        attention: AttentionImpl = AttentionImpl.XLA,
        remat: Remat = Remat.NONE,
        hyper_connections: HyperConnections | None = None,
        scan_layers: bool = False,
        layer_range: range | None = None,
        rngs: nnx.Rngs,
    ):
        unbuilt = {
            "hyper_connections": hyper_connections is not None,
            "scan_layers": scan_layers,
            "layer_range (pipeline stages)": layer_range not in (None, range(config.num_layers)),
        }
        asked = [name for name, given in unbuilt.items() if given]
        if asked:
            raise NotImplementedError(
                f"LongcatFlashForCausalLM is not built with {asked}; build it without them"
            )
        super().__init__(
            config,
            topology,
            moe_dispatch=moe_dispatch,
            moe_capacity=moe_capacity,
            grouped_matmul=grouped_matmul,
            reduction=reduction,
            fusions=fusions,
            dtype=dtype,
            attention=attention,
            remat=remat,
            rngs=rngs,
        )

    def stage_facts(
        self, layer_index: int, stages: StageDesigns | None = None
    ) -> tuple[bj.StageDeclaration, ...]:
        """The main chain of every layer: the first attention, then the MoE (the branch's stages
        are no neighbour of another layer's)."""
        del layer_index, stages
        return bj.declare_attn(), bj.declare_ffn(sparse=True, moe_dispatch=self.moe_dispatch)

    def make_layer(self, index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Decoder layer `index` (inside the open layer stack)."""
        return LongcatDecoderLayer(
            self.config,
            self.topology,
            self.stage_facts(index),
            moe_dispatch=self.moe_dispatch,
            moe_capacity=self.moe_capacity,
            grouped_matmul=self.grouped_matmul,
            dtype=dtype,
            rngs=rngs,
        )

    def block_cache_specs(self, *, stacked: bool = False) -> LongcatCache:
        """The `PartitionSpec` tree of one layer's two latent caches."""
        spec = LatentCache.specs(self.topology, stacked=stacked)
        return LongcatCache(spec, spec)

    def block_cache(
        self, *, slots: int, max_len: int, dtype: jnp.dtype, mesh: Mesh | None, layers: int | None
    ) -> LongcatCache:
        """One layer's two zero latent caches, as `LatentCache.create` makes them."""
        make = functools.partial(
            LatentCache.create,
            self.config.mla,
            self.topology,
            slots=slots,
            max_len=max_len,
            dtype=dtype,
            mesh=mesh,
            layers=layers,
        )
        return LongcatCache(make(), make())

    def cache_bytes_per_token(self, dtype: jnp.dtype) -> int:
        """`2 * (kv_lora_rank + qk_rope_head_dim) * itemsize`: one token of one layer's two
        latent caches on one device."""
        return 2 * LatentCache.bytes_per_token(self.config.mla, dtype)
