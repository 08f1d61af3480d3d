"""Block-scaled FP8 matmuls (Hugging Face fine-grained FP8 weights, rows quantized per token
group): the Triton decode kernel, the warp-specialized Mosaic GPU wgmma kernel (dense, or batched
over experts padded to a capacity), the grouped Triton kernel of MoE experts, their tilings, and
the choice between them by size. Inference
only: none has a VJP (FP8 weights are not trained)."""

from .kernel_grouped_triton import fp8_expert_matmul as fp8_expert_matmul
from .kernel_mosaic import fp8_matmul_mosaic as fp8_matmul_mosaic
from .kernel_triton import fp8_matmul_triton as fp8_matmul_triton
from .ops import TRITON_MAX_ROWS as TRITON_MAX_ROWS
from .ops import Fp8GroupedImpl as Fp8GroupedImpl
from .ops import Fp8MatmulImpl as Fp8MatmulImpl
from .ops import Fp8Tiling as Fp8Tiling
from .ops import default_fp8_grouped_impl as default_fp8_grouped_impl
from .ops import default_fp8_matmul_impl as default_fp8_matmul_impl
from .ops import fp8_batched_matmul as fp8_batched_matmul
from .ops import fp8_grouped_matmul as fp8_grouped_matmul
from .ops import fp8_matmul as fp8_matmul
from .ops import fp8_matmul_by_size as fp8_matmul_by_size
from .ops import padded_product as padded_product
from .reference import fp8_batched_matmul_reference as fp8_batched_matmul_reference
from .reference import fp8_grouped_matmul_reference as fp8_grouped_matmul_reference
from .reference import fp8_matmul_reference as fp8_matmul_reference
from .tuned_block_sizes import SCALE_BLOCK as SCALE_BLOCK
from .tuned_block_sizes import SWAP_MAX_ROWS as SWAP_MAX_ROWS
from .tuned_block_sizes import MosaicFp8Tiling as MosaicFp8Tiling
from .tuned_block_sizes import TritonFp8Tiling as TritonFp8Tiling
from .tuned_block_sizes import mosaic_fp8_batched_tiling as mosaic_fp8_batched_tiling
from .tuned_block_sizes import mosaic_fp8_tiling as mosaic_fp8_tiling
from .tuned_block_sizes import triton_fp8_tiling as triton_fp8_tiling
