"""Post-norm (EXAONE 4.0, OLMo 2) and sandwich-norm (Gemma 3 text) decoders on stage boundaries.

They differ from the pre-norm decoders only in what each stage declares about the residual:

- Post-norm: a stage reads the residual as is (it has no input norm) and its update is
  `residual + norm(output)` (`designs.PostNormUpdate`, the layer's `post_attn_norm` /
  `post_ffn_norm`: HF's `post_attention_layernorm` / `post_feedforward_layernorm`). The update
  is not plain, so the sum an output owes completes before it (no fused add + norm), in the same
  collective.
- Sandwich: a stage reads `norm(residual)` as in pre-norm and declares an output transform, a norm
  of its complete output (HF's `post_attention_layernorm` / `post_feedforward_layernorm`), before
  the plain update. Where the sum is left to the next input, the transform travels with it and
  runs once the sum completes there.

Neither adds a collective; OLMo 2's whole-projection q/k norm adds one small all-reduce of the
sums of squares inside attention (`bj.sharded_rms_norms`) under attention TP.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import boundary_jax as bj

from ..config import Architecture, DecoderConfig
from ..decoder.model import CausalLM, Remat
from ..layers.attention.self_attention import AttentionImpl
from ..layers.hyper_connections import HyperConnections


class NormDesignCausalLM(CausalLM):
    """A dense decoder whose layers are post-norm or sandwich-norm (see the module docstring)."""

    architectures = (Architecture.EXAONE4, Architecture.OLMO2, Architecture.GEMMA3)
    quantizable = False  # FP8 is not built for post- and sandwich-norm layers

    def __init__(
        self,
        config: DecoderConfig,
        topology: bj.Topology,
        *,
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
        if hyper_connections is not None:
            raise NotImplementedError(
                f"{type(self).__name__} has its own residual design ({config.residual_design.value}"
                "); MHC hyper-connections replace it and are built for the pre-norm families "
                "only. Leave hyper_connections unset"
            )
        super().__init__(
            config,
            topology,
            reduction=reduction,
            fusions=fusions,
            dtype=dtype,
            attention=attention,
            remat=remat,
            scan_layers=scan_layers,
            layer_range=layer_range,
            rngs=rngs,
        )
