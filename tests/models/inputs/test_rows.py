"""Packing whole sequences onto attention-DP ranks as static padded blocks of rows."""

import jax
import numpy as np
import pytest

import boundary_jax as bj
from models.inputs.rows import RowsPhase, TokenRows, decode_rows, pack_sequences
from models.pipeline.schedule import split_microbatches


def test_sequences_are_balanced_whole_and_padded():
    """Longest first onto the least-loaded rank; blocks divide over attention TP."""
    topology = bj.Topology(attn_dp=2, attn_tp=4)
    sequences = [[1] * 7, [2] * 1, [3] * 12, [4] * 5]
    packed = pack_sequences(sequences, topology)
    assert packed.rows_per_rank % 4 == 0
    assert packed.token_counts.tolist() == [13, 12]
    assert packed.rank == (1, 0, 0, 1)
    rows = packed.rows
    for index, tokens in enumerate(sequences):
        first = packed.rank[index] * packed.rows_per_rank + packed.start[index]
        assert rows.ids[first : first + len(tokens)].tolist() == tokens
        assert rows.positions[first : first + len(tokens)].tolist() == list(range(len(tokens)))
        assert set(rows.segment_ids[first : first + len(tokens)]) == {packed.slot[index]}
    block = rows.segment_ids.reshape(2, -1)
    for rank, count in enumerate(packed.token_counts):
        assert (block[rank, :count] >= 0).all() and (block[rank, count:] == -1).all()


def test_an_idle_rank_has_an_all_padding_block():
    """With fewer sequences than DP ranks, the idle ranks hold only padding."""
    packed = pack_sequences([[1, 2, 3]], bj.Topology(attn_dp=4))
    assert packed.token_counts.tolist() == [3, 0, 0, 0]
    assert (packed.rows.segment_ids[packed.rows_per_rank :] == -1).all()


def test_unpack_and_last_rows_invert_the_packing():
    """unpack() gives [sequences, longest, ...] with zeros past each end."""
    packed = pack_sequences([[1] * 3, [2] * 5], bj.Topology(attn_dp=2))
    values = np.arange(2 * packed.rows_per_rank, dtype=np.float32)[:, None]
    out = packed.unpack(values)
    assert out.shape == (2, 5, 1)
    assert out[0, 3:].sum() == 0
    np.testing.assert_array_equal(packed.last_rows(values)[:, 0], [out[0, 2, 0], out[1, 4, 0]])


def test_decode_rows_land_in_the_prefill_slots():
    """A decode step has one row per sequence, in the slot its prefill used."""
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    packed = pack_sequences([[1] * 3, [2] * 5, [3] * 2], topology)
    step = decode_rows(packed, np.array([7, 8, 9]), np.array([3, 5, 2]))
    assert step.rows_per_rank == 2
    for index in range(3):
        row = packed.rank[index] * 2 + packed.slot[index]
        assert step.rows.segment_ids[row] == packed.slot[index]
        assert step.rows.ids[row] == (7, 8, 9)[index]
    assert step.token_counts.tolist() == [1, 2]


def test_packing_rejects_empty_input_and_small_blocks():
    """Empty sequences and a block too small for a rank's tokens are rejected."""
    with pytest.raises(ValueError, match="no empty sequence"):
        pack_sequences([[1], []], bj.Topology())
    with pytest.raises(ValueError, match="rows_per_rank"):
        pack_sequences([[1] * 9], bj.Topology(attn_tp=2), rows_per_rank=8)


def test_a_sequence_bound_is_checked_and_carried_by_prefill_rows_only():
    """`max_sequence_rows` rejects a longer sequence; the prefill rows carry it (static), a
    decode step's rows do not."""
    with pytest.raises(ValueError, match="longer than max_sequence_rows=4"):
        pack_sequences([[1] * 3, [2] * 5], bj.Topology(), max_sequence_rows=4)
    packed = pack_sequences([[1] * 3, [2] * 5], bj.Topology(), max_sequence_rows=5)
    assert packed.rows.max_sequence_rows == 5
    assert jax.tree.structure(packed.rows) != jax.tree.structure(
        pack_sequences([[1] * 3, [2] * 5], bj.Topology()).rows
    )
    step = decode_rows(packed, np.array([7, 8]), np.array([3, 5]))
    assert step.rows.max_sequence_rows is None


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 4)])
def test_equal_sequences_lie_in_windows_of_their_length(dp, tp):
    """Sequences of exactly `max_sequence_rows` rows mark prefill rows `equal_sequences`: on
    each DP rank, every window of that many rows holds one sequence from its first row, or
    padding (under TP 4 the block also ends in rows short of a window)."""
    sequences = [[s] * 6 for s in range(1, 6)]
    packed = pack_sequences(sequences, bj.Topology(attn_dp=dp, attn_tp=tp), max_sequence_rows=6)
    rows = packed.rows
    assert rows.equal_sequences and rows.window_rows == 6
    whole = packed.rows_per_rank // 6 * 6
    placed = []
    for rank in range(dp):
        block = slice(rank * packed.rows_per_rank, (rank + 1) * packed.rows_per_rank)
        segments, positions = rows.segment_ids[block], rows.positions[block]
        ids = rows.ids[block]
        assert (segments[whole:] == -1).all()
        for window in range(whole // 6):
            seg, pos = segments[window * 6 : window * 6 + 6], positions[window * 6 : window * 6 + 6]
            if (seg == -1).all():
                continue
            assert len(set(seg)) == 1 and pos.tolist() == list(range(6))
            placed.append(ids[window * 6 : window * 6 + 6].tolist())
    assert sorted(placed) == sequences


def test_equal_sequences_only_where_they_hold():
    """Unequal lengths, no bound, context parallelism and decode rows are not windows; the flag
    needs the bound."""
    topology = bj.Topology(attn_tp=2)
    assert not pack_sequences([[1] * 6, [2] * 5], topology, max_sequence_rows=6).rows.window_rows
    assert not pack_sequences([[1] * 6] * 2, topology).rows.equal_sequences
    assert not pack_sequences([[1] * 6] * 2, topology, max_sequence_rows=7).rows.equal_sequences
    cp = pack_sequences([[1] * 8] * 2, bj.Topology(attn_cp=2), max_sequence_rows=8)
    assert not cp.rows.equal_sequences
    packed = pack_sequences([[1] * 6] * 2, topology, max_sequence_rows=6)
    step = decode_rows(packed, np.array([7, 8]), np.array([6, 6]))
    assert step.rows.window_rows is None
    ids = np.zeros(4, np.int32)
    assert TokenRows(ids, ids, ids, RowsPhase.DECODE, 4, True).window_rows is None
    with pytest.raises(ValueError, match="equal_sequences needs"):
        TokenRows(ids, ids, ids, equal_sequences=True)
    with pytest.raises(ValueError, match="max_sequence_rows must be >= 1"):
        TokenRows(ids, ids, ids, max_sequence_rows=0)


def test_last_row_index_and_slot_order_address_each_sequence():
    """Per DP rank and slot, last_row_index is the slot's last row; slot_order finds it back."""
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    sequences = [[1] * 3, [2] * 5, [3] * 2]
    packed = pack_sequences(sequences, topology, slots_per_rank=4)
    assert packed.decode_rows_per_rank == 4
    index = packed.last_row_index()
    assert index.shape == (2 * 4,)
    values = np.arange(2 * packed.rows_per_rank)
    for sequence, position in enumerate(packed.slot_order()):
        rank = position // 4
        row = rank * packed.rows_per_rank + index[position]
        assert packed.rows.ids[row] == sequences[sequence][-1]
        assert values[row] == packed.last_rows(values)[sequence]
    assert (np.sort(index)[: 2 * 4 - 3] == -1).all()  # the five empty slots


def test_slots_per_rank_must_hold_the_sequences_and_split_over_tp():
    """A decode block smaller than a rank's sequences, or not a multiple of TP, is rejected."""
    topology = bj.Topology(attn_tp=2)
    with pytest.raises(ValueError, match="slots_per_rank must be a multiple"):
        pack_sequences([[1], [2], [3]], topology, slots_per_rank=2)
    with pytest.raises(ValueError, match="slots_per_rank must be a multiple"):
        pack_sequences([[1]], topology, slots_per_rank=3)


def test_prefill_rows_carry_their_slots_as_the_segment_bound():
    """Packed prefill rows carry the decode block's slots per rank (what bounds their segment
    ids), the given `slots_per_rank` where there is one, and pipeline microbatches keep it."""
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    sequences = [[1] * 3, [2] * 5, [3] * 2, [4]]
    packed = pack_sequences(sequences, topology)
    assert packed.rows.slots == packed.decode_rows_per_rank == 2
    assert packed.rows.segment_ids.max() < packed.rows.slots
    assert pack_sequences(sequences, topology, slots_per_rank=8).rows.slots == 8
    single = pack_sequences([[5] * 9], bj.Topology())
    assert single.rows.slots == 1 and single.rows.ids.shape == (9,)
    for part in split_microbatches(packed, 2, topology):
        assert part.packed.rows.slots == 2
    with pytest.raises(ValueError, match="slots must be >= 1"):
        TokenRows(np.zeros(2), np.zeros(2), np.zeros(2), slots=0)


def test_decode_rows_put_row_i_in_slot_i():
    """Decode rows are DECODE phase, one per slot: row i of a rank is slot i (or padding)."""
    packed = pack_sequences([[1] * 3, [2] * 5, [3] * 2], bj.Topology(attn_dp=2), slots_per_rank=4)
    rows = decode_rows(packed, np.array([7, 8, 9]), np.array([3, 5, 2])).rows
    assert rows.phase is RowsPhase.DECODE
    block = rows.segment_ids.reshape(2, 4)
    for rank in range(2):
        live = block[rank] >= 0
        np.testing.assert_array_equal(block[rank][live], np.arange(4)[live])


def test_prefill_microbatches_keep_equal_sequences_in_windows():
    """Pipeline microbatches of equal sequences are windows again; of unequal ones, not."""
    topology = bj.Topology(attn_dp=2)
    packed = pack_sequences([[s] * 4 for s in range(1, 7)], topology, max_sequence_rows=4)
    for part in split_microbatches(packed, 2, topology):
        rows = part.packed.rows
        assert rows.window_rows == 4
        windows = rows.segment_ids.reshape(-1, 4)
        assert all(len(set(w)) == 1 for w in windows)
        assert (rows.positions.reshape(-1, 4)[windows[:, 0] >= 0] == np.arange(4)).all()
    unequal = pack_sequences([[1] * 4, [2] * 3], topology, max_sequence_rows=4)
    assert all(not p.packed.rows.equal_sequences for p in split_microbatches(unequal, 2, topology))
