"""The one mesh helper of the tests: attention DP x attention TP over simulated CPU devices."""

import jax
import pytest

import boundary_jax as bj


def need_devices(count: int) -> None:
    """Skips the calling test where the default platform has fewer than `count` devices (a GPU
    machine with one GPU runs the tests written for eight simulated CPU devices)."""
    have = len(jax.devices())
    if have < count:
        pytest.skip(f"needs {count} devices; {jax.default_backend()} has {have}")


def make_mesh(dp: int, tp: int) -> jax.sharding.Mesh:
    """An attn_dp x attn_tp mesh over the first dp*tp simulated devices (the test skipped
    where there are fewer)."""
    need_devices(dp * tp)
    names = (bj.MeshAxis.ATTN_DP.value, bj.MeshAxis.ATTN_TP.value)
    return jax.make_mesh((dp, tp), names, devices=jax.devices()[: dp * tp])
