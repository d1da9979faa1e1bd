"""Context parallelism's load-balanced sequence split and its inverse (CPU, no process group):
the positions each CP rank holds, by hand, and gathered shards back in sequence order."""

from __future__ import annotations

import pytest
import torch

from rlx.models.attention import load_balanced_positions, to_sequence_order
from rlx.sample import Sample
from rlx.trainer.batch import make_micro_batch, make_packed_micro_batch, pad_multiple


@pytest.mark.parametrize(
    "seq_len, cp_size, expected",
    [
        # 8 positions, CP=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
        (8, 2, [[0, 1, 6, 7], [2, 3, 4, 5]]),
        # 12 positions, CP=3: chunks of 2; rank r holds chunks r and 5 - r
        (12, 3, [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]),
        # 4 positions, CP=2: chunks of one token
        (4, 2, [[0, 3], [1, 2]]),
        # CP=1 holds everything, in order
        (6, 1, [[0, 1, 2, 3, 4, 5]]),
    ],
)
def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r(seq_len, cp_size, expected):
    got = [load_balanced_positions(seq_len, cp_size, rank).tolist() for rank in range(cp_size)]
    assert got == expected


def test_a_length_that_does_not_split_into_2cp_chunks_is_refused():
    with pytest.raises(AssertionError):
        load_balanced_positions(10, 3, 0)  # 10 tokens do not make 6 equal chunks


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_shards_gathered_in_rank_order_come_back_in_sequence_order(cp_size):
    seq_len = 4 * cp_size
    values_L = torch.arange(100, 100 + seq_len)
    gathered = torch.cat([values_L[load_balanced_positions(seq_len, cp_size, r)] for r in range(cp_size)])
    assert to_sequence_order(gathered, cp_size).tolist() == values_L.tolist()
    # along another dimension, rows [B, L] gathered on L, with a trailing one
    rows_BL1 = torch.stack([values_L, -values_L]).unsqueeze(-1)
    shards = [rows_BL1[:, load_balanced_positions(seq_len, cp_size, r)] for r in range(cp_size)]
    assert torch.equal(to_sequence_order(torch.cat(shards, dim=1), cp_size, dim=1), rows_BL1)


def test_hand_computed_reorder_for_cp2():
    # rank 0 sent positions [0, 1, 6, 7], rank 1 [2, 3, 4, 5]
    gathered = torch.tensor([0, 1, 6, 7, 2, 3, 4, 5])
    assert to_sequence_order(gathered, 2).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("tp, cp, multiple", [(1, 1, 1), (2, 1, 2), (1, 2, 4), (2, 2, 8), (1, 3, 6)])
def test_micro_batches_pad_to_2cp_chunks_of_whole_tp_shards(tp, cp, multiple):
    assert pad_multiple(tp, cp) == multiple


def test_padded_and_packed_micro_batches_split_into_chunks():
    samples = [Sample(prompt="", prompt_ids=[2, 3, 4], response_ids=[5, 6]),
               Sample(prompt="", prompt_ids=[7, 8], response_ids=[9, 10, 11, 12])]  # fmt: skip
    padded = make_micro_batch(samples, {}, pad_multiple(1, 2))
    assert padded.tokens_BL.shape == (2, 8)  # 6 tokens -> 8: four chunks of 2
    packed = make_packed_micro_batch(samples, {}, pad_multiple(1, 2))
    assert packed.tokens_BL.shape == (1, 12)  # 5 + 6 tokens -> 12: four chunks of 3
    assert packed.attention_mask_B1LL.shape == (1, 1, 12, 12)
