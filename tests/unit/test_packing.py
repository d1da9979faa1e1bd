"""Sequence packing: bins under the token budget, packed rows and their masks, and training on
packed micro-batches giving the padded micro-batches' loss and gradients (CPU, fp32, one rank)."""

from __future__ import annotations

import re

import pytest
import torch

from rlx.config.compose import compose, to_object
from rlx.errors import ConfigError
from rlx.ports import free_port
from rlx.sample import Sample
from rlx.trainer.batch import make_micro_batch, make_packed_micro_batch, num_tokens, pack, response_slice


def test_pack_first_fit_decreasing_by_hand():
    # longest first: 7 (index 1) opens bin 0 (room 3); 5 (3) opens bin 1 (room 5);
    # 4 (0) -> bin 1 (room 1); 3 (2) -> bin 0 (room 0); 2 (4) opens bin 2; 1 (5) -> bin 1
    assert pack([4, 7, 3, 5, 2, 1], budget=10) == [[1, 2], [0, 3, 5], [4]]
    assert pack([], budget=10) == []
    assert pack([10, 10], budget=10) == [[0], [1]]


def test_pack_never_exceeds_the_budget_and_places_every_item_once():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        budget = int(torch.randint(8, 64, (1,), generator=g))
        lengths = torch.randint(
            1, budget + 1, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g
        ).tolist()
        bins = pack(lengths, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths))), trial
        assert all(sum(lengths[i] for i in b) <= budget for b in bins), trial
        assert all(b == sorted(b) and b for b in bins), trial
        assert pack(lengths, budget) == bins  # deterministic


def test_pack_names_an_item_over_the_budget():
    with pytest.raises(ValueError, match="item 1 has 11 tokens, more than the budget of 10"):
        pack([3, 11], budget=10)


def _samples():
    return [
        Sample(prompt="a", prompt_ids=[5, 6], response_ids=[7, 8, 1], loss_mask=[1, 0, 1]),
        Sample(prompt="b", prompt_ids=[9, 10, 11], response_ids=[3]),
    ]


def test_packed_row_positions_and_block_diagonal_mask():
    mb = make_packed_micro_batch(_samples(), {"adv": [[0.5, 0.5, 0.5], [-1.0]]}, pad_multiple=4)
    assert mb.tokens_BL.tolist() == [[5, 6, 7, 8, 1, 9, 10, 11, 3, 0, 0, 0]]  # 9 tokens padded to 12
    assert mb.position_ids_BL.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0]]
    assert mb.row_B.tolist() == [0, 0] and mb.start_B.tolist() == [0, 5]
    # per-sample tensors as in the padded micro-batch
    assert mb.mask_BT.tolist() == [[1, 0, 1], [1, 0, 0]]
    assert mb.extras["adv"].tolist() == [[0.5, 0.5, 0.5], [-1.0, 0.0, 0.0]]
    allowed = (~mb.attention_mask_B1LL[0, 0]).int()
    segment = [0] * 5 + [1] * 4 + [2] * 3  # the padding is a segment of its own
    expected = [[int(k <= q and segment[k] == segment[q]) for k in range(12)] for q in range(12)]
    assert allowed.tolist() == expected


def test_a_row_of_one_sample_needs_no_mask():
    (sample, _) = _samples()
    mb = make_packed_micro_batch([sample], {"adv": [[0.5, 0.5, 0.5]]}, pad_multiple=4)
    assert mb.tokens_BL.tolist() == [[5, 6, 7, 8, 1, 0, 0, 0]]  # 5 tokens padded to 8
    assert mb.position_ids_BL.tolist() == [[0, 1, 2, 3, 4, 0, 0, 0]]
    assert mb.attention_mask_B1LL is None  # causal: the padding comes after every real token
    assert mb.row_B.tolist() == [0] and mb.start_B.tolist() == [0]


def test_response_slice_of_a_packed_row():
    mb = make_packed_micro_batch(_samples(), {})
    values_BL = torch.arange(8.0).unsqueeze(0)  # position p of the 9-token row (L - 1 = 8 outputs)
    # sample 0: response predicted at 1, 2, 3; sample 1 starts at 5 with prompt 3: its one
    # response token at 5 + 3 - 1 = 7, its padded columns clamped to the row's end
    assert response_slice(values_BL, mb).tolist() == [[1.0, 2.0, 3.0], [7.0, 7.0, 7.0]]
    padded = make_micro_batch(_samples(), {})
    assert padded.row_B is None and padded.attention_mask_B1LL is None


def _batch(num_samples: int = 16) -> list[Sample]:
    """Long-tail lengths: mostly short responses, a few long ones."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(num_samples):
        prompt_len = int(torch.randint(3, 7, (1,), generator=g))
        response_len = 20 if i % 5 == 0 else int(torch.randint(1, 5, (1,), generator=g))
        samples.append(Sample(prompt="", prompt_ids=torch.randint(2, 12, (prompt_len,), generator=g).tolist(),
                              response_ids=torch.randint(2, 16, (response_len,), generator=g).tolist(),
                              reward=float(torch.rand(1, generator=g) > 0.5), group=i // 8, index=i % 8))  # fmt: skip
    return samples


def _train_on_one_rank(tmp_path, *overrides):
    """One optimizer step on one in-process rank: (metrics, every parameter's gradient, its
    micro-batch widths)."""
    from rlx.trainer.megatron import MegatronTrainer

    cfg = to_object(compose([f"run.output_dir={tmp_path}", "rollout.batch_size=2", "rollout.n_samples_per_prompt=8",
                             "train.micro_batch_size=4", "data.max_prompt_len=8", "rollout.max_response_len=20",
                             *overrides]))  # fmt: skip
    trainer = MegatronTrainer(cfg.model, cfg.algo, cfg.train, cfg.cluster, rank=0, world_size=1,
                              master_addr="127.0.0.1", master_port=free_port(), seed=0, total_steps=1)  # fmt: skip
    try:
        samples = _batch()
        widths = [trainer.policy.make_micro_batch([samples[i] for i in mb], {}).tokens_BL.shape
                  for mb in trainer.policy.micro_batches(samples, range(len(samples)))]  # fmt: skip
        metrics = trainer.train(samples)
        grads = {name: p.main_grad.clone() for name, p in trainer.model.module.named_parameters()}
    finally:
        trainer.shutdown()
    return metrics, grads, widths


def test_packed_training_gives_the_padded_loss_and_gradients(tmp_path):
    padded, padded_grads, padded_widths = _train_on_one_rank(tmp_path)
    packed, packed_grads, packed_widths = _train_on_one_rank(tmp_path, "train.max_tokens_per_micro_batch=40")
    lengths = [23, 6, 8, 8, 9, 23, 9, 6, 6, 6, 24, 7, 7, 8, 9, 25]  # prompt + response of _batch()
    assert [num_tokens(s) for s in _batch()] == lengths
    # padded: 4 samples per micro-batch, each as wide as its longest: 4 x (23 + 23 + 24 + 25) = 380
    assert [tuple(w) for w in padded_widths] == [(4, 23), (4, 23), (4, 24), (4, 25)]
    # packed, first-fit decreasing under 40: {25, 9, 6}, {24, 9, 7}, {23, 9, 8}, {23, 8, 8},
    # {7, 6, 6, 6}: the 184 real tokens and no padding
    assert [tuple(w) for w in packed_widths] == [(1, 40), (1, 40), (1, 40), (1, 39), (1, 25)]
    # Tolerance: the same fp32 sums in another order, and RoPE at shifted positions (a packed
    # sample starts mid-row; attention depends on position differences only): 1e-5 relative.
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-7), key
    assert padded["train/grad_norm"] > 0
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_rows_of_one_sample_without_a_mask_give_the_padded_loss_and_gradients(tmp_path):
    """Under a budget of 28 the four longest samples (23-25 tokens) fill a row each, without a mask
    (`make_packed_micro_batch`); the short ones share rows with one: the padded step's loss and gradients."""
    padded, padded_grads, _ = _train_on_one_rank(tmp_path)
    packed, packed_grads, packed_widths = _train_on_one_rank(tmp_path, "train.max_tokens_per_micro_batch=28")
    assert sum(w == (1, 23) or w == (1, 24) or w == (1, 25) for w in map(tuple, packed_widths)) >= 4
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-7), key
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_sample_over_the_budget_is_named(tmp_path):
    # the rules allow prompts of 8 + responses of 12 = 20 tokens; a sample longer than any rollout
    # makes (multi-turn, say) is named with the setting that would hold it
    message = (
        "train.max_tokens_per_micro_batch=20: sample 15 of the batch (group 1, index 7) has 25 tokens "
        "(5 prompt + 20 response) and fits in no micro-batch; set train.max_tokens_per_micro_batch >= 25"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        _train_on_one_rank(tmp_path, "train.max_tokens_per_micro_batch=20", "rollout.max_response_len=12")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.max_prompt_len=8", "rollout.max_response_len=20", "train.max_tokens_per_micro_batch=27"],
            "train.max_tokens_per_micro_batch=27 is less than the longest sample, data.max_prompt_len=8 + "
            "rollout.max_response_len=20 = 28 tokens (packing never splits a sample); "
            "set train.max_tokens_per_micro_batch=28 or more",
        ),
        (
            ["train.max_tokens_per_micro_batch=32"],  # tiny models: a context of 64
            "train.max_tokens_per_micro_batch=32 is less than the longest sample, "
            "model.max_position_embeddings=64 - 1",
        ),
        (
            [
                "train.max_tokens_per_micro_batch=63",
                "cluster.num_trainer_procs=2",
                "rollout.batch_size=3",
                "rollout.n_samples_per_prompt=3",
            ],  # fmt: skip
            "train.global_batch_size=9 is not divisible by the data-parallel size 2",
        ),
        (
            [
                "data.max_prompt_len=8",
                "rollout.max_response_len=20",
                "train.max_tokens_per_micro_batch=28",
                "train.logprob_max_tokens_per_micro_batch=20",
            ],  # fmt: skip
            "train.logprob_max_tokens_per_micro_batch=20 is less than the longest sample, data.max_prompt_len=8 + "
            "rollout.max_response_len=20 = 28 tokens (packing never splits a sample); "
            "set train.logprob_max_tokens_per_micro_batch=28 or more",
        ),
        (
            ["train.logprob_max_tokens_per_micro_batch=256"],
            "train.logprob_max_tokens_per_micro_batch=256 is the token budget of packed forward-only "
            "micro-batches, but packing is off (train.max_tokens_per_micro_batch=null); "
            "set train.logprob_micro_batch_size=N instead",
        ),
    ],
)
def test_packing_rules_at_compose(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose(overrides)


def test_packing_lifts_the_micro_batch_rule():
    # 12 samples over 2 DP ranks: 6 each, which micro_batch_size=4 would not divide
    cfg = to_object(compose(["train.max_tokens_per_micro_batch=63", "cluster.num_trainer_procs=2",
                             "rollout.batch_size=3", "rollout.n_samples_per_prompt=4", "train.micro_batch_size=4"]))  # fmt: skip
    assert cfg.train.max_tokens_per_micro_batch == 63
