"""Which decode graph a step replays (rlx.engine.cuda_graph.graph_size): a captured one of up to
twice its rows before a new capture; and what a step writes into the graphs' pinned input
buffers. Pure bookkeeping: runs on the CPU."""

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
    """`HostRows.fill` by hand: a sampled row whose last token is still on the device (PENDING: its
    input comes from row 2 of the step before), a greedy row with its own seed, and two padded
    rows (token 0 at position 0 of block 0, greedy, no source), over buffers full of stale values."""
    from rlx.engine.host_rows import GREEDY, IDS, POSITIONS, SEEDS, SOURCES, STEPS, HostRows
    from rlx.engine.sequence import PENDING, GenerateRequest, SamplingParams, Sequence

    sampled = Sequence(0, GenerateRequest([5, 6, 7], SamplingParams(temperature=0.5)), 16, seed=11)
    sampled.token_ids += [9, PENDING]
    sampled.block_table = [3, 4]
    greedy = Sequence(
        1, GenerateRequest([1, 2], SamplingParams(temperature=0.0, sampling_seed=99)), 16, seed=12
    )
    greedy.token_ids += [8]
    greedy.block_table = [7]
    host = HostRows(4, 3, pin=False)
    host.ints.fill_(77), host.inv_t.fill_(77.0), host.tables.fill_(77)
    host.fill([sampled, greedy], [2, 0], 4)
    ints, inv_t, tables = host.ints, host.inv_t, host.tables
    assert ints[IDS].tolist() == [0, 8, 0, 0]  # a pending id is read on the device (SOURCES)
    assert ints[POSITIONS].tolist() == [4, 2, 0, 0]
    assert ints[SEEDS].tolist() == [11, 99, 0, 0]
    assert ints[STEPS].tolist() == [2, 1, 0, 0]  # outputs so far, the pending one included
    assert ints[GREEDY].tolist() == [0, 1, 1, 1]
    assert ints[SOURCES].tolist() == [2, -1, -1, -1]
    assert inv_t.tolist() == [2.0, 1.0, 1.0, 1.0]
    assert tables[0, :2].tolist() == [3, 4] and tables[1, 0] == 7 and tables[2:, 0].tolist() == [0, 0]


def test_block_tables_written_where_they_changed_equal_tables_written_whole():
    """A rollout's rows as the engine fills them, two buffer sets taken in turn: tables grow,
    sequences finish (the rows after them shift up, up to two a step), one is preempted and
    readmitted (a new table of the same length), new ones arrive between others, one sits a step
    out and comes back at another row, the graph size pads. Every step, each row of the set just
    filled holds what a fill from scratch writes: each row's whole table, its seed, sampling and
    position."""
    import random

    from rlx.engine.block_manager import BlockManager
    from rlx.engine.host_rows import HostRows
    from rlx.engine.sequence import GenerateRequest, SamplingParams, Sequence

    rng = random.Random(0)
    blocks = BlockManager(num_blocks=400, block_size=4, enable_sharing=False)
    ids = iter(range(1000))

    def arrive() -> Sequence:
        prompt = [rng.randrange(2, 50) for _ in range(rng.randrange(1, 13))]
        sampling = SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0]))
        seq = Sequence(next(ids), GenerateRequest(prompt, sampling), 64, seed=rng.randrange(1 << 20))
        blocks.allocate(seq)
        return seq

    seqs = [arrive() for _ in range(6)]
    sets = [HostRows(16, 32, pin=False), HostRows(16, 32, pin=False)]
    grew = readmitted = moved = 0
    out = None  # a sequence sitting out a step (overlap: its token still being sampled)
    for step in range(90):
        for seq in seqs:
            seq.token_ids.append(rng.randrange(2, 50))
            before = len(seq.block_table)
            blocks.grow_to(seq, seq.num_tokens)
            grew += len(seq.block_table) > before
        if out is not None:  # back, at another row
            seqs.insert(rng.randrange(len(seqs) + 1), out)
            out = None
        for _ in range(rng.choice([0, 0, 1, 2])):  # finished: the rows after them shift up
            if len(seqs) > 2:
                moved += 1
                blocks.release(seqs.pop(rng.randrange(len(seqs) - 1)))
        if step % 5 == 4 and len(seqs) < 12:
            seqs.insert(rng.randrange(len(seqs) + 1), arrive())
        if step % 9 == 2 and len(seqs) > 2:
            out = seqs.pop(rng.randrange(len(seqs)))
        if step == 20:  # preempted, then readmitted: a new list of the same length
            victim = seqs[1]
            table = victim.block_table
            blocks.release(victim)
            blocks.allocate(victim)
            readmitted = victim.block_table is not table and len(victim.block_table) == len(table)
        size = 1 << (len(seqs) - 1).bit_length()
        host = sets[step % 2]
        host.fill(seqs, [-1] * len(seqs), size)
        fresh = HostRows(16, 32, pin=False)
        fresh.ints.fill_(-7), fresh.inv_t.fill_(-7.0), fresh.tables.fill_(-7)
        fresh.fill(seqs, [-1] * len(seqs), size)
        assert host.ints[:, :size].equal(fresh.ints[:, :size]), step
        assert host.inv_t[:size].equal(fresh.inv_t[:size]), step
        for row, seq in enumerate(seqs):
            n = len(seq.block_table)
            assert host.tables[row, :n].tolist() == seq.block_table == fresh.tables[row, :n].tolist(), (
                step,
                row,
            )
        assert (host.tables[len(seqs) : size, 0] == 0).all()
    assert grew > 20 and readmitted and moved > 20
