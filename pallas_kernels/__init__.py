"""Fused Pallas kernels for layer boundaries: add + RMSNorm, all-reduce + add + RMSNorm, and the
MoE finalize + all-reduce + add + RMSNorm."""

from .add_rms_norm import add_rms_norm as add_rms_norm
from .add_rms_norm import add_rms_norm_reference as add_rms_norm_reference
from .add_rms_norm import add_rms_norm_supported as add_rms_norm_supported
from .all_reduce_add_rms_norm import AllReduceAlgorithm as AllReduceAlgorithm
from .all_reduce_add_rms_norm import all_reduce_add_rms_norm as all_reduce_add_rms_norm
from .all_reduce_add_rms_norm import (
    all_reduce_add_rms_norm_reference as all_reduce_add_rms_norm_reference,
)
from .all_reduce_add_rms_norm import (
    all_reduce_add_rms_norm_supported as all_reduce_add_rms_norm_supported,
)
from .impl import Impl as Impl
from .moe_finalize_add_rms_norm import moe_finalize_add_rms_norm as moe_finalize_add_rms_norm
from .moe_finalize_add_rms_norm import (
    moe_finalize_add_rms_norm_reference as moe_finalize_add_rms_norm_reference,
)
from .moe_finalize_add_rms_norm import (
    moe_finalize_add_rms_norm_supported as moe_finalize_add_rms_norm_supported,
)
