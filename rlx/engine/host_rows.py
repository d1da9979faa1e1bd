"""One set of a decode graph's host inputs: the pinned buffers its copies read, and what each row
holds.

A decode step's rows are the running sequences in the scheduler's order, so a sequence that
finishes moves every row after it up by one. Per row a step needs its last token, position,
output count and source row, which change every step and are written whole; and its seed, its
sampling (greedy, 1/T), its prompt's length and its block table, which are fixed or grow by a block every
`block_size` tokens. Those are written from the Sequence once: a row whose sequence moved since
this set was last filled is copied from its old row in one gather over the moved rows (found by
id), rows that gained a block get it in one scatter, and only new sequences are written from
Python; the per-step columns (ids, positions, outputs, sources) are numpy arithmetic over the
rows' token lists. A rollout whose sequences end at different lengths (an RL batch: EOS) moves
rows every step; rewriting each moved row from its Sequence took 0.78-0.84 ms a step at 512 rows
with one sequence ending a step, against 0.22 with none; this takes 0.39 and 0.20
(`bench/decode_host.py --finish 0,1,4`, CI's kind of CPU).
"""

from __future__ import annotations

from operator import attrgetter, is_, itemgetter

import numpy as np
import torch

from rlx.engine.sampler import inverse_temperature, row_seed
from rlx.engine.sequence import PENDING, Sequence

# rows of the packed int64 inputs; SOURCES: the row of the previous step whose sampled token
# (still on the device) is this row's input, or -1 when the host gives the id
IDS, POSITIONS, SEEDS, STEPS, GREEDY, SOURCES = range(6)
TOKEN_IDS, BLOCK_TABLE, LAST = attrgetter("token_ids"), attrgetter("block_table"), itemgetter(-1)


class HostRows:
    """`ints` [6, max_bs], `inv_t` [max_bs] and `tables` [max_bs, max_blocks] (pinned with `pin`),
    filled by `fill`. What a row's fixed inputs belong to is kept beside them: every row r with
    `seqs[r]` set holds that sequence's seed and sampling and the first `lens[r]` entries of its
    block table `lists[r]` (the Sequence's own list: a preempted sequence readmitted brings a new
    one). `seqs` holds the sequences, so no `id` it is matched by is reused while a row names it."""

    def __init__(self, max_bs: int, max_blocks: int, pin: bool = True):
        self.ints = torch.zeros(6, max_bs, dtype=torch.int64, pin_memory=pin)
        self.inv_t = torch.ones(max_bs, dtype=torch.float32, pin_memory=pin)
        self.tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, pin_memory=pin)
        self._ints, self._inv_t, self._tables = self.ints.numpy(), self.inv_t.numpy(), self.tables.numpy()
        self.seqs: list[Sequence | None] = [None] * max_bs
        self.lists = np.full(max_bs, None, object)
        self.lens = np.zeros(max_bs, np.int64)
        self.prompts = np.zeros(max_bs, np.int64)  # each row's prompt length (its outputs: STEPS)
        self.top = 0  # rows from here on have never held a sequence

    def fill(self, seqs: list[Sequence], sources: list[int], size: int) -> None:
        """The inputs of a decode step of `seqs` (`sources[i]`: the row of the previous step that
        samples row i's input when its token is PENDING), padded to `size` rows: token 0 at
        position 0 of block 0, greedy."""
        ints, rows = self._ints, len(seqs)
        tokens = list(map(TOKEN_IDS, seqs))  # C loops over the rows (a property a row: 70 ns each)
        last = np.fromiter(map(LAST, tokens), np.int64, rows)
        lens = np.fromiter(map(len, tokens), np.int64, rows)
        same = list(map(is_, seqs, self.seqs))
        if False in same:
            self._place(seqs, same.index(False))
        np.maximum(last, 0, out=ints[IDS, :rows])  # a PENDING id is read on the device
        np.subtract(lens, 1, out=ints[POSITIONS, :rows])
        np.subtract(lens, self.prompts[:rows], out=ints[STEPS, :rows])
        ints[SOURCES, :rows] = np.where(last == PENDING, sources, -1)
        self._grow_tables(seqs)
        self.top = max(self.top, rows)
        if size > rows:
            ints[:, rows:size] = 0
            ints[GREEDY, rows:size] = 1
            ints[SOURCES, rows:size] = -1
            self._inv_t[rows:size] = 1.0
            self._tables[rows:size, 0] = 0
            self.seqs[rows:size] = [None] * (size - rows)
            self.lists[rows:size], self.lens[rows:size] = None, 0

    def _place(self, seqs: list[Sequence], first: int) -> None:
        """Rows `first`.. hold other sequences than at this set's last fill: each one this set
        held at some row (found by id, sorted) is copied from there in one gather, the others are
        written from their Sequence."""
        rows, top = len(seqs), max(self.top, first + 1)
        held = np.fromiter(map(id, self.seqs[first:top]), np.uint64, top - first)
        ids = np.fromiter(map(id, seqs[first:]), np.uint64, rows - first)
        order = np.argsort(held)
        ranked = held[order]
        at = np.searchsorted(ranked, ids).clip(max=len(ranked) - 1)
        moved = ranked[at] == ids
        dest = np.arange(first, rows)
        to, frm = dest[moved], order[at[moved]] + first
        # gathers: each right side is read whole before its left side is written; of the tables,
        # the columns that hold entries (a row of a long context's table is thousands)
        width = int(self.lens[frm].max(initial=0))
        self._tables[to, :width] = self._tables[frm, :width]
        self._ints[SEEDS, to] = self._ints[SEEDS, frm]
        self._ints[GREEDY, to] = self._ints[GREEDY, frm]
        self._inv_t[to] = self._inv_t[frm]
        self.prompts[to] = self.prompts[frm]
        self.lists[to], self.lens[to] = self.lists[frm], self.lens[frm]
        self.seqs[first:rows] = seqs[first:]
        for row in dest[~moved].tolist():
            self._write(row, seqs[row])

    def _write(self, row: int, seq: Sequence) -> None:
        """`seq`'s fixed inputs into `row`, from the Sequence; its table whole at the next growth."""
        self._ints[SEEDS, row] = row_seed(seq)
        self._ints[GREEDY, row] = seq.sampling.greedy
        self._inv_t[row] = inverse_temperature(seq.sampling)
        self.prompts[row] = seq.num_prompt
        self.lists[row], self.lens[row] = None, 0  # `_grow_tables` writes the whole table

    def _grow_tables(self, seqs: list[Sequence]) -> None:
        """Write what each row's block table gained since this set held it (all of a new list):
        the rows that gained one block (every `block_size` tokens) in one scatter, others one by one."""
        rows = len(seqs)
        lists = list(map(BLOCK_TABLE, seqs))
        lens = np.fromiter(map(len, lists), np.int64, rows)
        held = self.lens[:rows]  # a view: written below
        for row in np.flatnonzero(~np.fromiter(map(is_, lists, self.lists[:rows]), bool, rows)).tolist():
            self.lists[row], held[row] = lists[row], 0  # another list: all of it
        grew = np.flatnonzero(lens > held)
        if not grew.size:
            return
        one = lens[grew] == held[grew] + 1
        if one.any():
            rows_one = grew[one]
            self._tables[rows_one, held[rows_one]] = [lists[row][-1] for row in rows_one.tolist()]
        for row in grew[~one].tolist():
            table, num = lists[row], int(held[row])
            self._tables[row, num : len(table)] = table[num:]
        held[grew] = lens[grew]


def rows_in(seqs: list[Sequence], behind: list[Sequence]) -> list[int]:
    """Each sequence's row in the decode step `behind`, -1 where it has none (`HostRows.fill`'s
    sources): the same rows (a decode chain's step where none finished) without a dict of ids."""
    if len(seqs) == len(behind) and all(map(is_, seqs, behind)):
        return list(range(len(seqs)))
    rows = {s.seq_id: row for row, s in enumerate(behind)}
    return [rows.get(s.seq_id, -1) for s in seqs]
