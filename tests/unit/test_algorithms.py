"""GSPO, REINFORCE++, REINFORCE++-baseline and the loss options on hand-computed numbers (CPU).
The loss-option tests run PPO's loss too; its GAE and value loss are in test_ppo.py.

Every expected value was worked out by hand (the arithmetic is in the comments) and is written
as a literal; none is recomputed with the code under test. GRPO's own numbers are in
test_grpo.py; the config rules are in tests/config/test_algo_options.py. Over 400 lines: one
hand-worked case per estimator and loss option. Shape legend: B samples, T response tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlx.algo.base import Algorithm
from rlx.algo.config import AlgoConfig
from rlx.algo.grpo import GRPO
from rlx.algo.gspo import GSPO
from rlx.algo.losses import (
    batch_outcome_token_rewards,
    clipped_policy_loss,
    discounted_returns,
    outcome_token_rewards,
    sequence_log_ratio,
    truncated_is_weight,
    whitening_stats,
)
from rlx.algo.policy_gradient import padded_rows, per_sample_sums
from rlx.algo.ppo import PPO
from rlx.algo.reinforce_pp import ReinforcePP
from rlx.algo.reinforce_pp_baseline import ReinforcePPBaseline
from rlx.sample import Sample

ALGORITHMS = [GRPO, GSPO, ReinforcePP, ReinforcePPBaseline, PPO]
LN = math.log


def assert_close(actual: torch.Tensor, expected: list | float, atol: float = 1e-6) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual.detach(), expected_t, rtol=0.0, atol=atol)


def cfg_for(cls: type, **overrides) -> AlgoConfig:
    """The class's config as its conf/algo yaml would give it, plus `overrides`."""
    base = {"loss_agg": "sample_mean"} if cls is GSPO else {}
    return AlgoConfig(_target_=f"{cls.__module__}.{cls.__name__}", **(base | overrides))


def make_samples(groups: list[list[tuple[float, list[int]]]]) -> list[Sample]:
    """groups of (reward, loss_mask); the response length is the mask's length."""
    return [
        Sample(
            prompt="p",
            prompt_ids=[1],
            group=g,
            index=i,
            response_ids=[7] * len(mask),
            loss_mask=mask,
            reward=r,
        )
        for g, group in enumerate(groups)
        for i, (r, mask) in enumerate(group)
    ]


# --- building blocks ------------------------------------------------------------------------


def test_outcome_token_rewards_put_the_reward_on_the_last_loss_token():
    # mask [1, 0, 1, 0]: the last loss token is index 2; KL penalty only on loss tokens
    mask_T = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert_close(outcome_token_rewards(0.5, mask_T, None), [0.0, 0.0, 0.5, 0.0], atol=0.0)
    # penalty 0.5 * kl with kl [0.3, 9, -0.2, 7]: [-0.15, 0, +0.1, 0], plus 0.5 at index 2 -> 0.6
    penalty_T = 0.5 * torch.tensor([0.3, 9.0, -0.2, 7.0], dtype=torch.float64)
    assert_close(outcome_token_rewards(0.5, mask_T, penalty_T), [-0.15, 0.0, 0.6, 0.0])
    # no loss token at all: the reward still arrives, on the last token
    assert_close(outcome_token_rewards(1.0, torch.zeros(3), None), [0.0, 0.0, 1.0], atol=0.0)


def test_batch_outcome_token_rewards_keep_each_response_apart():
    # three responses end to end: one with tool output, an empty one, one with no loss token
    masks = [torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(0), torch.zeros(2)]
    got = batch_outcome_token_rewards([0.5, 3.0, 1.0], masks, None)
    assert [r.tolist() for r in got] == [[0.0, 0.0, 0.5, 0.0], [], [0.0, 1.0]]
    # KL penalties on loss tokens only, each response its own: [-0.15, 0, 0.1 + 0.5, 0], [], [0, 1]
    penalties = [0.5 * torch.tensor([0.3, 9.0, -0.2, 7.0]), torch.zeros(0), torch.tensor([4.0, 4.0])]
    got = batch_outcome_token_rewards([0.5, 3.0, 1.0], masks, penalties)
    assert_close(got[0], [-0.15, 0.0, 0.6, 0.0])
    assert got[1].numel() == 0 and got[2].tolist() == [0.0, 1.0]


def test_per_sample_sums_one_per_tensor_empty_ones_zero():
    values = [torch.tensor([1.0, 2.0]), torch.zeros(0), torch.tensor([-0.5])]
    assert per_sample_sums(values).tolist() == [3.0, 0.0, -0.5]


def test_discounted_returns():
    # gamma 0.5 on [-0.05, -0.1, 1.05]: G2 = 1.05, G1 = -0.1 + 0.5 * 1.05 = 0.425,
    # G0 = -0.05 + 0.5 * 0.425 = 0.1625;  gamma 1: reward-to-go [0.9, 0.95, 1.05]
    rewards_T = torch.tensor([-0.05, -0.1, 1.05], dtype=torch.float64)
    assert_close(discounted_returns(rewards_T, 0.5), [0.1625, 0.425, 1.05])
    assert_close(discounted_returns(rewards_T, 1.0), [0.9, 0.95, 1.05])
    assert_close(discounted_returns(rewards_T, 0.0), [-0.05, -0.1, 1.05])


def test_discounted_returns_over_a_padded_batch():
    # the rewards above as row 0 beside [2] and [0, 1, 0, 0.5], gamma 0.5, rows zero-padded:
    # row 1: [2]; row 2: G3 = 0.5, G2 = 0.25, G1 = 1 + 0.125 = 1.125, G0 = 0.5625
    rows = [[-0.05, -0.1, 1.05], [2.0], [0.0, 1.0, 0.0, 0.5]]
    rows_BT = padded_rows([torch.tensor(r, dtype=torch.float64) for r in rows])
    assert_close(
        discounted_returns(rows_BT, 0.5),
        [[0.1625, 0.425, 1.05, 0.0], [2.0, 0.0, 0.0, 0.0], [0.5625, 1.125, 0.25, 0.5]],
    )


def test_whitening_stats_use_the_population_std():
    # [1, 2, 3, 6]: mean 3, deviations [-2, -1, 0, 3], var (4 + 1 + 0 + 9) / 4 = 3.5,
    # rstd 1 / sqrt(3.5) = 0.5345225 (the unbiased var would be 14 / 3)
    mean, rstd = whitening_stats(torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64))
    assert_close(mean, 3.0)
    assert_close(rstd, 0.5345225)
    # all equal: var 0 is floored at 1e-8, and (x - mean) * rstd is exactly 0
    mean, rstd = whitening_stats(torch.tensor([2.0, 2.0]))
    assert_close((torch.tensor([2.0, 2.0]) - mean) * rstd, [0.0, 0.0], atol=0.0)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # eps 0.2 -> [0.8, 1.2], c = 3; standard loss max(-r A, -clip(r) A), then min(., -c A) where A < 0
    #   r=5,   A=-1:   max(5, 1.2) = 5;     cap 3   -> 3,    dual-clipped, grad 0
    #   r=2,   A=-1:   max(2, 1.2) = 2;     cap 3   -> 2,    live, grad -A r = 2
    #   r=5,   A=+1:   max(-5, -1.2) = -1.2 (clipped; no dual clip for A > 0)
    #   r=0.5, A=-2:   max(1, 1.6) = 1.6    (clipped); cap 6 -> 1.6
    #   r=4,   A=-0.5: max(2, 0.6) = 2;     cap 1.5 -> 1.5,  dual-clipped, grad 0
    old_logp_BT = torch.full((1, 5), -1.0, dtype=torch.float64)
    logp_BT = (
        old_logp_BT + torch.tensor([[5.0, 2.0, 5.0, 0.5, 4.0]], dtype=torch.float64).log()
    ).requires_grad_()
    adv_BT = torch.tensor([[-1.0, -1.0, 1.0, -2.0, -0.5]], dtype=torch.float64)
    loss_BT, clipfrac_BT, dual_BT = clipped_policy_loss(
        logp_BT - old_logp_BT, adv_BT, 0.2, None, eps_clip_c=3.0
    )
    assert_close(loss_BT, [[3.0, 2.0, -1.2, 1.6, 1.5]])
    assert_close(clipfrac_BT, [[0.0, 0.0, 1.0, 1.0, 0.0]], atol=0.0)
    assert_close(dual_BT, [[1.0, 0.0, 0.0, 0.0, 1.0]], atol=0.0)
    loss_BT.sum().backward()
    assert_close(logp_BT.grad, [[0.0, 2.0, 0.0, 0.0, 0.0]])


def test_sequence_log_ratio_is_the_masked_mean_with_token_gradients():
    # sample 0: token log-ratios [0.3, -0.1, 0.1]       -> mean 0.1
    # sample 1: [0.2, (hole) 5.0, -0.6], padding after  -> mean over 2 loss tokens -0.2
    old_logp_BT = torch.full((2, 3), -1.0, dtype=torch.float64)
    diff_BT = torch.tensor([[0.3, -0.1, 0.1], [0.2, 5.0, -0.6]], dtype=torch.float64)
    logp_BT = (old_logp_BT + diff_BT).requires_grad_()
    mask_BT = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]], dtype=torch.float64)
    log_ratio_BT = sequence_log_ratio(logp_BT, old_logp_BT, mask_BT)
    assert_close(log_ratio_BT, [[0.1, 0.1, 0.1], [-0.2, -0.2, -0.2]])
    # GSPO-token: d log s_bt / d logp_bt' = 1 if t == t' else 0
    (log_ratio_BT * torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])).sum().backward()
    assert_close(logp_BT.grad, [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


def test_truncated_is_weight():
    # old - rollout = [0, ln 1.5, ln 3, -ln 2] -> exp = [1, 1.5, 3, 0.5]; min(., 2) = [1, 1.5, 2, 0.5]
    rollout_logp_BT = torch.full((1, 4), -2.0, dtype=torch.float64)
    old_logp_BT = rollout_logp_BT + torch.tensor([[0.0, LN(1.5), LN(3.0), -LN(2.0)]], dtype=torch.float64)
    weight_BT, clipped_BT = truncated_is_weight(old_logp_BT, rollout_logp_BT, 2.0)
    assert_close(weight_BT, [[1.0, 1.5, 2.0, 0.5]])
    assert_close(clipped_BT, [[0.0, 0.0, 1.0, 0.0]], atol=0.0)


def test_is_weight_masked_and_sequence_levels():
    # token ratios [1, 1.5, 3, 0.5] as above; mask mode zeroes the capped token: [1, 1.5, 0, 0.5]
    rollout_logp_BT = torch.full((2, 4), -2.0, dtype=torch.float64)
    log_r = torch.tensor(
        [[0.0, LN(1.5), LN(3.0), -LN(2.0)], [LN(1.2), LN(1.5), 5.0, 5.0]], dtype=torch.float64
    )
    old_logp_BT = rollout_logp_BT + log_r
    mask_BT = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    weight_BT, capped_BT = truncated_is_weight(old_logp_BT, rollout_logp_BT, 2.0, mask_BT, "token", "mask")
    assert_close(weight_BT[0], [1.0, 1.5, 0.0, 0.5])
    # sequence: row 0 product 1 * 1.5 * 3 * 0.5 = 2.25 > 2 -> capped at 2 on every token;
    # row 1 product over its 2 loss tokens 1.2 * 1.5 = 1.8 (the masked 5.0s do not count)
    weight_BT, capped_BT = truncated_is_weight(old_logp_BT, rollout_logp_BT, 2.0, mask_BT, "sequence")
    assert_close(weight_BT, [[2.0] * 4, [1.8] * 4])
    assert_close(capped_BT, [[1.0] * 4, [0.0] * 4], atol=0.0)
    # geometric: row 0 2.25 ** (1/4) = 1.2247...; row 1 1.8 ** (1/2) = 1.3416...; mask mode keeps both
    weight_BT, _ = truncated_is_weight(old_logp_BT, rollout_logp_BT, 2.0, mask_BT, "geometric", "mask")
    assert_close(weight_BT, [[2.25**0.25] * 4, [1.8**0.5] * 4])
    # sequence in mask mode: row 0 (2.25 > 2) leaves the loss entirely
    weight_BT, _ = truncated_is_weight(old_logp_BT, rollout_logp_BT, 2.0, mask_BT, "sequence", "mask")
    assert_close(weight_BT, [[0.0] * 4, [1.8] * 4])


# --- advantages -----------------------------------------------------------------------------


def _reinforce_pp_inputs() -> tuple[list[Sample], dict[str, list[torch.Tensor]]]:
    # s0: 3 tokens, all loss tokens, reward 1.0; s1: 4 tokens, loss mask [1, 0, 1, 0], reward 0.5
    # old - ref (k1 KL): s0 [0.1, 0.2, -0.1]; s1 [0.3, 9.0, -0.2, 7.0] (9 and 7 are masked out)
    samples = make_samples([[(1.0, [1, 1, 1])], [(0.5, [1, 0, 1, 0])]])
    ref = [torch.full((3,), -1.0), torch.full((4,), -1.0)]
    old = [ref[0] + torch.tensor([0.1, 0.2, -0.1]), ref[1] + torch.tensor([0.3, 9.0, -0.2, 7.0])]
    return samples, {"old_logp": old, "ref_logp": ref}


# token rewards, kl coef 0.5: s0 [-0.05, -0.1, 0.05 + 1.0] = [-0.05, -0.1, 1.05]
#                             s1 [-0.15, 0, 0.1 + 0.5, 0]  = [-0.15, 0, 0.6, 0]
# returns, gamma 0.5:         s0 [0.1625, 0.425, 1.05] (test_discounted_returns)
#                             s1 G3 = 0, G2 = 0.6, G1 = 0.3, G0 = -0.15 + 0.15 = 0
RETURNS = [[0.1625, 0.425, 1.05], [0.0, 0.3, 0.6, 0.0]]
# whitened over the 5 loss tokens [0.1625, 0.425, 1.05, 0.0, 0.6]: mean 2.2375 / 5 = 0.4475,
# squared deviations 0.081225 + 0.00050625 + 0.36300625 + 0.20025625 + 0.02325625 = 0.66825,
# var 0.13365, std 0.3655817; (x - 0.4475) / 0.3655817, the masked s1 tokens shifted alike
WHITENED = [[-0.7795794, -0.0615457, 1.6480583], [-1.2240765, -0.4034666, 0.4171434, -1.2240765]]


@pytest.mark.parametrize(("whiten", "expected"), [(False, RETURNS), (True, WHITENED)])
def test_reinforce_pp_discounted_returns_with_kl_in_reward(whiten, expected):
    samples, logprobs = _reinforce_pp_inputs()
    cfg = cfg_for(
        ReinforcePP,
        use_kl_in_reward=True,
        kl_in_reward_coef=0.5,
        kl_in_reward_type="k1",
        gamma=0.5,
        whiten_advantages=whiten,
    )
    algo = ReinforcePP(cfg)
    assert algo.needs_ref
    result = algo.advantages(samples, logprobs)
    advs = result.advantages
    assert [a.dtype for a in advs] == [torch.float32] * 2
    assert result.returns is None  # no critic
    for adv, exp in zip(advs, expected, strict=True):
        assert_close(adv, exp)
    # kl over loss tokens (0.1 + 0.2 - 0.1 + 0.3 - 0.2) / 5 = 0.06;
    # returns per sample: 1 - 0.5 * 0.2 = 0.9 and 0.5 - 0.5 * 0.1 = 0.45, mean 0.675
    assert result.metrics == pytest.approx({"kl_in_reward": 0.06, "return_mean": 0.675})


def test_kl_in_reward_needs_ref_logprobs():
    samples, logprobs = _reinforce_pp_inputs()
    algo = ReinforcePP(cfg_for(ReinforcePP, use_kl_in_reward=True, kl_in_reward_coef=0.5))
    with pytest.raises(KeyError, match="ref_logp"):
        algo.advantages(samples, {"old_logp": logprobs["old_logp"]})


def test_reinforce_pp_baseline_centres_on_the_group_mean_then_whitens_over_the_batch():
    # group 0 rewards [1, 0], lengths [2, 2]: mean 0.5, centred [0.5, -0.5]
    # group 1 rewards [0, 0.6, 0.3], lengths [2, 2, 1]: mean 0.3, centred [-0.3, 0.3, 0]
    # gamma 1, no KL: every token's return is its sample's centred reward; over the 9 tokens
    # [.5, .5, -.5, -.5, -.3, -.3, .3, .3, 0]: mean 0, var (4 * 0.25 + 4 * 0.09) / 9 = 1.36 / 9,
    # std 0.3887301: 0.5 / std = 1.2862394, 0.3 / std = 0.7717436
    samples = make_samples([[(1.0, [1, 1]), (0.0, [1, 1])], [(0.0, [1, 1]), (0.6, [1, 1]), (0.3, [1])]])
    algo = ReinforcePPBaseline(cfg_for(ReinforcePPBaseline, whiten_advantages=True))
    assert not algo.needs_ref
    advs = algo.advantages(samples, {"old_logp": [torch.zeros(s.response_len) for s in samples]}).advantages
    expected = [[1.2862394] * 2, [-1.2862394] * 2, [-0.7717436] * 2, [0.7717436] * 2, [0.0]]
    for adv, exp in zip(advs, expected, strict=True):
        assert_close(adv, exp)
    # without whitening: the centred rewards themselves
    advs = ReinforcePPBaseline(cfg_for(ReinforcePPBaseline)).advantages(samples).advantages
    assert_close(advs[2], [-0.3, -0.3])
    assert_close(advs[4], [0.0])


def test_grpo_with_kl_in_reward_normalises_the_shaped_return():
    # k1 kl (old - ref), coef 0.5: s0 kl [0.2, 0.2] -> return 1 - 0.5 * 0.4 = 0.8
    #                              s1 kl [0.4]      -> return 0 - 0.5 * 0.4 = -0.2
    # one group, mean 0.3, centred [0.5, -0.5] (normalize_std off)
    samples = make_samples([[(1.0, [1, 1]), (0.0, [1])]])
    logprobs = {
        "old_logp": [torch.tensor([0.2, 0.2]), torch.tensor([0.4])],
        "ref_logp": [torch.zeros(2), torch.zeros(1)],
    }
    cfg = cfg_for(GRPO, normalize_std=False, use_kl_in_reward=True, kl_in_reward_coef=0.5)
    advs = GRPO(cfg).advantages(samples, logprobs).advantages
    assert_close(advs[0], [0.5, 0.5])
    assert_close(advs[1], [-0.5])


def test_grpo_with_batch_whitening():
    # Dr. GRPO advantages of rewards [1, 0], lengths [1, 3]: tokens [0.5], [-0.5] * 3;
    # mean -0.25, var (0.75^2 + 3 * 0.25^2) / 4 = 0.1875, std 0.4330127:
    # 0.75 / std = sqrt(3) = 1.7320508, -0.25 / std = -1 / sqrt(3) = -0.5773503
    samples = make_samples([[(1.0, [1]), (0.0, [1, 1, 1])]])
    advs = GRPO(cfg_for(GRPO, normalize_std=False, whiten_advantages=True)).advantages(samples).advantages
    assert_close(advs[0], [1.7320508])
    assert_close(advs[1], [-0.5773503] * 3)


def test_gspo_advantages_are_grpo_advantages():
    samples = make_samples([[(1.0, [1, 1]), (0.0, [1]), (0.0, [1, 1, 1])]])
    # group [1, 0, 0]: centred [2/3, -1/3, -1/3] (normalize_std off)
    advs = GSPO(cfg_for(GSPO, normalize_std=False)).advantages(samples).advantages
    assert_close(advs[0], [0.6666667] * 2)
    assert_close(advs[2], [-0.3333333] * 3)


# --- losses ---------------------------------------------------------------------------------


def test_gspo_loss_clips_whole_sequences():
    # log-ratios as in test_sequence_log_ratio...: s = e^0.1 = 1.1051709 and e^-0.2 = 0.8187308
    # eps 3e-4 / 4e-4 -> [0.9997, 1.0004]; A = +1 and +2
    #   sample 0: s above 1.0004, A > 0 -> clipped, every token -1.0004, mean -1.0004
    #   sample 1: s below 0.9997, A > 0 -> -min(2 s, 2 * 0.9997) = -2 s = -1.6374615, live
    # sample_mean over 2 samples: (-1.0004 - 1.6374615) / 2 = -1.3189308
    # pg_clipfrac (1 + 0) / 2 = 0.5; ppo_kl per token old - logp: s0 mean(-0.3, 0.1, -0.1) = -0.1,
    #   s1 mean(-0.2, 0.6) = 0.2 -> (-0.1 + 0.2) / 2 = 0.05
    # grad: sample 0 none; sample 1 loss tokens -A s / (2 tokens * 2 samples) = -s / 2 = -0.4093654
    old_logp_BT = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp_BT = old_logp_BT + torch.tensor([[0.3, -0.1, 0.1], [0.2, 5.0, -0.6]], dtype=torch.float64)
    mb = {
        "logp": logp_BT.requires_grad_(),
        "old_logp": old_logp_BT,
        "adv": torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], dtype=torch.float64),
        "mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]], dtype=torch.float64),
        "entropy": torch.zeros(2, 3, dtype=torch.float64),
    }
    algo = GSPO(cfg_for(GSPO, eps_clip=3e-4, eps_clip_high=4e-4))
    loss, metrics = algo.loss(mb, num_global_tokens=5, num_global_samples=2)
    assert_close(loss, -1.3189308)
    assert_close(metrics["pg_clipfrac"], 0.5)
    assert_close(metrics["ppo_kl"], 0.05)
    loss.backward()
    assert_close(mb["logp"].grad, [[0.0, 0.0, 0.0], [-0.4093654, 0.0, -0.4093654]])


def _tis_mb() -> dict[str, torch.Tensor]:
    # ratio 1 (logp == old); old - rollout = [0, ln 1.5 | ln 3, -ln 2], weights [1, 1.5 | 2, 0.5];
    # sample 1 has a padding column whose rollout log-prob (-50) would give weight e^48: masked
    old_logp_BT = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    rollout_logp_BT = old_logp_BT - torch.tensor(
        [[0.0, LN(1.5), 0.0], [LN(3.0), -LN(2.0), -50.0]], dtype=torch.float64
    )
    return {
        "logp": old_logp_BT.clone().requires_grad_(),
        "old_logp": old_logp_BT,
        "rollout_logp": rollout_logp_BT,
        "adv": torch.tensor([[1.0, 1.0, 0.0], [1.0, -2.0, 0.0]], dtype=torch.float64),
        "mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64),
        "entropy": torch.zeros(2, 3, dtype=torch.float64),
    }


def test_tis_weights_each_tokens_policy_loss():
    # token losses -A w = [-1, -1.5 | -2, +1]; token_mean over 4: -3.5 / 4 = -0.875
    # tis_weight_mean (1 + 1.5 + 2 + 0.5) / 4 = 1.25; tis_clipfrac 1 / 4; grad -A w / 4
    mb = _tis_mb()
    algo = GRPO(cfg_for(GRPO, use_tis=True, tis_clip=2.0))
    loss, metrics = algo.loss(mb, num_global_tokens=4, num_global_samples=2)
    assert_close(loss, -0.875)
    assert_close(metrics["pg_loss"], -0.875)
    assert_close(metrics["tis_weight_mean"], 1.25)
    assert_close(metrics["tis_clipfrac"], 0.25)
    loss.backward()
    assert_close(mb["logp"].grad, [[-0.25, -0.375, 0.0], [-0.5, 0.25, 0.0]])

    del mb["rollout_logp"]
    with pytest.raises(KeyError, match="rollout_logp"):
        algo.loss(mb, num_global_tokens=4, num_global_samples=2)


def test_dual_clip_metric_in_the_loss():
    # one token r = 5, A = -1, c = 3 -> loss 3 (test_dual_clip_...); pg_clipfrac 0, lower 1
    mb = {
        "logp": torch.tensor([[LN(5.0)]], requires_grad=True),
        "old_logp": torch.zeros(1, 1),
        "adv": torch.tensor([[-1.0]]),
        "mask": torch.ones(1, 1),
        "entropy": torch.zeros(1, 1),
    }
    loss, metrics = GRPO(cfg_for(GRPO, eps_clip_c=3.0)).loss(mb, 1, 1)
    assert_close(loss, 3.0, atol=1e-5)
    assert_close(metrics["pg_clipfrac"], 0.0, atol=0.0)
    assert_close(metrics["pg_clipfrac_lower"], 1.0, atol=0.0)


def test_kl_in_reward_is_watched_but_not_in_the_loss():
    # ratio 1, A = [1, -1] -> pg_loss -(1 - 1) / 2 = 0; k1 kl = logp - ref = [0.5, 0.1] -> 0.3
    logp_BT = torch.tensor([[-1.0, -2.0]])
    mb = {
        "logp": logp_BT.clone().requires_grad_(),
        "old_logp": logp_BT,
        "ref_logp": logp_BT - torch.tensor([[0.5, 0.1]]),
        "adv": torch.tensor([[1.0, -1.0]]),
        "mask": torch.ones(1, 2),
        "entropy": torch.zeros(1, 2),
    }
    algo = ReinforcePP(
        cfg_for(ReinforcePP, use_kl_in_reward=True, kl_in_reward_coef=0.5, kl_in_reward_type="k1")
    )
    loss, metrics = algo.loss(mb, num_global_tokens=2, num_global_samples=1)
    assert_close(loss, 0.0)
    assert_close(metrics["kl"], 0.3)


AGG_CASES = [  # every algorithm with each loss aggregation it accepts
    (cls, agg)
    for cls in ALGORITHMS
    for agg in ("token_mean", "sample_mean")
    if not (cls is GSPO and agg == "token_mean")
]  # GSPO requires sample_mean


AGG_IDS = [f"{c.__name__}-{a}" for c, a in AGG_CASES]


@pytest.mark.parametrize(("cls", "loss_agg"), AGG_CASES, ids=AGG_IDS)
def test_ratio_is_one_at_the_first_micro_step(cls, loss_agg):
    # logp == old_logp == ref_logp: ratio exactly 1, nothing clipped, ppo_kl 0, kl 0, and the loss
    # is minus the mean advantage: token_mean -(2 * 0.5 + 1 * -1.5) / 3 = 0.1666667,
    # sample_mean -(0.5 - 1.5) / 2 = 0.5
    logp_BT = torch.tensor([[-0.5, -1.0], [-0.3, 0.0]])
    mb = {
        "logp": logp_BT.clone().requires_grad_(),
        "old_logp": logp_BT.clone(),
        "ref_logp": logp_BT.clone(),
        "rollout_logp": logp_BT.clone(),
        "adv": torch.tensor([[0.5, 0.5], [-1.5, 0.0]]),
        "mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        "entropy": torch.zeros(2, 2),
    }
    cfg = cfg_for(cls, loss_agg=loss_agg, use_kl_loss=True, kl_loss_coef=0.1, use_tis=True, eps_clip_c=3.0)
    loss, metrics = cls(cfg).loss(mb, num_global_tokens=3, num_global_samples=2)
    assert_close(loss, 0.1666667 if loss_agg == "token_mean" else 0.5)
    for key in ("ppo_kl", "pg_clipfrac", "pg_clipfrac_lower", "kl", "tis_clipfrac"):
        assert_close(metrics[key], 0.0, atol=0.0)
    assert_close(metrics["tis_weight_mean"], 1.0)


@pytest.mark.parametrize(("cls", "loss_agg"), AGG_CASES, ids=AGG_IDS)
def test_micro_batches_sum_to_the_global_batch_with_every_option(cls, loss_agg):
    # the loss, every metric and the gradients (log-probs and entropy) of two micro-batches, each
    # padded only to its own longest response as the trainer pads them, sum to the global batch's;
    # float64: sums in a different order differ by rounding only
    gen = torch.Generator().manual_seed(0)
    lens = [6, 2, 4, 3]
    mask_BT = torch.zeros(4, 6, dtype=torch.float64)
    for b, length in enumerate(lens):
        mask_BT[b, :length] = 1.0
    mask_BT[0, 3] = 0.0

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    old_BT = -rand(4, 6) * 3
    batch = {
        "logp": old_BT + (rand(4, 6) - 0.5) * 0.01,  # a little off-policy, so GSPO's narrow range clips
        "old_logp": old_BT,
        "ref_logp": old_BT - 0.1 * rand(4, 6),
        "rollout_logp": old_BT - (rand(4, 6) - 0.5) * 2,  # some TIS weights above the cap
        "adv": (rand(4, 1) - 0.5).expand(-1, 6) * mask_BT,
        "mask": mask_BT,
        "entropy": rand(4, 6),
    }
    cfg = cfg_for(cls, loss_agg=loss_agg, eps_clip=3e-4, eps_clip_high=4e-4, eps_clip_c=3.0, use_tis=True,
                  tis_clip=1.5, use_kl_loss=True, kl_loss_coef=0.3, entropy_coef=0.01)  # fmt: skip
    algo = cls(cfg)
    num_tokens, num_samples = int(mask_BT.sum()), 4

    def leaf(rows: slice, width: int):
        mb = {k: v[rows, :width].clone() for k, v in batch.items()}
        mb["logp"].requires_grad_()
        mb["entropy"].requires_grad_()
        return mb

    full = leaf(slice(0, 4), 6)
    full_loss, full_metrics = algo.loss(full, num_tokens, num_samples)
    full_loss.backward()
    mb_a, mb_b = leaf(slice(0, 2), 6), leaf(slice(2, 4), 4)
    loss_a, metrics_a = algo.loss(mb_a, num_tokens, num_samples)
    loss_b, metrics_b = algo.loss(mb_b, num_tokens, num_samples)
    (loss_a + loss_b).backward()
    exact = {"rtol": 0.0, "atol": 1e-12}
    torch.testing.assert_close(loss_a + loss_b, full_loss, **exact)
    for key in full_metrics:
        torch.testing.assert_close(metrics_a[key] + metrics_b[key], full_metrics[key], **exact)
    for key in ("logp", "entropy"):
        grad_BT = torch.zeros(4, 6, dtype=torch.float64)
        grad_BT[0:2, :6], grad_BT[2:4, :4] = mb_a[key].grad, mb_b[key].grad
        torch.testing.assert_close(grad_BT, full[key].grad, **exact)
    assert full_metrics["pg_clipfrac"] > 0 and full_metrics["tis_clipfrac"] > 0


# --- construction and config ----------------------------------------------------------------


@pytest.mark.parametrize("cls", ALGORITHMS, ids=lambda c: c.__name__)
def test_every_algorithm_is_an_algorithm(cls):
    algo = cls(cfg_for(cls))
    assert isinstance(algo, Algorithm)
    assert not algo.needs_ref
    assert cls(cfg_for(cls, use_kl_loss=True)).needs_ref
    assert cls(cfg_for(cls, use_kl_in_reward=True)).needs_ref


def test_constructors_reject_what_validate_rejects():
    with pytest.raises(ValueError, match="algo.use_kl_loss.*algo.use_kl_in_reward"):
        GRPO(cfg_for(GRPO, use_kl_loss=True, use_kl_in_reward=True))
    with pytest.raises(ValueError, match="kl_in_reward_type"):
        ReinforcePP(cfg_for(ReinforcePP, kl_in_reward_type="k5"))
    with pytest.raises(ValueError, match="loss_agg"):
        GSPO(cfg_for(GSPO, loss_agg="token_mean"))
