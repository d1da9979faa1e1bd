"""PPO's GAE, returns and clipped value loss on hand-computed numbers (CPU).

Every expected value was worked out by hand (the arithmetic is in the comments) and is written
as a literal; none is recomputed with the code under test. Shape legend: B samples, T tokens.
"""

from __future__ import annotations

import pytest
import torch

from rlx.algo.config import AlgoConfig
from rlx.algo.losses import clipped_value_loss, gae
from rlx.algo.policy_gradient import padded_rows, unpadded_rows
from rlx.algo.ppo import PPO
from rlx.sample import Sample


def assert_close(actual: torch.Tensor, expected: list | float, atol: float = 1e-6) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual.detach(), expected_t, rtol=0.0, atol=atol)


def f64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_gae_skips_masked_tokens_and_bootstraps_from_the_next_loss_token():
    # gamma 0.5, lambd 0.5 (gamma * lambd 0.25); mask [1, 1, 0, 1]: token 2 is no action
    #   t=3: delta = 1 + 0.5 * 0 - 0.4 = 0.6;            A = 0.6;                      R = 0.6 + 0.4 = 1.0
    #   t=2: skipped (its value 9 is never used);          A = R = 0
    #   t=1: delta = 0 + 0.5 * 0.4 - 0.2 = 0.0 (V of t=3); A = 0 + 0.25 * 0.6 = 0.15;    R = 0.35
    #   t=0: delta = 0 + 0.5 * 0.2 - 0.5 = -0.4;          A = -0.4 + 0.25 * 0.15 = -0.3625; R = 0.1375
    adv_T, returns_T = gae(f64([0, 0, 0, 1]), f64([0.5, 0.2, 9.0, 0.4]), f64([1, 1, 0, 1]), 0.5, 0.5)
    assert_close(adv_T, [-0.3625, 0.15, 0.0, 0.6])
    assert_close(returns_T, [0.1375, 0.35, 0.0, 1.0])


def test_gae_runs_a_padded_batch_row_by_row():
    # The example above as row 0 of a batch, beside a longer row and a one-token row; rows are
    # right-padded with mask 0 (padded_rows), so each row's numbers are the ones it has alone:
    #   row 0: A [-0.3625, 0.15, 0, 0.6], R [0.1375, 0.35, 0, 1.0] (above), padding 0
    #   row 1: one token, r 1, V 0.25: delta = A = 1 - 0.25 = 0.75, R = 1.0
    #   row 2: mask [1, 1, 1, 1, 1], rewards 0 except 2 on the last, V 0, gamma*lambd 0.25:
    #          A_4 = 2, A_3 = 0.5, A_2 = 0.125, A_1 = 0.03125, A_0 = 0.0078125 (R = A, V = 0)
    rewards = [f64([0, 0, 0, 1]), f64([1]), f64([0, 0, 0, 0, 2])]
    values = [f64([0.5, 0.2, 9.0, 0.4]), f64([0.25]), f64([0, 0, 0, 0, 0])]
    masks = [f64([1, 1, 0, 1]), f64([1]), f64([1, 1, 1, 1, 1])]
    adv_BT, returns_BT = gae(padded_rows(rewards), padded_rows(values), padded_rows(masks), 0.5, 0.5)
    assert_close(
        adv_BT, [[-0.3625, 0.15, 0, 0.6, 0], [0.75, 0, 0, 0, 0], [0.0078125, 0.03125, 0.125, 0.5, 2]]
    )
    assert_close(
        returns_BT, [[0.1375, 0.35, 0, 1.0, 0], [1.0, 0, 0, 0, 0], [0.0078125, 0.03125, 0.125, 0.5, 2]]
    )
    advs = unpadded_rows(adv_BT, [4, 1, 5])
    assert [len(a) for a in advs] == [4, 1, 5]
    for row, (r, v, m) in zip(advs, zip(rewards, values, masks, strict=True), strict=True):
        assert torch.equal(row, gae(r, v, m, 0.5, 0.5)[0])  # the same arithmetic, bit for bit


def test_gae_lambda_one_is_monte_carlo_and_lambda_zero_is_one_step_td():
    # rewards [0.1, 0, 0.5], values [0.2, 0.3, 0.4], gamma 1
    rewards_T, values_T, mask_T = f64([0.1, 0.0, 0.5]), f64([0.2, 0.3, 0.4]), f64([1, 1, 1])
    # lambd 1: R = reward-to-go [0.6, 0.5, 0.5]; A = R - V = [0.4, 0.2, 0.1]
    adv_T, returns_T = gae(rewards_T, values_T, mask_T, 1.0, 1.0)
    assert_close(adv_T, [0.4, 0.2, 0.1])
    assert_close(returns_T, [0.6, 0.5, 0.5])
    # lambd 0: A = delta = [0.1 + 0.3 - 0.2, 0 + 0.4 - 0.3, 0.5 - 0.4] = [0.2, 0.1, 0.1];
    # R = r + V_next = [0.4, 0.4, 0.5]
    adv_T, returns_T = gae(rewards_T, values_T, mask_T, 1.0, 0.0)
    assert_close(adv_T, [0.2, 0.1, 0.1])
    assert_close(returns_T, [0.4, 0.4, 0.5])


def test_clipped_value_loss():
    # value_clip 0.2: V_clip = V_old + clip(V - V_old, -0.2, 0.2); loss = max((V-R)^2, (V_clip-R)^2) / 2
    #   V=1.0,  V_old=0.5, R=1.0:  (0)^2 = 0;     V_clip 0.7:  0.09  -> 0.045, clipped (no gradient)
    #   V=0.6,  V_old=0.5, R=0.0:  0.36;          V_clip 0.6:  0.36  -> 0.18,  grad V - R = 0.6
    #   V=0.0,  V_old=0.5, R=1.0:  1.0;           V_clip 0.3:  0.49  -> 0.5,   grad V - R = -1.0
    #   V=-0.5, V_old=0.0, R=-1.0: 0.25;          V_clip -0.2: 0.64  -> 0.32,  clipped
    values_BT = torch.tensor([[1.0, 0.6], [0.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old_BT = torch.tensor([[0.5, 0.5], [0.5, 0.0]], dtype=torch.float64)
    returns_BT = torch.tensor([[1.0, 0.0], [1.0, -1.0]], dtype=torch.float64)
    loss_BT, clipfrac_BT = clipped_value_loss(values_BT, old_BT, returns_BT, 0.2)
    assert_close(loss_BT, [[0.045, 0.18], [0.5, 0.32]])
    assert_close(clipfrac_BT, [[1.0, 0.0], [0.0, 1.0]], atol=0.0)
    loss_BT.sum().backward()
    assert_close(values_BT.grad, [[0.0, 0.6], [-1.0, 0.0]])
    # no clip: the squared errors [0, 0.36, 1, 0.25] halved
    loss_BT, clipfrac_BT = clipped_value_loss(values_BT, old_BT, returns_BT, None)
    assert_close(loss_BT, [[0.0, 0.18], [0.5, 0.125]])
    assert_close(clipfrac_BT, [[0.0, 0.0], [0.0, 0.0]], atol=0.0)


def _samples_and_values() -> tuple[list[Sample], dict[str, list[torch.Tensor]]]:
    # s0: 4 tokens, loss mask [1, 1, 0, 1], reward 1.0; s1: 2 tokens, reward 0.5 (another prompt)
    samples = [
        Sample(prompt="p", prompt_ids=[1], group=0, index=0, response_ids=[7] * 4, loss_mask=[1, 1, 0, 1], reward=1.0),
        Sample(prompt="q", prompt_ids=[1, 2], group=1, index=0, response_ids=[7] * 2, loss_mask=[1, 1], reward=0.5),
    ]  # fmt: skip
    values = [torch.tensor([0.5, 0.2, 9.0, 0.4]), torch.tensor([0.3, 0.6])]
    old = [torch.full((4,), -1.0), torch.full((2,), -1.0)]
    return samples, {"old_logp": old, "values": values}


# gamma 0.5, lambd 0.5
#   s0: as test_gae_skips_masked_tokens...: A [-0.3625, 0.15, 0, 0.6], R [0.1375, 0.35, 0, 1.0]
#   s1: rewards [0, 0.5]; t=1: delta = 0.5 - 0.6 = -0.1, A = -0.1, R = 0.5;
#       t=0: delta = 0 + 0.5 * 0.6 - 0.3 = 0, A = 0.25 * -0.1 = -0.025, R = -0.025 + 0.3 = 0.275
ADVANTAGES = [[-0.3625, 0.15, 0.0, 0.6], [-0.025, -0.1]]
RETURNS = [[0.1375, 0.35, 0.0, 1.0], [0.275, 0.5]]
# whitened over the 5 loss tokens [-0.3625, 0.15, 0.6, -0.025, -0.1]: mean 0.2625 / 5 = 0.0525,
# squared deviations 0.172225 + 0.00950625 + 0.29975625 + 0.00600625 + 0.02325625 = 0.51075,
# var 0.10215, std 0.3196091; (x - 0.0525) / 0.3196091 (the masked token's 0 moves alike)
WHITENED = [[-1.2984610, 0.3050601, -0.1642631, 1.7130299], [-0.2424837, -0.4771453]]


@pytest.mark.parametrize(("whiten", "expected"), [(False, ADVANTAGES), (True, WHITENED)])
def test_ppo_advantages_and_returns(whiten, expected):
    samples, logprobs = _samples_and_values()
    algo = PPO(AlgoConfig(_target_="rlx.algo.ppo.PPO", gamma=0.5, lambd=0.5, whiten_advantages=whiten))
    assert algo.needs_critic and not algo.needs_ref and algo.min_group_size == 1
    result = algo.advantages(samples, logprobs)
    advs = result.advantages
    assert [a.dtype for a in advs] == [torch.float32] * 2
    for adv, exp in zip(advs, expected, strict=True):
        assert_close(adv, exp)
    # the returns are never whitened: they are the critic's targets
    assert [r.dtype for r in result.returns] == [torch.float32] * 2
    for ret, exp in zip(result.returns, RETURNS, strict=True):
        assert_close(ret, exp)
    # over loss tokens: values [0.5, 0.2, 0.4, 0.3, 0.6] mean 0.4; returns [0.1375, 0.35, 1.0, 0.275, 0.5]
    # mean 0.4525, var (0.099225 + 0.01050625 + 0.29975625 + 0.03150625 + 0.00225625) / 5 = 0.08865;
    # R - V are the advantages, var 0.10215: explained variance 1 - 0.10215 / 0.08865 = -0.1522843.
    # return_mean (the base class's): summed rewards per sample (1.0 + 0.5) / 2 = 0.75
    assert result.metrics == pytest.approx(
        {"return_mean": 0.75, "values_mean": 0.4, "returns_mean": 0.4525, "explained_variance": -0.1522843}
    )


def test_ppo_explained_variance_is_one_when_the_values_are_the_returns():
    # gamma 1, lambd 1, one token per sample: R = reward; values equal to the rewards leave R - V = 0
    samples = [
        Sample(prompt="p", prompt_ids=[1], group=g, index=0, response_ids=[7], loss_mask=[1], reward=r)
        for g, r in enumerate([0.0, 1.0, 0.5])
    ]
    values = [torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([0.5])]
    algo = PPO(AlgoConfig(_target_="rlx.algo.ppo.PPO", lambd=1.0))
    result = algo.advantages(samples, {"old_logp": [torch.zeros(1)] * 3, "values": values})
    assert result.metrics["explained_variance"] == pytest.approx(1.0)


def test_ppo_needs_the_critics_values():
    samples, logprobs = _samples_and_values()
    with pytest.raises(KeyError, match="values"):
        PPO(AlgoConfig(_target_="rlx.algo.ppo.PPO")).advantages(samples, {"old_logp": logprobs["old_logp"]})
