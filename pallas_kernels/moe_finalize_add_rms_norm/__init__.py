"""Fused MoE finalize (top-k combine) + optional all-reduce + residual add + RMSNorm."""

from .ops import moe_finalize_add_rms_norm as moe_finalize_add_rms_norm
from .ops import moe_finalize_add_rms_norm_supported as moe_finalize_add_rms_norm_supported
from .reference import moe_finalize_add_rms_norm_reference as moe_finalize_add_rms_norm_reference
