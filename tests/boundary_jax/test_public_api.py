"""The public API stays small, and every renamed spelling still works for one release, warning
with its new one."""

import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

import boundary_jax as bj
from boundary_jax import designs, residual_stream


def test_the_top_level_lists_at_most_40_names():
    """`dir(boundary_jax)` is `__all__`: at most 40 names, each of them real."""
    public = [name for name in dir(bj) if not name.startswith("_")]
    assert public == sorted(bj.__all__)
    assert len(public) <= 40, public
    assert all(getattr(bj, name) is not None for name in public)


@pytest.mark.parametrize("name", sorted(bj._MOVED))
def test_a_moved_name_warns_with_its_new_spelling(name):
    """`bj.<moved>` is the object at its new home, with a DeprecationWarning naming that home."""
    new = bj._MOVED[name]
    home, _, attr = new.rpartition(".")
    with pytest.warns(DeprecationWarning, match=f"use boundary_jax\\.{new}$"):
        value = getattr(bj, name)
    assert value is getattr(getattr(bj, home), attr)
    assert name not in dir(bj)


def test_an_unknown_name_is_still_an_attribute_error():
    """Names that never existed raise AttributeError, naming the module."""
    with pytest.raises(AttributeError, match="'boundary_jax' has no attribute 'ExitKinds'"):
        bj.ExitKinds  # noqa: B018


def test_the_residual_alias_forwards_and_warns_once():
    """`boundary_jax.residual` imports both ways and forwards to residual_stream, warning on the
    first name read through it only (a fresh process: the warning is once per process)."""
    script = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            import boundary_jax.residual
            from boundary_jax import residual, residual_stream
            assert not caught, [str(w.message) for w in caught]
            assert residual.start is residual_stream.start
            assert boundary_jax.residual.final_norm is residual_stream.final_norm
            from boundary_jax.residual import fold
            assert fold is residual_stream.fold
        assert [w.category for w in caught] == [DeprecationWarning], caught
        print(caught[0].message)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "use boundary_jax.residual_stream" in result.stdout


def test_sum_group_tp_is_full_tp():
    """The deprecated `SumGroup.TP` is the same member as `FULL_TP`."""
    assert bj.SumGroup.TP is bj.SumGroup.FULL_TP
    assert bj.SumGroup["TP"] is bj.SumGroup.FULL_TP
    assert "TP" not in [group.name for group in bj.SumGroup]


@pytest.mark.parametrize("gathers", [False, True])
def test_declare_attn_exit_scoped_warns_and_is_declare_mixer(gathers):
    """declare_attn(reduction=EXIT_SCOPED) declares what declare_mixer does, and says so."""
    spelled = "declare_mixer\\(gathers_attn_tp_input=True\\)" if gathers else "declare_mixer\\(\\)"
    with pytest.warns(DeprecationWarning, match=spelled):
        old = bj.declare_attn(
            reduction=bj.ProducerReduction.EXIT_SCOPED, gathers_attn_tp_input=gathers
        )
    assert old == bj.declare_mixer(gathers_attn_tp_input=gathers)
    assert old.reduction is bj.ProducerReduction.EXIT_SCOPED


def test_declare_mixer_reads_its_own_rows_by_default():
    """A mixer is EXIT_SCOPED and does not gather its input unless asked."""
    mixer = bj.declare_mixer()
    assert mixer.kind is bj.declare.StageKind.ATTN
    assert mixer.reduction is bj.ProducerReduction.EXIT_SCOPED
    assert not mixer.gathers_attn_tp_input


@pytest.mark.parametrize("norm_class", [bj.RMSNorm, designs.PostNormUpdate])
def test_gemma_is_the_deprecated_spelling_of_unit_offset(norm_class):
    """`gemma=True` builds the `unit_offset=True` norm (zero weight, `1 + w` scale), warning."""
    with pytest.warns(DeprecationWarning, match="unit_offset=True"):
        old = norm_class(8, gemma=True)
    new = norm_class(8, unit_offset=True)
    assert old.unit_offset and new.unit_offset
    np.testing.assert_array_equal(old.weight[...], jnp.zeros(8))
    x = jnp.arange(16.0).reshape(2, 8)
    np.testing.assert_array_equal(old(x), new(x))
    with pytest.warns(DeprecationWarning, match="unit_offset"):
        assert old.gemma is True
    with (
        pytest.raises(ValueError, match="old spelling of unit_offset"),
        pytest.warns(DeprecationWarning),
    ):
        norm_class(8, gemma=False, unit_offset=True)


def test_batch_rows_is_the_deprecated_spelling_of_rows_per_block():
    """`rows=` checks counts as `rows_per_block=` does, warning."""
    topology = bj.Topology(attn_dp=2)
    with pytest.warns(DeprecationWarning, match="rows_per_block=8"):
        old = bj.BatchFacts.ordinary(topology, [8, 3], rows=8)
    new = bj.BatchFacts.ordinary(topology, [8, 3], rows_per_block=8)
    np.testing.assert_array_equal(old.token_counts, new.token_counts)
    with pytest.raises(ValueError, match="in \\[0, 4\\]"), pytest.warns(DeprecationWarning):
        bj.BatchFacts.unpadded(bj.Topology(attn_tp=2), [5], rows=4)


def test_the_stream_helpers_live_in_residual_stream():
    """The helpers a model calls around its layers are residual_stream's names."""
    for name in ("start", "final_norm", "final_norm_captured", "complete_output", "fold"):
        assert callable(getattr(residual_stream, name))
    for name in ("set_written", "take_output", "snapshot", "add_to_output", "to_pp"):
        assert callable(getattr(residual_stream, name))
    assert callable(residual_stream.onto_residual_rows) and callable(residual_stream.next_pass)
