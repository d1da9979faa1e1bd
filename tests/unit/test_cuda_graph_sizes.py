"""Which decode graph a step replays (rlx.engine.cuda_graph.graph_size): a captured one of up to
twice its rows before a new capture. Pure bookkeeping: runs on the CPU."""

from __future__ import annotations

from rlx.engine.cuda_graph import batch_size_ladder, graph_size

LADDER = batch_size_ladder(256)


def test_ladder():
    assert LADDER == [1, 2, 4, 8, *range(16, 257, 16)]


def test_a_shrinking_batch_captures_about_one_size_per_halving():
    """128 sequences finishing one by one: the old rule captured every ladder size from 128 down
    (12 of them); reusing a graph of up to 2x the rows captures 7: 64 rows still replay 128, 63
    capture 64, ..., 2 rows replay 4, 1 captures 1."""
    captured: set[int] = set()
    replayed = []
    for rows in range(128, 0, -1):
        size = graph_size(rows, LADDER, captured)
        assert rows <= size <= 2 * rows
        captured.add(size)
        replayed.append(size)
    assert sorted(captured) == [1, 4, 8, 16, 32, 64, 128]
    by_rows = dict(zip(range(128, 0, -1), replayed, strict=True))
    assert (by_rows[64], by_rows[63], by_rows[2], by_rows[1]) == (128, 64, 4, 1)
    exact: set[int] = set()
    for rows in range(128, 0, -1):
        exact.add(graph_size(rows, LADDER, exact, pad_factor=1.0))
    assert sorted(exact) == [1, 2, 4, 8, *range(16, 129, 16)]


def test_the_smallest_graph_that_holds_the_rows():
    assert graph_size(100, LADDER, {112, 128, 256}) == 112
    assert graph_size(100, LADDER, {128, 256}) == 128
    assert graph_size(100, LADDER, {256}) == 112  # 256 > 2 x 100: capture the ladder's 112
    assert graph_size(100, LADDER, set()) == 112
    assert graph_size(3, LADDER, {8}) == 4  # 8 > 6
    assert graph_size(3, LADDER, {4, 8}) == 4


def test_a_steps_inputs_land_in_the_pinned_buffers_by_row():
    """`DecodeGraphs._fill_host` by hand: a sampled row whose last token is still on the device
    (PENDING: its input comes from row 2 of the step before), a greedy row with its own seed, and
    two padded rows (token 0 at position 0 of block 0, greedy, no source), over buffers full of
    stale values."""
    import numpy as np

    from rlx.engine.cuda_graph import GREEDY, IDS, POSITIONS, SEEDS, SOURCES, STEPS, DecodeGraphs
    from rlx.engine.sequence import PENDING, GenerateRequest, SamplingParams, Sequence

    sampled = Sequence(0, GenerateRequest([5, 6, 7], SamplingParams(temperature=0.5)), 16, seed=11)
    sampled.token_ids += [9, PENDING]
    sampled.block_table = [3, 4]
    greedy = Sequence(
        1, GenerateRequest([1, 2], SamplingParams(temperature=0.0, sampling_seed=99)), 16, seed=12
    )
    greedy.token_ids += [8]
    greedy.block_table = [7]
    ints = np.full((6, 4), 77, np.int64)
    inv_t = np.full(4, 77.0, np.float32)
    tables = np.full((4, 3), 77, np.int32)
    DecodeGraphs._fill_host([sampled, greedy], [2, 0], 4, ints, inv_t, tables)
    assert ints[IDS].tolist() == [0, 8, 0, 0]  # a pending id is read on the device (SOURCES)
    assert ints[POSITIONS].tolist() == [4, 2, 0, 0]
    assert ints[SEEDS].tolist() == [11, 99, 0, 0]
    assert ints[STEPS].tolist() == [2, 1, 0, 0]  # outputs so far, the pending one included
    assert ints[GREEDY].tolist() == [0, 1, 1, 1]
    assert ints[SOURCES].tolist() == [2, -1, -1, -1]
    assert inv_t.tolist() == [2.0, 1.0, 1.0, 1.0]
    assert tables[0, :2].tolist() == [3, 4] and tables[1, 0] == 7 and tables[2:, 0].tolist() == [0, 0]
