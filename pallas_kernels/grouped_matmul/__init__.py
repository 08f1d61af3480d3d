"""Grouped matmuls for MoE experts: the Triton expert matmul, JAX's Hopper kernel, their tuned
tilings, and the choice between them by size."""

from .kernel_hopper import HOPPER_AVAILABLE as HOPPER_AVAILABLE
from .kernel_hopper import hopper_ragged_dot as hopper_ragged_dot
from .kernel_triton import expert_matmul as expert_matmul
from .ops import HOPPER_MAX_GROUPS as HOPPER_MAX_GROUPS
from .ops import TRITON_MAX_ROUTED_ROWS as TRITON_MAX_ROUTED_ROWS
from .ops import GroupedMatmulImpl as GroupedMatmulImpl
from .ops import Tiling as Tiling
from .ops import TilingTable as TilingTable
from .ops import default_grouped_matmul_impl as default_grouped_matmul_impl
from .ops import grouped_matmul as grouped_matmul
from .ops import grouped_matmul_by_size as grouped_matmul_by_size
from .reference import grouped_matmul_reference as grouped_matmul_reference
from .tuned_block_sizes import HopperTiling as HopperTiling
from .tuned_block_sizes import TritonTiling as TritonTiling
from .tuned_block_sizes import hopper_tiling as hopper_tiling
from .tuned_block_sizes import triton_tiling as triton_tiling
