"""The Pallas chunk scan of the gated delta rule (`pallas_kernels.delta_rule_scan`), through
`gated_delta_rule_chunked(scan=...)`: in the Pallas interpreter against the `jnp` chunked form
and the float64 recurrence, gradients the `jnp` form's, and on a GPU at the Qwen3-Next shape."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers.mixers.delta_rule import gated_delta_rule_chunked
from pallas_kernels import compat
from tests.models.layers.mixers.test_gated_deltanet import numpy_delta_rule, random_rule_inputs
from tests.models.layers.mixers.test_mamba2 import layout_rows

# Ragged packed rows (slot, length): sequences cross the 8-row chunks anywhere; slot 3 holds
# two sequences one after the other; slot 4 has none.
LAYOUT = ((0, 11), (2, 3), (3, 6), (3, 9), (1, 13))


def _inputs(per_channel=False):
    positions, segments = layout_rows(LAYOUT, padding=6)
    inputs = random_rule_inputs(
        len(positions), k_heads=2, v_heads=4, k_dim=16, v_dim=32, seed=3, per_channel=per_channel
    )
    return inputs, positions, segments


def test_interpreted_kernel_equals_jnp_chunks_and_the_recurrence():
    """Outputs and per-slot final states of the kernel (interpreted, float32) equal the `jnp`
    chunked form's within 1e-5 relative and the float64 recurrence's within 1e-4: a wrong carry,
    decay, mask or chunk index would be off by O(1)."""
    inputs, positions, segments = _inputs()
    want_out, want_finals = numpy_delta_rule(*inputs, positions, segments, slots=5)
    args = [jnp.asarray(x, jnp.float32) for x in inputs]
    rule = functools.partial(gated_delta_rule_chunked, chunk_size=8, num_slots=5)
    with jax.default_matmul_precision("highest"):  # float32 dots, not TF32, on a GPU
        out, finals = rule(*args, positions, segments, scan="interpret")
        ref_out, ref_finals = rule(*args, positions, segments, scan="jnp")
    scale = np.abs(want_out).max()
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(finals, ref_finals, rtol=1e-5, atol=1e-5 * np.abs(want_finals).max())
    np.testing.assert_allclose(out, want_out, atol=1e-4 * scale)
    np.testing.assert_allclose(finals, want_finals, atol=1e-4 * np.abs(want_finals).max())
    assert scale > 0.3 and not want_finals[4].any()


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
def test_bf16_storage_rounds_between_the_matmuls_only(per_channel):
    """bf16 storage of the terms between the matmuls (float32 inputs, state and sums): the
    kernel (interpreted; scalar gates) and the `jnp` scan round at the same places, so they
    agree within 1e-3 relative of the output's scale; both stay within 1e-2 of the float64
    recurrence yet differ from it by more than float32 storage would (1e-4), so the rounding
    happened; the final states stay float32."""
    inputs, positions, segments = _inputs(per_channel)
    want_out, want_finals = numpy_delta_rule(*inputs, positions, segments, slots=5)
    args = [jnp.asarray(x, jnp.float32) for x in inputs]
    rule = functools.partial(
        gated_delta_rule_chunked, chunk_size=8, num_slots=5, storage=jnp.bfloat16
    )
    scale, state_scale = np.abs(want_out).max(), np.abs(want_finals).max()
    with jax.default_matmul_precision("highest"):
        ref_out, ref_finals = rule(*args, positions, segments, scan="jnp")
        if not per_channel:
            out, finals = rule(*args, positions, segments, scan="interpret")
            np.testing.assert_allclose(out, ref_out, atol=1e-3 * scale)
            np.testing.assert_allclose(finals, ref_finals, atol=1e-3 * state_scale)
    assert ref_out.dtype == ref_finals.dtype == jnp.float32
    np.testing.assert_allclose(ref_out, want_out, atol=1e-2 * scale)
    np.testing.assert_allclose(ref_finals, want_finals, atol=1e-2 * state_scale)
    assert np.abs(ref_out - want_out).max() > 1e-4 * scale


def test_bf16_inputs_store_in_bf16_by_default():
    """bf16 inputs store the terms in bf16 unless told otherwise: the default's results are the
    explicit bf16 storage's, and float32 storage's differ from them; float32 inputs keep
    float32 storage (the default equals it)."""
    inputs, positions, segments = _inputs()
    rule = functools.partial(gated_delta_rule_chunked, chunk_size=8, num_slots=5)
    for dtype, same, other in (
        (jnp.bfloat16, jnp.bfloat16, jnp.float32),
        (jnp.float32, jnp.float32, jnp.bfloat16),
    ):
        args = [jnp.asarray(x, dtype) for x in inputs[:3]] + [jnp.asarray(x) for x in inputs[3:]]
        default = rule(*args, positions, segments)
        chex.assert_trees_all_equal(default, rule(*args, positions, segments, storage=same))
        assert np.abs(default[0] - rule(*args, positions, segments, storage=other)[0]).max() > 0


def test_storage_must_be_a_float_no_wider_than_the_sums():
    inputs, positions, segments = _inputs()
    args = [jnp.asarray(x, jnp.float32) for x in inputs]
    for storage in (jnp.int32, jnp.float64):
        with pytest.raises(ValueError, match="storage must be a float dtype"):
            gated_delta_rule_chunked(*args, positions, segments, storage=storage)


@pytest.mark.slow
def test_interpreted_kernel_gradient_is_the_jnp_forms():
    """The kernel differentiates as the `jnp` scan (`with_reference_vjp`)."""
    inputs, positions, segments = _inputs()
    args = [jnp.asarray(x, jnp.float32) for x in inputs]

    def loss(scan, q, v):
        out, finals = gated_delta_rule_chunked(
            q, args[1], v, *args[3:], positions, segments, chunk_size=8, num_slots=5, scan=scan
        )
        return jnp.sum(out * out) + jnp.sum(finals)

    got = jax.grad(functools.partial(loss, "interpret"), argnums=(0, 1))(args[0], args[2])
    want = jax.grad(functools.partial(loss, "jnp"), argnums=(0, 1))(args[0], args[2])
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(
    compat.cuda_lowering_target() is None, reason="this JAX cannot name an abstract GPU"
)
@pytest.mark.parametrize("storage", [None, jnp.bfloat16], ids=["float32", "bf16"])
def test_kernel_lowers_to_triton_for_an_h200_at_qwen3_next_shape(storage):
    """The chunked rule with the kernel lowers for CUDA on any machine (an abstract H200) at
    the Qwen3-Next mixer shape, 4096 rows of bf16, float32 or bf16 storage: the kernel's block
    shapes and its Triton IR are checked here, not first on the GPU."""
    rows = 4096
    shape = jax.ShapeDtypeStruct
    args = (
        shape((rows, 16, 128), jnp.bfloat16),
        shape((rows, 16, 128), jnp.bfloat16),
        shape((rows, 32, 128), jnp.bfloat16),
        shape((rows, 32), jnp.float32),
        shape((rows, 32), jnp.float32),
        shape((rows,), jnp.int32),
        shape((rows,), jnp.int32),
    )
    rule = functools.partial(
        gated_delta_rule_chunked.__wrapped__, num_slots=3, scan="pallas", storage=storage
    )
    with compat.cuda_lowering_target():
        lowered = jax.jit(rule).trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("custom_call @__gpu$xla.gpu.triton") == 1


def test_kernel_refuses_per_channel_gates_and_unknown_scans():
    inputs, positions, segments = _inputs(per_channel=True)
    with pytest.raises(ValueError, match="scalar gate"):
        gated_delta_rule_chunked(*inputs, positions, segments, scan="pallas")
    inputs, positions, segments = _inputs()
    with pytest.raises(ValueError, match="scan must be one of"):
        gated_delta_rule_chunked(*inputs, positions, segments, scan="triton")


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="Triton runs on GPU only")
@pytest.mark.parametrize(
    "rows, storage, bound", [(4096, None, 2e-3), (4000, None, 2e-3), (4096, jnp.bfloat16, 1e-2)]
)
def test_gpu_kernel_equals_jnp_chunks_at_qwen3_next_shape(rows, storage, bound):  # pragma: no cover
    """At the Qwen3-Next mixer shape (16 k-heads, 32 v-heads, 128 x 128), packed rows of three
    sequences in 64 chunks, or 63 (a count no power of two), the compiled kernel equals the
    `jnp` chunked form (float32 inputs; float32 or bf16 storage, where the two sum their
    bf16 products in different orders and so round some stored terms differently)."""
    layout = ((0, 1000), (1, 2400), (2, 590))
    positions, segments = layout_rows(layout, padding=rows - 3990)
    keys = jax.random.split(jax.random.key(0), 5)
    q, k = (jax.random.normal(x, (rows, 16, 128)) for x in keys[:2])
    v = jax.random.normal(keys[2], (rows, 32, 128))
    g = -jax.random.uniform(keys[3], (rows, 32), minval=0.01, maxval=0.5)
    beta = jax.random.uniform(keys[4], (rows, 32), minval=0.05, maxval=0.95)
    rule = functools.partial(gated_delta_rule_chunked, num_slots=3, storage=storage)
    out, finals = rule(q, k, v, g, beta, positions, segments, scan="pallas")
    ref_out, ref_finals = rule(q, k, v, g, beta, positions, segments)
    scale = float(jnp.abs(ref_out).max())
    np.testing.assert_allclose(out, ref_out, atol=bound * scale)
    np.testing.assert_allclose(finals, ref_finals, atol=bound * float(jnp.abs(ref_finals).max()))
