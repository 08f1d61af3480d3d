"""Where a decoder layer's norms sit around its two stages: each family's residual design, built as
the layer's own modules.

A design `attach`es its norms (and reads, updates, output transforms) to the layer as attributes
named for the model's parts (`input_norm`, `post_attn_norm`, ...), so their parameters are the
layer's (`layers.3.input_norm.weight`), and says what each stage declares with them; `facts`
says the same as capabilities only, for binding a neighbouring stage another pipeline rank builds.

| design | attention reads | attention output | FFN reads | FFN output |
| --- | --- | --- | --- | --- |
| `PreNorm` | `input_norm` | plain add | `post_attn_norm` | plain add |
| `PostNorm` | as is | add `post_attn_norm(out)` | as is | add `post_ffn_norm(out)` |
| `Sandwich` | `input_norm` | `post_attn_norm`, add | `pre_ffn_norm` | `post_ffn_norm`, add |
| `HyperConnected` | MHC, `input_norm` | MHC update | MHC, `post_attn_norm` | MHC update |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax.numpy as jnp
from flax import nnx

import boundary_jax as bj
from boundary_jax import designs

from ..layers.hyper_connections import HyperConnections


@dataclasses.dataclass(frozen=True)
class StageResidual:
    """How one stage meets the residual: what its `declare_attn` / `declare_ffn` takes for it.

    Attributes:
      read: The residual read into the stage's input (or its capabilities, `DesignFacts`).
      update: How the stage's output joins the residual (or its capabilities).
      output_transform: Applied to the complete output before the update (a module, or a
        function standing for one in a capabilities-only declaration), or None.
    """

    read: designs.ResidualReadout | designs.DesignFacts = designs.AddNormRead()
    update: designs.ResidualUpdate | designs.DesignFacts = designs.PlainAdd()
    output_transform: Callable | None = None

    def declare_attn(
        self, *, replicated: tuple[bj.declare.Replicated, ...] = ()
    ) -> bj.StageDeclaration:
        """The attention stage's declaration, with the parts of its output every attention-TP
        rank computes in full (`replicated`: an o projection's bias)."""
        return bj.declare_attn(
            read=self.read,
            update=self.update,
            output_transform=self.output_transform,
            replicated=replicated,
        )

    def declare_ffn(
        self,
        *,
        sparse: bool = False,
        moe_dispatch: bj.MoeDispatch = bj.MoeDispatch.GATHER,
        dense_tp_size: int | None = None,
        replicated: tuple[bj.declare.Replicated, ...] = (),
    ) -> bj.StageDeclaration:
        """The FFN stage's declaration: dense (over `dense_tp_size` ranks; None: the full TP
        group), or sparse with its dispatch; `replicated` as for `declare_ffn` (a MoE's shared
        expert with TP size 1, its zero-computation experts, its experts' down biases)."""
        return bj.declare_ffn(
            read=self.read,
            update=self.update,
            output_transform=self.output_transform,
            sparse=sparse,
            moe_dispatch=moe_dispatch,
            dense_tp_size=dense_tp_size,
            replicated=replicated,
        )


@dataclasses.dataclass(frozen=True)
class StageDesigns:
    """What a layer's two stages read with and declare.

    Attributes:
      attn_norm: The attention stage's input norm (None: it reads the residual as is).
      ffn_norm: The FFN stage's input norm (None: it reads the residual as is).
      attn: How the attention stage meets the residual.
      ffn: How the FFN stage meets the residual.
    """

    attn_norm: designs.Norm | None
    ffn_norm: designs.Norm | None
    attn: StageResidual
    ffn: StageResidual


class LayerDesign(Protocol):
    """A family's residual design, for every layer of a decoder."""

    def attach(self, layer: nnx.Module, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> StageDesigns:
        """Builds the design's modules as attributes of `layer`; returns what its stages use."""
        ...

    def facts(self) -> StageDesigns:
        """The stages' declaration keywords as capabilities (no modules, no norms)."""
        ...


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """The RMSNorms of a decoder: their width, epsilon and whether they scale by `1 + w`."""

    hidden: int
    eps: float
    unit_offset: bool = False

    def rms_norm(self, dtype: jnp.dtype) -> bj.RMSNorm:
        return bj.RMSNorm(
            self.hidden, eps=self.eps, unit_offset=self.unit_offset, param_dtype=dtype
        )


@dataclasses.dataclass(frozen=True)
class PreNorm:
    """Each stage reads `norm(residual)` (HF `input_layernorm`, `post_attention_layernorm`) and
    its output joins by a plain add."""

    norm: NormSpec

    def attach(self, layer: nnx.Module, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> StageDesigns:
        del rngs
        layer.input_norm = self.norm.rms_norm(dtype)
        layer.post_attn_norm = self.norm.rms_norm(dtype)
        return StageDesigns(
            layer.input_norm, layer.post_attn_norm, StageResidual(), StageResidual()
        )

    def facts(self) -> StageDesigns:
        return StageDesigns(None, None, StageResidual(), StageResidual())


@dataclasses.dataclass(frozen=True)
class PostNorm:
    """Each stage reads the residual as is; its update is `residual + norm(output)` (HF
    `post_attention_layernorm`, `post_feedforward_layernorm`). The update
    is not plain, so the sum an output owes completes before it."""

    norm: NormSpec

    def attach(self, layer: nnx.Module, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> StageDesigns:
        del rngs
        layer.post_attn_norm = self._update(dtype)
        layer.post_ffn_norm = self._update(dtype)
        return StageDesigns(
            None,
            None,
            StageResidual(update=layer.post_attn_norm),
            StageResidual(update=layer.post_ffn_norm),
        )

    def facts(self) -> StageDesigns:
        update = designs.PostNormUpdate
        facts = StageResidual(update=designs.DesignFacts(update.__name__, plain=update.plain))
        return StageDesigns(None, None, facts, facts)

    def _update(self, dtype: jnp.dtype) -> designs.PostNormUpdate:
        norm = self.norm
        return designs.PostNormUpdate(
            norm.hidden, eps=norm.eps, unit_offset=norm.unit_offset, param_dtype=dtype
        )


@dataclasses.dataclass(frozen=True)
class Sandwich:
    """Each stage reads `norm(residual)` and normalizes its complete output before the plain add
    (HF `input_layernorm` / `post_attention_layernorm`, `pre_feedforward_layernorm` /
    `post_feedforward_layernorm`). Where the sum is left to the next input, the output norm
    travels with it and runs once the sum completes there."""

    norm: NormSpec

    def attach(self, layer: nnx.Module, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> StageDesigns:
        del rngs
        layer.input_norm = self.norm.rms_norm(dtype)
        layer.post_attn_norm = self.norm.rms_norm(dtype)
        layer.pre_ffn_norm = self.norm.rms_norm(dtype)
        layer.post_ffn_norm = self.norm.rms_norm(dtype)
        return StageDesigns(
            layer.input_norm,
            layer.pre_ffn_norm,
            StageResidual(output_transform=layer.post_attn_norm),
            StageResidual(output_transform=layer.post_ffn_norm),
        )

    def facts(self) -> StageDesigns:
        # Binding reads only that a transform exists; the function stands for the output norm.
        transform = StageResidual(output_transform=designs.rms_norm)
        return StageDesigns(None, None, transform, transform)


@dataclasses.dataclass(frozen=True)
class HyperConnected:
    """Pre-norm reads behind MHC hyper-connections: each stage reads its `hc_mult` streams with
    an `MhcRead` (then its input norm) and updates them with an `MhcUpdate`."""

    norm: NormSpec
    hyper_connections: HyperConnections

    def attach(self, layer: nnx.Module, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> StageDesigns:
        hc, norm = self.hyper_connections, self.norm
        layer.input_norm = norm.rms_norm(dtype)
        layer.post_attn_norm = norm.rms_norm(dtype)
        layer.attn_mhc_read = hc.read(norm.hidden, norm_eps=norm.eps, dtype=dtype, rngs=rngs)
        layer.attn_mhc_update = designs.MhcUpdate()
        layer.ffn_mhc_read = hc.read(norm.hidden, norm_eps=norm.eps, dtype=dtype, rngs=rngs)
        layer.ffn_mhc_update = designs.MhcUpdate()
        return StageDesigns(
            layer.input_norm,
            layer.post_attn_norm,
            StageResidual(read=layer.attn_mhc_read, update=layer.attn_mhc_update),
            StageResidual(read=layer.ffn_mhc_read, update=layer.ffn_mhc_update),
        )

    def facts(self) -> StageDesigns:
        read, update = self.hyper_connections.design_facts()
        facts = StageResidual(read=read, update=update)
        return StageDesigns(None, None, facts, facts)
