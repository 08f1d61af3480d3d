"""The Pallas Triton kernels that take no platform gate lower for CUDA on any machine, at a
shape the models give them (`compat.cuda_lowering_target`: an abstract H200): block shapes,
dtypes and the Triton IR are checked in CI, not first on a lent GPU (the delta rule's scan in
its own test file). The compiled kernels' numerics are the ON_GPU tests'. The add + norm and
quantize kernels ask `jax.default_backend()` whether they run, so they lower on a GPU only.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import compat
from pallas_kernels.fp8_matmul.kernel_grouped_triton import fp8_expert_matmul
from pallas_kernels.fp8_matmul.kernel_triton import fp8_matmul_triton
from pallas_kernels.fp8_matmul.tuned_block_sizes import triton_fp8_tiling
from pallas_kernels.grouped_matmul.kernel_triton import expert_matmul
from pallas_kernels.paged_attention import ragged_paged_attention

pytestmark = pytest.mark.skipif(
    compat.cuda_lowering_target() is None, reason="this JAX cannot name an abstract GPU"
)

S = jax.ShapeDtypeStruct
BF16, F32, I32, FP8 = jnp.bfloat16, jnp.float32, jnp.int32, jnp.float8_e4m3fn
ROWS = 4096


def _fp8_rows(m: int, k: int) -> tuple[S, S]:
    return S((m, k), FP8), S((m, k // 128), F32)


CASES = {
    "paged attention, Llama-3-8B heads": (
        functools.partial(ragged_paged_attention, scale=128**-0.5),
        (
            S((512, 8, 4, 128), BF16),
            S((1024, 16, 8, 128), BF16),
            S((1024, 16, 8, 128), BF16),
            S((64, 64), I32),
            S((512,), I32),
            S((512,), I32),
        ),
    ),
    "grouped matmul, Qwen3-30B-A3B experts": (
        expert_matmul,
        (S((ROWS * 8, 2048), BF16), S((128, 2048, 1536), BF16), S((128,), I32)),
    ),
    "FP8 matmul, decode rows": (
        functools.partial(
            fp8_matmul_triton, out_dtype=BF16, tiling=triton_fp8_tiling(64, 4096, 6144)
        ),
        (*_fp8_rows(64, 4096), S((6144, 4096), FP8), S((48, 32), F32)),
    ),
    "FP8 grouped matmul, decode experts": (
        functools.partial(fp8_expert_matmul, out_dtype=BF16),
        (*_fp8_rows(512, 2048), S((128, 1536, 2048), FP8), S((128, 12, 16), F32), S((128,), I32)),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_lowers_for_an_h200(name):
    kernel, args = CASES[name]
    with compat.cuda_lowering_target():
        lowered = jax.jit(kernel).trace(*args).lower(lowering_platforms=("cuda",))
    assert "custom_call @__gpu$xla.gpu.triton" in lowered.as_text()
