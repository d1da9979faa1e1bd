"""Padding samples into micro-batches and aligning per-position outputs with response tokens."""

import pytest
import torch

from rlx.algo.policy_gradient import flat_loss_mask
from rlx.flat import pad_2d
from rlx.sample import Sample
from rlx.trainer.batch import make_micro_batch, response_slice, split


def _samples():
    return [
        Sample(prompt="a", prompt_ids=[5, 6], response_ids=[7, 8, 1], loss_mask=[1, 0, 1]),
        Sample(prompt="b", prompt_ids=[9, 10, 11], response_ids=[3]),
    ]


def test_micro_batch_pads_right_and_aligns_extras():
    mb = make_micro_batch(_samples(), {"adv": [[0.5, 0.5, 0.5], [-1.0]]})
    assert mb.tokens_BL.tolist() == [[5, 6, 7, 8, 1], [9, 10, 11, 3, 0]]
    assert mb.position_ids_BL.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert mb.prompt_len_B.tolist() == [2, 3]
    assert mb.response_len_B.tolist() == [3, 1]
    assert mb.mask_BT.tolist() == [[1, 0, 1], [1, 0, 0]]  # empty loss_mask means every token counts
    assert mb.extras["adv"].tolist() == [[0.5, 0.5, 0.5], [-1.0, 0.0, 0.0]]


def test_pad_2d_takes_tensor_rows_of_any_dtype_and_lists_alike():
    tensors = [torch.tensor([0.25, -1.5], dtype=torch.float64), torch.tensor([], dtype=torch.float32),
               torch.tensor([3.0, 4.0, 5.0], dtype=torch.bfloat16)]  # fmt: skip
    assert pad_2d(tensors, 4).tolist() == [[0.25, -1.5, 0, 0], [0, 0, 0, 0], [3.0, 4.0, 5.0, 0]]
    assert pad_2d(tensors, 4).dtype == torch.float32
    assert pad_2d([[7], [], [1, 2, 3]], 3, torch.long).tolist() == [[7, 0, 0], [0, 0, 0], [1, 2, 3]]
    assert pad_2d([], 3).shape == (0, 3)
    with pytest.raises(ValueError, match="a row of 3 values does not fit in width 2"):
        pad_2d([[1], [1, 2, 3]], 2)


def test_flat_loss_mask_puts_every_samples_mask_end_to_end():
    # sample 0 masks its second token; sample 1 has no mask: all its tokens count
    assert flat_loss_mask(_samples()).tolist() == [True, False, True, True]


def test_response_slice_takes_the_position_before_each_response_token():
    mb = make_micro_batch(_samples(), {})
    # values at position p stand for "prediction of token p+1"; encode p as 10*row + p
    values_BL = torch.tensor([[0.0, 1, 2, 3], [10.0, 11, 12, 13]])
    out = response_slice(values_BL, mb)
    # sample 0: prompt_len 2 -> response tokens predicted at positions 1, 2, 3
    # sample 1: prompt_len 3 -> response token 0 predicted at 2; padded columns clamp (masked out)
    assert out.tolist() == [[1.0, 2.0, 3.0], [12.0, 13.0, 13.0]]


def test_split_keeps_order_and_remainder():
    assert split(list(range(5)), 2) == [[0, 1], [2, 3], [4]]


def test_sequence_width_rounds_up_to_the_tensor_parallel_size():
    mb = make_micro_batch(_samples(), {}, pad_multiple=4)
    assert mb.tokens_BL.tolist() == [[5, 6, 7, 8, 1, 0, 0, 0], [9, 10, 11, 3, 0, 0, 0, 0]]
    assert response_slice(torch.arange(8.0).expand(2, 8), mb).tolist() == [[1.0, 2.0, 3.0], [2.0, 3.0, 4.0]]


def test_forward_only_passes_take_their_own_micro_batches():
    """train.logprob_micro_batch_size / logprob_max_tokens_per_micro_batch size the forward-only
    passes; training keeps train.micro_batch_size / max_tokens_per_micro_batch; unset, both alike."""
    from types import SimpleNamespace

    from rlx.trainer.config import TrainConfig
    from rlx.trainer.trainable import Trainable

    # 3, 4 or 5 tokens each
    samples = [Sample(prompt="", prompt_ids=[5] * (1 + i % 3), response_ids=[7, 8]) for i in range(8)]
    group = lambda cfg, forward_only: Trainable.micro_batches(  # noqa: E731
        SimpleNamespace(cfg=cfg), samples, range(8), forward_only=forward_only
    )
    padded = TrainConfig(micro_batch_size=2, logprob_micro_batch_size=5)
    assert group(padded, False) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group(padded, True) == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert group(TrainConfig(micro_batch_size=2), True) == group(padded, False)

    packed = TrainConfig(max_tokens_per_micro_batch=8, logprob_max_tokens_per_micro_batch=40)
    assert all(sum(len(samples[i].prompt_ids) + 2 for i in mb) <= 8 for mb in group(packed, False))
    assert len(group(packed, False)) > 1 and group(packed, True) == [list(range(8))]
    assert group(TrainConfig(max_tokens_per_micro_batch=8), True) == group(packed, False)
