"""Deprecated: `boundary_jax.residual` is now `boundary_jax.residual_stream`.

The old name read as the residual array every layer holds; the module is the runtime of the
stream that carries it (`start`, `final_norm`, `to_pp`, ...). This alias forwards every name to
`boundary_jax.residual_stream` and will be removed in the next release. It warns once, the first
time a name is read through it (`from boundary_jax import residual` alone stays silent, so that
importing `boundary_jax` itself never warns).
"""

import warnings

from . import residual_stream

_warned = False


def __getattr__(name: str):
    global _warned
    if name.startswith("__"):  # e.g. the import system's __path__ probe: this is no package
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(residual_stream, name)  # AttributeError for a name it never had
    if not _warned:
        _warned = True
        warnings.warn(
            f"boundary_jax.residual is deprecated; use boundary_jax.residual_stream "
            f"(residual.{name} is residual_stream.{name})",
            DeprecationWarning,
            stacklevel=2,
        )
    return value


def __dir__() -> list[str]:
    return dir(residual_stream)
