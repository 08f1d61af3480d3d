"""FP8 decoders: which stages read their input quantized, and which projections are FP8.

With `Fp8Quantization`, every attention stage and every dense FFN stage declares an add + norm
read that hands its compute FP8 rows (`bj.designs.AddNormRead(quantize=Fp8TokenGroups(128))`),
quantized in the same pass as the residual add and the norm; a sparse FFN keeps its read
unquantized (its router reads it) and quantizes the rows it sends its experts. A stage whose
residual design brings its own read (MHC hyper-connections) cannot quantize: binding it raises.
"""

from __future__ import annotations

import dataclasses

import boundary_jax as bj
from boundary_jax import designs

from ..layers.fp8_linear import Fp8Quantization
from .designs import StageDesigns, StageResidual


def quantized_reads(
    stages: StageDesigns, quantization: Fp8Quantization, *, ffn: bool
) -> StageDesigns:
    """`stages` with the attention stage's read (and, with `ffn`, the FFN stage's) handing its
    compute FP8 rows in `quantization.activations`' format.

    Raises:
      NotImplementedError: A stage already declares a read other than the plain add + norm one
        (MHC: its streams mix nonlinearly before the norm, so it has no quantized form).
    """
    form = quantization.activations
    attn = _quantized(stages.attn, form, "attention")
    return dataclasses.replace(
        stages, attn=attn, ffn=_quantized(stages.ffn, form, "FFN") if ffn else stages.ffn
    )


def _quantized(declared: StageResidual, form: designs.Fp8TokenGroups, stage: str) -> StageResidual:
    read = declared.read
    if not isinstance(read, designs.AddNormRead):
        name = read.design if isinstance(read, bj.designs.DesignFacts) else type(read).__name__
        raise NotImplementedError(
            f"a quantized read requires an add + norm read; the {stage} stage reads with "
            f"{name}, which cannot return {form.name} input. Build the model without FP8 "
            "quantization (or without hyper_connections)"
        )
    return dataclasses.replace(declared, read=dataclasses.replace(read, quantize=form))
