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
