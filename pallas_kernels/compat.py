"""The few JAX API differences between 0.11.2 (the GPU machine) and 0.12 (CPU CI), in one place
for every package of the project (`boundary_jax` imports its guards from here)."""

from typing import Any

import jax
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu


def gpu_interpret_params() -> Any | None:
    """Returns Mosaic GPU interpret-mode parameters, or None where JAX has no GPU interpreter.

    `plgpu.InterpretGPUParams` arrived after 0.11.2; on older JAX the Mosaic GPU kernels can only
    run on a GPU.
    """
    params = getattr(plgpu, "InterpretGPUParams", None)
    return None if params is None else params()


def tpu_interpret_races_found() -> bool:
    """Whether the TPU interpreter's race detector saw a race since its state was last reset.

    JAX keeps this flag in a private module (its own tests read it the same way); the module moved
    between releases, so it is looked up here and nowhere else.
    """
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    races = interpret_pallas_call.races
    return races is not None and races.races_found


def cudnn_fused_attention() -> Any:
    """JAX's cuDNN attention module, for what `jax.nn.dot_product_attention` does not take:
    ragged segment offsets, and a value narrower than the key (latent attention's).

    The module is private (`jax._src.cudnn`, stable in 0.11 and 0.12), so it is looked up here and
    nowhere else.
    """
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


def varying_axes(value) -> tuple[str, ...]:
    """Mesh axes over which `value` (or a `ShapeDtypeStruct`) varies inside `shard_map`."""
    aval = value if isinstance(value, jax.ShapeDtypeStruct) else jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    axes = manual.varying if manual is not None else getattr(aval, "vma", frozenset())
    return tuple(sorted(axes))


def zeros_varying_like(result: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of `result`'s shape and dtype, varying over the same mesh axes."""
    value = jax.numpy.zeros(result.shape, result.dtype)
    axes = varying_axes(result)
    return lax.pcast(value, axes, to="varying") if axes else value


def pallas_paged_attention() -> Any:
    """JAX's shipped Pallas (Triton) paged decode attention,
    `jax.experimental.pallas.ops.gpu.paged_attention.paged_attention` (in 0.11.2 and 0.12; 0.12
    warns on import that the Triton ops are deprecated, so the import is guarded here)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention

    return paged_attention.paged_attention
