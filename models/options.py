"""How a model is built and run, whatever its mesh: one frozen `BuildOptions`, made once (from the
command line in `models.cli`, or by a caller) and passed whole to `build_model`, `load_model` and
the family's class, which keeps it (`CausalLM.options`) for the runtimes that serve or train it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import boundary_jax as bj

from .layers.attention.context_parallel import CpAttentionMode
from .layers.attention.self_attention import AttentionImpl
from .layers.fp8_linear import Fp8Quantization
from .layers.hyper_connections import HyperConnections
from .layers.lora import LoraSpec
from .layers.moe.sparse import GroupedMatmulImpl


class Remat(enum.Enum):
    """What each decoder layer keeps for the backward pass (`jax.checkpoint` per layer).

    NONE: every activation is kept (no recomputation).
    FULL: only each layer's inputs are kept; the backward recomputes the layer.
    DOTS: the layer's matmul outputs are kept, the rest (norms, activations, softmax) is
      recomputed (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`).
    """

    NONE = "none"
    FULL = "full"
    DOTS = "dots"

    def policy(self) -> Callable | None:
        """The `jax.checkpoint` policy (None: save nothing); only for FULL and DOTS."""
        if self is Remat.DOTS:
            return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        return None


RUNTIME_SWITCHES = ("matmul_precision", "two_batch_overlap")
"""The options a runner may set otherwise than its model was built with
(`BuildOptions.for_running`): they change the programs, not the model."""


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """The switches of a model that do not depend on its mesh: static and hashable.

    A family's class decides which it builds (`CausalLM.check_build`): an option it does not
    compute is refused, with the option named, when the model is built.

    Attributes:
      dtype: The dtype of every parameter (FP8 weights and their scales excepted).
      matmul_precision: The precision every program traces its matmuls with; None: `HIGHEST`
        for a float32 model (true float32 where a GPU's default is TF32), `DEFAULT` otherwise
        (`matmul_precision`).
      attention: The attention kernel; None: the fastest measured where the model runs
        (`AttentionImpl.for_platform`, resolved when the model is built).
      reduction: The stack's reduction policy.
      fusions: The stack's fusion candidates (`bj.fusions.NO_FUSIONS`: the built-in sums and
        XLA's add + norm; `bj.fusions.platform_fusions(...)`: the Pallas kernels).
      remat: What each layer keeps for a backward pass.
      scan_layers: Runs of identical layers between the stack entry and the terminal layer are
        stacked and run as one `lax.scan` each (`DecoderConfig.layer_blocks`).
      quantization: FP8 projection weights and FP8 inputs into them; None: every weight in
        `dtype`.
      cp_attention: How a prefill attends across attention-CP ranks (under `attn_cp > 1`).
      two_batch_overlap: Forward, prefill and decode run as two microbatches, one's
        collectives beside the other's compute (`models.serving.overlap`).
      hyper_connections: MHC hyper-connections around every stage (random MHC weights); None:
        the family's own residual design.
      moe_dispatch: Where a MoE's experts get their rows (gathered, or all-to-all from each
        rank's own rows); None: `MoeDispatch.GATHER` for a model with experts. A model without
        experts takes None only.
      moe_capacity: The all-to-all capacity in rows per rank pair; None drops nothing.
      grouped_matmul: The experts' grouped matmul; None: the fastest for where JAX runs and
        `dtype` (`pallas_kernels.grouped_matmul.default_grouped_matmul_impl`).
      dense_ffn_dp: The dense FFN layers of a model with experts run fully data-parallel
        (whole weights on every rank, on its own rows; `declare_ffn(dense_tp_size=1)`).
      lora: The LoRA adapter stacks the attention and MLP projections carry (`layers.lora`;
        `weights.peft` fills them from PEFT adapters); None: no adapters.
    """

    dtype: jnp.dtype = jnp.float32
    matmul_precision: lax.Precision | None = None
    attention: AttentionImpl | None = None
    reduction: bj.ReductionPolicy = bj.ReductionPolicy.AUTO
    fusions: bj.fusions.FusionProvider = bj.fusions.NO_FUSIONS
    remat: Remat = Remat.NONE
    scan_layers: bool = False
    quantization: Fp8Quantization | None = None
    cp_attention: CpAttentionMode = CpAttentionMode.ALL_GATHER
    two_batch_overlap: bool = False
    hyper_connections: HyperConnections | None = None
    moe_dispatch: bj.MoeDispatch | None = None
    moe_capacity: int | None = None
    grouped_matmul: GroupedMatmulImpl | None = None
    dense_ffn_dp: bool = False
    lora: LoraSpec | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if not jnp.issubdtype(self.dtype, jnp.floating):
            raise TypeError(f"BuildOptions.dtype must be a float dtype; got {self.dtype}")
        for name, kind in (
            ("matmul_precision", lax.Precision),
            ("attention", AttentionImpl),
            ("quantization", Fp8Quantization),
            ("hyper_connections", HyperConnections),
            ("moe_dispatch", bj.MoeDispatch),
            ("grouped_matmul", GroupedMatmulImpl),
            ("lora", LoraSpec),
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(
                    f"BuildOptions.{name} must be a {kind.__name__} or None; got {value!r}"
                )
        for name, kind in (
            ("reduction", bj.ReductionPolicy),
            ("fusions", bj.fusions.FusionProvider),
            ("remat", Remat),
            ("cp_attention", CpAttentionMode),
        ):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(
                    f"BuildOptions.{name} must be a {kind.__name__}; got {getattr(self, name)!r}"
                )
        if self.moe_capacity is not None and (
            not isinstance(self.moe_capacity, int) or self.moe_capacity < 1
        ):
            raise ValueError(
                f"moe_capacity must be a positive int or None; got {self.moe_capacity!r}"
            )

    def replace(self, **changes) -> BuildOptions:
        """These options with `changes` (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def for_platform(self, platform: str) -> BuildOptions:
        """These options with the attention kernel chosen for `platform` where it is None."""
        if self.attention is not None:
            return self
        return dataclasses.replace(self, attention=AttentionImpl.for_platform(platform))

    def for_running(self, asked: BuildOptions | None) -> BuildOptions:
        """The options a runtime (serving, training, pipeline) runs a model built with these
        options under: these, or `asked`, which may change only the switches that do not
        change the model (`RUNTIME_SWITCHES`).

        Raises:
          ValueError: `asked` differs in an option the model was built with.
        """
        if asked is None:
            return self
        asked = asked.replace(attention=asked.attention or self.attention)
        kept = asked.replace(**{name: getattr(self, name) for name in RUNTIME_SWITCHES})
        if kept != self:
            changed = sorted(
                field.name
                for field in dataclasses.fields(self)
                if getattr(kept, field.name) != getattr(self, field.name)
            )
            raise ValueError(
                f"a runner takes the options its model was built with, changing only "
                f"{list(RUNTIME_SWITCHES)}; got other {changed}. Build the model with them"
            )
        return asked

    @property
    def precision(self) -> lax.Precision:
        """`matmul_precision`, or for None the default of a model of `dtype`."""
        if self.matmul_precision is not None:
            return self.matmul_precision
        return lax.Precision.HIGHEST if self.dtype == jnp.float32 else lax.Precision.DEFAULT
