"""The few JAX API differences between 0.11.2 (the GPU machine) and 0.12 (CPU CI), in one place
for every package of the project (`boundary_jax` imports its guards from here)."""

import contextlib
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


def cuda_lowering_target() -> contextlib.AbstractContextManager | None:
    """A context in which Pallas Triton kernels lower for an H200 on any machine (an abstract
    mesh naming the device, which the Triton lowering reads for the compute capability), so
    that `jit(...).trace(...).lower(lowering_platforms=("cuda",))` checks a kernel's Triton IR
    in CI. None where this JAX's abstract mesh cannot name a device.
    """
    device = getattr(jax.sharding, "AbstractDevice", None)
    if device is None:
        return None
    h200 = device(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    auto = (jax.sharding.AxisType.Auto,)
    try:
        mesh = jax.sharding.AbstractMesh((1,), ("lowering",), axis_types=auto, abstract_device=h200)
    except TypeError:  # an AbstractMesh that names no device
        return None
    return jax.sharding.use_abstract_mesh(mesh)


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
