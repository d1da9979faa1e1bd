"""GRPO and its loss building blocks on hand-computed numbers (CPU).

Every expected value below was worked out by hand (the arithmetic is in the comments) and is
written as a literal; none is recomputed with the code under test.
Shape legend: B samples, T response tokens, G groups, N samples per group.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlx.algo.base import Algorithm
from rlx.algo.config import AlgoConfig
from rlx.algo.grpo import GRPO
from rlx.algo.losses import aggregate, clipped_policy_loss, group_normalized_advantages, kl_estimate
from rlx.sample import Sample

LN2 = math.log(2.0)


def assert_close(actual: torch.Tensor, expected: list | float, atol: float = 1e-6) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual.detach(), expected_t, rtol=0.0, atol=atol)


# --- advantages ---------------------------------------------------------------------------

# group 0 rewards [1, 0, 0]: mean 1/3, centred [2/3, -1/3, -1/3],
#   unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3, std 1/sqrt(3) = 0.5773503,
#   normalised [2/sqrt(3), -1/sqrt(3), -1/sqrt(3)] = [1.1547005, -0.5773503, -0.5773503]
# group 1 rewards [3, 1, 2]: mean 2, centred [1, -1, 0], unbiased var (1 + 1 + 0) / 2 = 1, std 1
#   (the population std would be sqrt(2/3) and give [1.2247449, -1.2247449, 0])
REWARDS_GN = [[1.0, 0.0, 0.0], [3.0, 1.0, 2.0]]


def test_advantages_with_std_normalisation_use_unbiased_std():
    adv_GN = group_normalized_advantages(torch.tensor(REWARDS_GN), normalize_std=True, eps=0.0)
    assert_close(adv_GN, [[1.1547005, -0.5773503, -0.5773503], [1.0, -1.0, 0.0]])


def test_advantages_without_std_are_mean_centred():
    adv_GN = group_normalized_advantages(torch.tensor(REWARDS_GN), normalize_std=False)
    assert_close(adv_GN, [[0.6666667, -0.3333333, -0.3333333], [1.0, -1.0, 0.0]])


@pytest.mark.parametrize("normalize_std", [True, False])
def test_identical_rewards_give_zero_advantages_not_nan(normalize_std):
    # centred rewards are exactly 0 and std is 0: 0 / (0 + eps) = 0
    rewards_GN = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.0, 1.0]])
    adv_GN = group_normalized_advantages(rewards_GN, normalize_std=normalize_std)
    assert torch.isfinite(adv_GN).all()
    assert_close(adv_GN[0], [0.0, 0.0, 0.0], atol=0.0)


def test_group_of_one_sample_gives_zero_advantage():
    adv_GN = group_normalized_advantages(torch.tensor([[1.0], [0.0]]), normalize_std=True)
    assert_close(adv_GN, [[0.0], [0.0]], atol=0.0)


def _samples(rewards: list[list[float | None]], response_lens: list[list[int]]) -> list[Sample]:
    return [
        Sample(prompt="p", prompt_ids=[1], group=g, index=i, response_ids=[7] * length, reward=reward)
        for g, (group_rewards, group_lens) in enumerate(zip(rewards, response_lens, strict=True))
        for i, (reward, length) in enumerate(zip(group_rewards, group_lens, strict=True))
    ]


def test_grpo_advantages_broadcast_over_response_tokens():
    samples = _samples(REWARDS_GN, [[2, 3, 1], [1, 2, 2]])
    advs = GRPO(AlgoConfig(normalize_std=True)).advantages(samples).advantages
    # default eps = 1e-6 is added to the std: (2/3) / (0.5773503 + 1e-6) = 1.1546985,
    # (-1/3) / 0.5773513 = -0.5773493, and 1 / (1 + 1e-6) = 0.999999
    expected = [
        [1.1546985] * 2,
        [-0.5773493] * 3,
        [-0.5773493],
        [0.999999],
        [-0.999999] * 2,
        [0.0] * 2,
    ]
    assert [a.shape[0] for a in advs] == [2, 3, 1, 1, 2, 2]
    for adv, exp in zip(advs, expected, strict=True):
        assert adv.dtype == torch.float32
        assert_close(adv, exp)

    advs = GRPO(AlgoConfig(normalize_std=False)).advantages(samples).advantages
    assert_close(advs[0], [0.6666667] * 2)
    assert_close(advs[4], [-1.0] * 2)


def test_grpo_advantages_reject_missing_reward_and_split_groups():
    algo = GRPO(AlgoConfig())
    with pytest.raises(ValueError, match=r"group=1, index=2"):
        algo.advantages(_samples([[1.0, 0.0], [1.0, 0.0, None]], [[1, 1], [1, 1, 1]]))
    samples = _samples(REWARDS_GN, [[1] * 3, [1] * 3])
    with pytest.raises(ValueError, match="not contiguous"):
        algo.advantages([samples[0], samples[3], samples[1]])


# --- clipped policy loss ------------------------------------------------------------------

# ratio r, advantage A, eps_clip 0.2, eps_clip_high 0.28 -> clip range [0.8, 1.28]
#   r=1.1,  A=+2: inside               -min(2.2, 2.2)      = -2.2,  not clipped, grad -r*A = -2.2
#   r=1.5,  A=+1: above 1.28, A > 0    -min(1.5, 1.28)     = -1.28, clipped,     grad 0
#   r=0.5,  A=-1: below 0.8,  A < 0    -min(-0.5, -0.8)    = 0.8,   clipped,     grad 0
#   r=1.5,  A=-1: above, A < 0         -min(-1.5, -1.28)   = 1.5,   not clipped, grad 1.5
#   r=0.5,  A=+1: below, A > 0         -min(0.5, 0.8)      = -0.5,  not clipped, grad -0.5
#   r=1.25, A=+1: in (1.2, 1.28]       -min(1.25, 1.25)    = -1.25, not clipped, grad -1.25
# approx_kl = old_logp - logp = -ln r
RATIOS = [1.1, 1.5, 0.5, 1.5, 0.5, 1.25]
ADVS = [2.0, 1.0, -1.0, -1.0, 1.0, 1.0]


def _policy_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old_logp_BT = torch.full((1, 6), -1.0, dtype=torch.float64)
    logp_BT = (old_logp_BT + torch.tensor([RATIOS], dtype=torch.float64).log()).requires_grad_()
    return logp_BT, old_logp_BT, torch.tensor([ADVS], dtype=torch.float64)


def test_clipped_loss_clip_higher():
    logp_BT, old_logp_BT, adv_BT = _policy_inputs()
    loss_BT, clipfrac_BT, dual_clipfrac_BT = clipped_policy_loss(logp_BT - old_logp_BT, adv_BT, 0.2, 0.28)
    assert_close(loss_BT, [[-2.2, -1.28, 0.8, 1.5, -0.5, -1.25]])
    assert_close(clipfrac_BT, [[0.0, 1.0, 1.0, 0.0, 0.0, 0.0]], atol=0.0)
    assert_close(dual_clipfrac_BT, [[0.0] * 6], atol=0.0)  # dual clip is off
    assert not clipfrac_BT.requires_grad and not dual_clipfrac_BT.requires_grad
    loss_BT.sum().backward()
    assert_close(logp_BT.grad, [[-2.2, 0.0, 0.0, 1.5, -0.5, -1.25]])


def test_clipped_loss_symmetric_when_eps_clip_high_is_none():
    # same inputs, range [0.8, 1.2]: only r=1.25, A=+1 changes -> -min(1.25, 1.2) = -1.2, clipped
    logp_BT, old_logp_BT, adv_BT = _policy_inputs()
    loss_BT, clipfrac_BT, _ = clipped_policy_loss(logp_BT - old_logp_BT, adv_BT, 0.2, None)
    assert_close(loss_BT, [[-2.2, -1.2, 0.8, 1.5, -0.5, -1.2]])
    assert_close(clipfrac_BT, [[0.0, 1.0, 1.0, 0.0, 0.0, 1.0]], atol=0.0)


# --- KL estimators ------------------------------------------------------------------------


# logp - ref = [0, ln2, -1, -3, 5], i.e. d = ref - logp = [0, -ln2, 1, 3, -5]
#   k1 = logp - ref
#   k2 = 0.5 * (logp - ref)^2          = [0, 0.5 * 0.4804530, 0.5, 4.5, 12.5]
#   k3 = exp(d) - d - 1                 = [0, 0.5 + ln2 - 1, e - 2, e^3 - 4, e^-5 + 4]
#                                       = [0, 0.1931472, 0.7182818, 16.0855369, 4.0067379]
#   low_var_kl = k3 clamped to [-10, 10] = [0, 0.1931472, 0.7182818, 10, 4.0067379]
@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", [0.0, 0.6931472, -1.0, -3.0, 5.0]),
        ("k2", [0.0, 0.2402265, 0.5, 4.5, 12.5]),
        ("k3", [0.0, 0.1931472, 0.7182818, 16.0855369, 4.0067379]),
        ("low_var_kl", [0.0, 0.1931472, 0.7182818, 10.0, 4.0067379]),
    ],
)
def test_kl_estimators(kind, expected):
    ref_logp_BT = torch.full((1, 5), -2.0, dtype=torch.float64)
    logp_BT = ref_logp_BT + torch.tensor([[0.0, LN2, -1.0, -3.0, 5.0]], dtype=torch.float64)
    assert_close(kl_estimate(logp_BT, ref_logp_BT, kind), [expected])


def test_low_var_kl_stays_finite_where_k3_overflows():
    # d = 100: exp(100) is inf in float32; low_var_kl is 10 and its gradient 0, not NaN
    logp_BT = torch.tensor([[-100.0]], requires_grad=True)
    ref_logp_BT = torch.tensor([[0.0]])
    assert torch.isinf(kl_estimate(logp_BT, ref_logp_BT, "k3")).all()
    kl_BT = kl_estimate(logp_BT, ref_logp_BT, "low_var_kl")
    kl_BT.sum().backward()
    assert_close(kl_BT, [[10.0]], atol=0.0)
    assert_close(logp_BT.grad, [[0.0]], atol=0.0)


def test_unknown_kl_kind_is_rejected():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# --- aggregation --------------------------------------------------------------------------

# masked values: sample 0 -> 1, 3, 5 (3 tokens; the 50 is a masked hole, e.g. tool output)
#                sample 1 -> 4, 8   (2 tokens; then padding)
# token_mean  = (1 + 3 + 5 + 4 + 8) / 5 = 21 / 5 = 4.2
# sample_mean = (9 / 3 + 12 / 2) / 2 = (3 + 6) / 2 = 4.5
VALUES_BT = [[1.0, 50.0, 3.0, 5.0], [4.0, 8.0, 100.0, float("inf")]]
MASK_BT = [[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]


def test_token_mean_vs_sample_mean():
    values_BT, mask_BT = torch.tensor(VALUES_BT), torch.tensor(MASK_BT)
    assert_close(aggregate(values_BT, mask_BT, "token_mean", 5, 2), 4.2)
    assert_close(aggregate(values_BT, mask_BT, "sample_mean", 5, 2), 4.5)


def test_aggregate_divides_by_global_counts():
    # as one micro-batch of a global batch with 10 tokens / 4 samples: 21 / 10, 9 / 4
    values_BT, mask_BT = torch.tensor(VALUES_BT), torch.tensor(MASK_BT)
    assert_close(aggregate(values_BT, mask_BT, "token_mean", 10, 4), 2.1)
    assert_close(aggregate(values_BT, mask_BT, "sample_mean", 10, 4), 2.25)


def test_seq_mean_token_sum_norm_divides_each_sum_by_one_constant():
    # Dr. GRPO: (9 / 8 + 12 / 8) / 2 = (1.125 + 1.5) / 2 = 1.3125 with norm_len 8 (the max response
    # length), whatever each sample's own length; over a global batch of 4 samples: 2.625 / 4 = 0.65625
    values_BT, mask_BT = torch.tensor(VALUES_BT), torch.tensor(MASK_BT)
    assert_close(aggregate(values_BT, mask_BT, "seq_mean_token_sum_norm", 5, 2, norm_len=8), 1.3125)
    assert_close(aggregate(values_BT, mask_BT, "seq_mean_token_sum_norm", 10, 4, norm_len=8), 0.65625)
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(values_BT, mask_BT, "seq_mean_token_sum_norm", 5, 2)


def test_sample_with_no_loss_tokens_contributes_zero_but_counts():
    values_BT = torch.tensor([*VALUES_BT, [7.0, 7.0, 7.0, 7.0]])
    mask_BT = torch.tensor([*MASK_BT, [0.0, 0.0, 0.0, 0.0]])
    assert_close(aggregate(values_BT, mask_BT, "sample_mean", 5, 3), 3.0)  # (3 + 6 + 0) / 3


# --- GRPO.loss ----------------------------------------------------------------------------


def _ratio_one_mb() -> dict[str, torch.Tensor]:
    logp_BT = torch.tensor([[-0.5, -1.0, -2.0, 0.0], [-0.3, -0.7, 0.0, 0.0]], dtype=torch.float64)
    return {
        "logp": logp_BT.clone().requires_grad_(),
        "old_logp": logp_BT.clone(),
        "adv": torch.tensor([[0.5, 0.5, 0.5, 0.0], [-1.5, -1.5, 0.0, 0.0]], dtype=torch.float64),
        "mask": torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64),
        "entropy": torch.zeros(2, 4, dtype=torch.float64),
    }


@pytest.mark.parametrize(
    ("loss_agg", "expected_loss", "expected_grad"),
    [
        # -(3 * 0.5 + 2 * -1.5) / 5 = 0.3; d/dlogp = -A / 5 = -0.1 and 0.3
        ("token_mean", 0.3, [[-0.1, -0.1, -0.1, 0.0], [0.3, 0.3, 0.0, 0.0]]),
        # -(0.5 + -1.5) / 2 = 0.5; d/dlogp = -A / (len * 2) = -0.5 / 6 and 1.5 / 4
        ("sample_mean", 0.5, [[-0.0833333] * 3 + [0.0], [0.375, 0.375, 0.0, 0.0]]),
        # Dr. GRPO, loss_norm_len 4: -(3 * 0.5 / 4 + 2 * -1.5 / 4) / 2 = 0.1875;
        # d/dlogp = -A / (4 * 2) = -0.0625 and 0.1875, the same divisor for both samples
        ("seq_mean_token_sum_norm", 0.1875, [[-0.0625] * 3 + [0.0], [0.1875, 0.1875, 0.0, 0.0]]),
    ],
)
def test_loss_at_ratio_one_is_minus_mean_advantage(loss_agg, expected_loss, expected_grad):
    mb = _ratio_one_mb()
    algo = GRPO(AlgoConfig(loss_agg=loss_agg, loss_norm_len=4))
    loss, metrics = algo.loss(mb, num_global_tokens=5, num_global_samples=2)
    assert_close(loss, expected_loss)
    assert_close(metrics["pg_loss"], expected_loss)
    assert_close(metrics["ppo_kl"], 0.0, atol=0.0)
    assert_close(metrics["pg_clipfrac"], 0.0, atol=0.0)
    assert "kl" not in metrics
    loss.backward()
    assert_close(mb["logp"].grad, expected_grad)


def test_loss_with_kl_and_entropy_terms():
    # eps 0.2 both sides, token_mean over 3 tokens, low_var_kl, kl coef 0.5, entropy coef 0.01
    #   token (0,0): r=1.5, A=+1 -> clipped, -1.2;  kl d=0 -> 0;                ppo_kl -ln1.5
    #   token (0,1): r=1,   A=+1 -> -1;             kl d=-1 -> e^-1 + 1 - 1 = 0.3678794
    #   token (1,0): r=1,   A=-2 -> 2;              kl 0
    # pg_loss = (-1.2 - 1 + 2) / 3 = -0.0666667; clipfrac 1/3; ppo_kl -0.4054651 / 3 = -0.1351550
    # kl = 0.3678794 / 3 = 0.1226265; entropy (0.9 + 0.6 + 1.5) / 3 = 1.0
    # loss = -0.0666667 + 0.5 * 0.1226265 - 0.01 * 1.0 = -0.0153534
    mb = {
        "logp": torch.tensor([[math.log(1.5), 0.0], [0.0, 0.0]], requires_grad=True),
        "old_logp": torch.zeros(2, 2),
        "ref_logp": torch.tensor([[math.log(1.5), -1.0], [0.0, 0.0]]),
        "adv": torch.tensor([[1.0, 1.0], [-2.0, 0.0]]),
        "mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        "entropy": torch.tensor([[0.9, 0.6], [1.5, 99.0]]),
    }
    cfg = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="low_var_kl", entropy_coef=0.01)
    algo = GRPO(cfg)
    assert algo.needs_ref
    loss, metrics = algo.loss(mb, num_global_tokens=3, num_global_samples=2)
    assert_close(loss, -0.0153534)
    assert_close(metrics["loss"], -0.0153534)
    assert_close(metrics["pg_loss"], -0.0666667)
    assert_close(metrics["pg_clipfrac"], 0.3333333)
    assert_close(metrics["ppo_kl"], -0.1351550)
    assert_close(metrics["kl"], 0.1226265)
    assert_close(metrics["entropy"], 1.0)
    assert all(not m.requires_grad and m.dim() == 0 for m in metrics.values())

    del mb["ref_logp"]
    with pytest.raises(KeyError, match="ref_logp"):
        algo.loss(mb, num_global_tokens=3, num_global_samples=2)


# --- construction -------------------------------------------------------------------------


def test_grpo_is_an_algorithm_and_validates_its_config():
    assert isinstance(GRPO(AlgoConfig()), Algorithm)
    assert not GRPO(AlgoConfig()).needs_ref
    with pytest.raises(ValueError, match="kl_loss_type"):
        GRPO(AlgoConfig(kl_loss_type="k4"))
    with pytest.raises(ValueError, match="loss_agg"):
        GRPO(AlgoConfig(loss_agg="seq_mean"))
