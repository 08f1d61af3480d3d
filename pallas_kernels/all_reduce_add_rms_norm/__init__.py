"""Fused "complete the sum + residual add + RMSNorm" for use inside `jax.shard_map`."""

from .ops import AllReduceAlgorithm as AllReduceAlgorithm
from .ops import all_reduce_add_rms_norm as all_reduce_add_rms_norm
from .ops import all_reduce_add_rms_norm_supported as all_reduce_add_rms_norm_supported
from .reference import all_reduce_add_rms_norm_reference as all_reduce_add_rms_norm_reference
