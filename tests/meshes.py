"""The one mesh helper of the tests: attention DP x attention TP over simulated CPU devices."""

import jax

import boundary_jax as bj


def make_mesh(dp: int, tp: int) -> jax.sharding.Mesh:
    """An attn_dp x attn_tp mesh over the first dp*tp simulated devices."""
    names = (bj.MeshAxis.ATTN_DP.value, bj.MeshAxis.ATTN_TP.value)
    return jax.make_mesh((dp, tp), names, devices=jax.devices()[: dp * tp])
