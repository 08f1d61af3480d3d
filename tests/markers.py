"""Skip markers shared by the kernel tests: where a kernel runs compiled, and where JAX can
interpret a Mosaic GPU kernel on the CPU."""

import jax
import pytest

from pallas_kernels import compat

ON_GPU = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
"""The kernel as the GPU compiles it."""

GPU_INTERPRET = pytest.mark.skipif(
    compat.gpu_interpret_params() is None, reason="this JAX has no Mosaic GPU interpreter"
)
"""A Mosaic GPU kernel body in JAX's interpreter (JAX >= 0.12)."""
