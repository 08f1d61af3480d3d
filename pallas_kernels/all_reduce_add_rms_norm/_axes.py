"""Mesh-axis naming shared by the distributed kernels."""

import jax

AxisName = str | tuple[str, ...]


def device_id(axis_name: AxisName, index: jax.Array) -> dict:
    """The mesh device at linear `index` along `axis_name`; other mesh axes stay this device's."""
    if isinstance(axis_name, tuple) and len(axis_name) == 1:
        axis_name = axis_name[0]
    return {axis_name: index}
