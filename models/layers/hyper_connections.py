"""The MHC decoder option: manifold-constrained hyper-connections as a decoder's residual design.

A dense decoder built with `HyperConnections` keeps `hc_mult` residual streams per token row:
every stage boundary reads them with `designs.MhcRead` (its trainable projection collapses the
streams into the stage input and makes the weights of the update) and updates them with
`designs.MhcUpdate`; an `designs.MhcHead` collapses the streams before the final norm. The
designs are the library's (equal to DeepSeek-V4's in transformers); this module only says which
objects each stage of a decoder layer declares.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from boundary_jax import designs


@dataclasses.dataclass(frozen=True)
class HyperConnections:
    """Manifold-constrained hyper-connections (MHC, as in DeepSeek-V4) for every stage boundary.

    Hugging Face checkpoints of the dense families hold no MHC weights: a decoder with this
    option is built with random weights (or loaded from weights of its own).

    Attributes:
      hc_mult: Residual streams per token row (HF `hc_mult`).
      sinkhorn_iters: Sinkhorn iterations that make each read's stream mix doubly stochastic
        (HF `hc_sinkhorn_iters`).
      eps: Added to the read's weights (HF `hc_eps`).
    """

    hc_mult: int = 4
    sinkhorn_iters: int = 20
    eps: float = 1e-6

    def __post_init__(self):
        for name in ("hc_mult", "sinkhorn_iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HyperConnections.{name} must be a positive int; got {value!r}")
        if not self.eps > 0:
            raise ValueError(f"HyperConnections.eps must be positive; got {self.eps!r}")

    def design_facts(self) -> tuple[designs.DesignFacts, designs.DesignFacts]:
        """A stage's read and update as capabilities only: what a neighbouring stage binds
        against, without building the read's weights."""
        read = designs.DesignFacts(
            designs.MhcRead.__name__,
            reads_before_dp_gather=designs.MhcRead.reads_before_dp_gather,
        )
        return read, designs.DesignFacts(designs.MhcUpdate.__name__, plain=designs.MhcUpdate.plain)

    def read(
        self, hidden: int, *, norm_eps: float, dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> designs.MhcRead:
        """A stage's read, with fresh trainable weights drawn from `rngs`."""
        return designs.MhcRead(
            hidden,
            self.hc_mult,
            sinkhorn_iters=self.sinkhorn_iters,
            eps=self.eps,
            norm_eps=norm_eps,
            param_dtype=dtype,
            rngs=rngs,
        )

    def head(
        self, hidden: int, *, norm_eps: float, dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> designs.MhcHead:
        """The head that collapses the streams before the final norm (which the model applies)."""
        return designs.MhcHead(
            hidden,
            self.hc_mult,
            None,
            eps=self.eps,
            norm_eps=norm_eps,
            param_dtype=dtype,
            rngs=rngs,
        )
