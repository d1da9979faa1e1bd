"""Every algorithm option composes, builds its class, and incompatible options fail at compose
time naming their keys (CPU, no processes)."""

from __future__ import annotations

import pytest

from rlx.algo.grpo import GRPO
from rlx.algo.gspo import GSPO
from rlx.algo.ppo import PPO
from rlx.algo.reinforce_pp import ReinforcePP
from rlx.algo.reinforce_pp_baseline import ReinforcePPBaseline
from rlx.config import build
from rlx.config.compose import CONF_DIR, compose
from rlx.errors import ConfigError

ALGO_OPTIONS = sorted(p.stem for p in (CONF_DIR / "algo").glob("*.yaml"))
CLASS_OF = {
    "grpo": GRPO,
    "gspo": GSPO,
    "reinforce_pp": ReinforcePP,
    "reinforce_pp_baseline": ReinforcePPBaseline,
    "ppo": PPO,
}


def test_every_shipped_algorithm_has_its_class():
    assert set(CLASS_OF) <= set(ALGO_OPTIONS)


@pytest.mark.parametrize("option", sorted(CLASS_OF))
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["algo.use_tis=true", "algo.tis_clip=3.0"],
        ["algo.eps_clip_c=3.0", "algo.eps_clip_high=0.28"],
        [
            "algo.use_kl_in_reward=false",
            "algo.use_kl_loss=true",
            "algo.kl_loss_coef=0.01",
            "algo.kl_loss_type=k2",
        ],
        ["algo.use_kl_loss=false", "algo.use_kl_in_reward=true", "algo.kl_in_reward_coef=0.01"],
        ["algo.whiten_advantages=true", "algo.entropy_coef=0.001"],
    ],
    ids=["as-shipped", "tis", "dual-clip", "kl-loss", "kl-in-reward", "whiten"],
)
def test_every_algorithm_option_composes_and_builds(option, extra):
    algo = build(compose([f"algo={option}", *extra]).algo)
    assert type(algo) is CLASS_OF[option]


def test_shipped_defaults():
    assert build(compose(["algo=gspo"]).algo).cfg.eps_clip == pytest.approx(3e-4)
    rpp = build(compose(["algo=reinforce_pp"]).algo)
    assert rpp.needs_ref and rpp.cfg.whiten_advantages and rpp.cfg.use_kl_in_reward
    assert build(compose(["algo=reinforce_pp_baseline"]).algo).cfg.whiten_advantages


def test_ppo_ships_with_a_critic_and_needs_no_groups():
    ppo = build(compose(["algo=ppo"]).algo)
    assert ppo.needs_critic and not ppo.needs_ref and ppo.cfg.whiten_advantages
    assert ppo.cfg.lambd == pytest.approx(0.95) and ppo.cfg.value_clip == pytest.approx(0.2)
    compose(["algo=ppo", "rollout.n_samples_per_prompt=1", "train.micro_batch_size=32"])
    compose(["algo=ppo", "algo.value_clip=null"])  # unclipped value loss


def test_reinforce_pp_needs_no_groups():
    one_per_prompt = ["rollout.n_samples_per_prompt=1", "train.micro_batch_size=32"]
    compose(["algo=reinforce_pp", *one_per_prompt])
    with pytest.raises(ConfigError, match="rollout.n_samples_per_prompt=1"):
        compose(["algo=reinforce_pp_baseline", *one_per_prompt])


COMPOSE_FAILURES = {
    "kl in loss and in reward": (
        ["algo.use_kl_loss=true", "algo.use_kl_in_reward=true"],
        r"(?s)invalid config \(1 problem\).*algo\.use_kl_loss=true and algo\.use_kl_in_reward=true.*choose one",
    ),
    "kl in loss and in reward (reinforce_pp)": (
        ["algo=reinforce_pp", "algo.use_kl_loss=true"],
        r"algo\.use_kl_loss=true and algo\.use_kl_in_reward=true",
    ),
    "dual clip = 1": (["algo.eps_clip_c=1.0"], r"algo\.eps_clip_c=1\.0 must be > 1"),
    "dual clip < 1": (["algo.eps_clip_c=0.5"], r"algo\.eps_clip_c=0\.5 must be > 1"),
    "gspo token_mean": (
        ["algo=gspo", "algo.loss_agg=token_mean"],
        r"algo\.loss_agg='token_mean'.*sample_mean",
    ),
    "baseline gamma": (
        ["algo=reinforce_pp_baseline", "algo.gamma=0.9"],
        r"algo\.gamma=0\.9.*set algo\.gamma=1\.0",
    ),
    "gamma range": (["algo=reinforce_pp", "algo.gamma=1.5"], r"algo\.gamma=1\.5 must be in \[0, 1\]"),
    "kl_in_reward_type": (["algo.kl_in_reward_type=k4"], r"algo\.kl_in_reward_type='k4'.*low_var_kl"),
    "kl_in_reward_coef": (["algo.kl_in_reward_coef=-1"], r"algo\.kl_in_reward_coef=-1\.0 must be >= 0"),
    "tis_clip": (["algo.use_tis=true", "algo.tis_clip=0"], r"algo\.tis_clip=0\.0 must be > 0"),
    "lambd range": (["algo=ppo", "algo.lambd=1.5"], r"algo\.lambd=1\.5 must be in \[0, 1\]"),
    "critic_lr": (["algo=ppo", "algo.critic_lr=0"], r"algo\.critic_lr=0\.0 must be > 0"),
    "value_clip": (["algo=ppo", "algo.value_clip=-0.2"], r"algo\.value_clip=-0\.2 must be > 0"),
    "critic_warmup_steps": (
        ["algo=ppo", "algo.critic_warmup_steps=-1"],
        r"algo\.critic_warmup_steps=-1 must be >= 0",
    ),
}


@pytest.mark.parametrize(("overrides", "pattern"), COMPOSE_FAILURES.values(), ids=COMPOSE_FAILURES.keys())
def test_incompatible_options_fail_at_compose_time_naming_the_keys(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        compose(overrides)
