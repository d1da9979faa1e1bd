"""A scheduled batch's step inputs (rlx.engine.step_inputs), by hand: each token's id, position
and KV slot (block, offset) through its sequence's block table, and the padded query index."""

from __future__ import annotations

import torch

from rlx.engine.scheduler import ScheduledBatch
from rlx.engine.sequence import GenerateRequest, SamplingParams, Sequence
from rlx.engine.step_inputs import build_step_inputs


def sequence(seq_id: int, tokens: list[int], computed: int, table: list[int]) -> Sequence:
    seq = Sequence(seq_id, GenerateRequest(tokens, SamplingParams()), 8, seed=seq_id)
    seq.num_computed, seq.block_table = computed, table
    return seq


def test_tokens_land_in_their_blocks_and_offsets():
    """Blocks of 4 tokens: a decode row (position 5: block 9, offset 1), a fresh prompt of 3
    (block 3), and the second chunk of a prompt (positions 5-8 cross from block 11 into 12)."""
    decode = sequence(0, [20, 21, 22, 23, 24, 25], 5, [7, 9])
    fresh = sequence(1, [30, 31, 32], 0, [3])
    chunk = sequence(2, list(range(40, 52)), 5, [10, 11, 12])
    batch = ScheduledBatch([decode, fresh, chunk], [1, 3, 4], num_decode=1)
    inputs = build_step_inputs(batch, 4, torch.device("cpu"), use_decode_kernel=False)
    assert inputs.input_ids.tolist() == [25, 30, 31, 32, 45, 46, 47, 48]
    assert inputs.positions.tolist() == [5, 0, 1, 2, 5, 6, 7, 8]
    assert inputs.meta.slot_block.tolist() == [9, 3, 3, 3, 11, 11, 11, 12]
    assert inputs.meta.slot_offset.tolist() == [1, 0, 1, 2, 1, 2, 3, 0]
    assert inputs.sample_rows.tolist() == [0, 3]  # the chunk's prompt goes on: no token yet
    # the prefill rows padded to 4 queries each: row 0's 3 at 0-2, row 1's 4 at 4-7
    assert inputs.meta.prefill_q_index.tolist() == [0, 1, 2, 4, 5, 6, 7]
