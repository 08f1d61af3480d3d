"""The few JAX API differences between 0.11.2 (the GPU machine) and 0.12 (CPU CI), in one place."""

from typing import Any

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
