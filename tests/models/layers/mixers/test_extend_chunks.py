"""`extend_chunks`: a serving step's chunks stepped side by side equal the rows stepped one
after another through their slots' states."""

import jax.numpy as jnp
import numpy as np

from models.layers.mixers.ssd import extend_chunks

# Slot 2 continues at positions 5..9, slot 0 decodes at 3, slot 3 starts afresh (two rows),
# then padding; slot 1 has no row and keeps its state.
SEGMENTS = np.array([2, 2, 2, 2, 2, 0, 3, 3, -1, -1], np.int32)
POSITIONS = np.array([5, 6, 7, 8, 9, 3, 0, 1, 0, 0], np.int32)


def step(states, row, valid):
    """A toy recurrence: state <- 0.5 state + x, output state * 2."""
    new = 0.5 * states + row
    states = jnp.where(valid[:, None], new, states)
    return 2.0 * new, states


def row_by_row(rows, states):
    states, out = np.array(states), np.zeros_like(rows)
    for i, (segment, position) in enumerate(zip(SEGMENTS, POSITIONS, strict=True)):
        if segment < 0:
            continue
        state = 0 if position == 0 else states[segment]
        states[segment] = 0.5 * state + rows[i]
        out[i] = 2.0 * states[segment]
    return out, states


def test_chunks_side_by_side_equal_rows_one_by_one():
    rows = np.random.default_rng(0).normal(size=(len(SEGMENTS), 3)).astype(np.float32)
    states = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
    out, final = extend_chunks(
        step, jnp.asarray(rows), jnp.asarray(POSITIONS), jnp.asarray(SEGMENTS), jnp.asarray(states)
    )
    want_out, want_final = row_by_row(rows, states)
    np.testing.assert_allclose(out, want_out, rtol=1e-6)
    np.testing.assert_allclose(final, want_final, rtol=1e-6)
    assert not np.asarray(out[-2:]).any()
    np.testing.assert_array_equal(final[1], states[1])
