"""Post-norm (EXAONE 4.0, OLMo 2) and sandwich-norm (Gemma 3 text) decoders on stage boundaries.

They differ from the pre-norm decoders only in what each stage declares about the residual:

- Post-norm: a stage reads the residual as is (its boundary has no input norm) and its update is
  `residual + norm(output)` (`designs.PostNormUpdate`, the norm being HF's
  `post_attention_layernorm` / `post_feedforward_layernorm`). The update is not plain, so the sum
  an output owes completes before it (no fused add + norm), in the same collective.
- Sandwich: a stage reads `norm(residual)` as in pre-norm and declares an output transform, a norm
  of its complete output (HF's `post_attention_layernorm` / `post_feedforward_layernorm`), before
  the plain update. Where the sum is left to the next input, the transform travels with it and
  runs once the sum completes there.

Neither adds a collective; OLMo 2's whole-projection q/k norm adds one small all-reduce of the
sums of squares inside attention (`bj.sharded_rms_norms`) under attention TP.
"""

from __future__ import annotations

import jax.numpy as jnp

import boundary_jax as bj
from boundary_jax import designs

from ..config import Architecture, DecoderConfig, ResidualDesign
from ..layers.hyper_connections import HyperConnections
from .decoder import CausalLM, LayerDesigns, ReadNorms


def _norm(config: DecoderConfig, dtype: jnp.dtype) -> bj.RMSNorm:
    return bj.RMSNorm(
        config.hidden_size, eps=config.rms_norm_eps, gemma=config.gemma_norms, param_dtype=dtype
    )


def norm_stage_facts(
    config: DecoderConfig, dtype: jnp.dtype, layer_index: int
) -> tuple[bj.StageDeclaration, bj.StageDeclaration]:
    """The stages a post-norm or sandwich-norm layer declares: the models' shared declaration
    function. Each call builds fresh norms (ones, or zeros for `1 + w` norms) for the updates or
    output transforms; the layer's own are loaded over them.

    Raises:
      ValueError: A pre-norm config (those use `models.families.decoder.stage_facts`).
    """
    del layer_index
    design = config.residual_design
    if design is ResidualDesign.POST_NORM:
        return (
            bj.declare_attn(update=designs.PostNormUpdate(_norm(config, dtype))),
            bj.declare_ffn(update=designs.PostNormUpdate(_norm(config, dtype))),
        )
    if design is ResidualDesign.SANDWICH:
        return (
            bj.declare_attn(output_transform=_norm(config, dtype)),
            bj.declare_ffn(output_transform=_norm(config, dtype)),
        )
    raise ValueError(
        "norm_stage_facts declares post-norm and sandwich-norm layers; "
        f"{config.architecture.value} is {design.value}"
    )


class NormDesignCausalLM(CausalLM):
    """A dense decoder whose layers are post-norm or sandwich-norm (see the module docstring)."""

    architectures = (Architecture.EXAONE4, Architecture.OLMO2, Architecture.GEMMA3)

    def __init__(
        self,
        config: DecoderConfig,
        topology: bj.Topology,
        *,
        hyper_connections: HyperConnections | None = None,
        **options,
    ):
        if hyper_connections is not None:
            raise NotImplementedError(
                f"{type(self).__name__} has its own residual design ({config.residual_design.value}"
                "); MHC hyper-connections replace it and are built for the pre-norm families "
                "only. Leave hyper_connections unset"
            )
        super().__init__(config, topology, **options)

    def stage_facts(
        self, layer_index: int, designs: LayerDesigns | None = None
    ) -> tuple[bj.StageDeclaration, ...]:
        """The layers' stages (`norm_stage_facts`); `designs` is the plain design here (these
        families take no hyper-connections)."""
        del designs
        return norm_stage_facts(self.config, self.param_dtype, layer_index)

    def read_norms(self) -> ReadNorms:
        if self.config.residual_design is ResidualDesign.POST_NORM:
            return None, None
        return super().read_norms()
