"""Pallas kernels for layer boundaries, MoE experts and FP8 weights: add + RMSNorm (also with
FP8 quantization), rows activated and quantized in one pass, all-reduce + add + RMSNorm, the MoE
finalize + all-reduce + add + RMSNorm, the experts' grouped matmuls, and block-scaled FP8 matmuls.

Each op has a reference (its spec), kernels, and a public wrapper that picks the backend, types
its outputs for `shard_map`'s `check_vma` (`axes`) and differentiates as its reference does."""

from .add_rms_norm import add_rms_norm as add_rms_norm
from .add_rms_norm import add_rms_norm_reference as add_rms_norm_reference
from .add_rms_norm import add_rms_norm_supported as add_rms_norm_supported
from .add_rms_norm import round_residual as round_residual
from .add_rms_norm_quantize import add_rms_norm_quantize as add_rms_norm_quantize
from .add_rms_norm_quantize import (
    add_rms_norm_quantize_reference as add_rms_norm_quantize_reference,
)
from .add_rms_norm_quantize import (
    add_rms_norm_quantize_supported as add_rms_norm_quantize_supported,
)
from .all_reduce_add_rms_norm import AllReduceAlgorithm as AllReduceAlgorithm
from .all_reduce_add_rms_norm import all_reduce_add_rms_norm as all_reduce_add_rms_norm
from .all_reduce_add_rms_norm import (
    all_reduce_add_rms_norm_reference as all_reduce_add_rms_norm_reference,
)
from .all_reduce_add_rms_norm import (
    all_reduce_add_rms_norm_supported as all_reduce_add_rms_norm_supported,
)
from .grouped_matmul import GroupedMatmulImpl as GroupedMatmulImpl
from .grouped_matmul import grouped_matmul as grouped_matmul
from .grouped_matmul import grouped_matmul_reference as grouped_matmul_reference
from .impl import Impl as Impl
from .moe_finalize_add_rms_norm import moe_finalize_add_rms_norm as moe_finalize_add_rms_norm
from .moe_finalize_add_rms_norm import (
    moe_finalize_add_rms_norm_reference as moe_finalize_add_rms_norm_reference,
)
from .moe_finalize_add_rms_norm import (
    moe_finalize_add_rms_norm_supported as moe_finalize_add_rms_norm_supported,
)
from .quantize_rows import quantize_rows as quantize_rows
from .quantize_rows import quantize_rows_reference as quantize_rows_reference
from .quantize_rows import quantize_rows_supported as quantize_rows_supported
