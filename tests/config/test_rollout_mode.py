"""rollout.mode, staleness, over-sampling and filters are checked at compose time, naming keys and the fix."""

from __future__ import annotations

import pytest

from rlx.config.compose import compose, to_object
from rlx.config.validate import validate
from rlx.errors import ConfigError

CASES = {
    "async without correction": (
        ["rollout.mode=async"],
        [
            "rollout.mode=async",
            "rollout.max_staleness=1",
            "algo.use_tis=true",
            "rollout.max_staleness=0",
            "rollout.allow_uncorrected_async=true",
        ],
    ),  # fmt: skip
    "async colocated": (
        ["rollout.mode=async", "algo.use_tis=true", "cluster.colocate=true"],
        ["rollout.mode=async", "cluster.colocate=false"],
    ),
    "staleness below the update interval": (
        ["rollout.mode=async", "algo.use_tis=true", "rollout.update_weights_interval=3"],
        ["rollout.max_staleness", "rollout.update_weights_interval"],
    ),
    "over-sampling below the batch": (
        ["rollout.over_sampling_batch_size=4"],
        ["rollout.over_sampling_batch_size=4", "rollout.batch_size=32", ">= 32"],
    ),
    "filter that does not import": (
        ["rollout.filter_fn=no_such.module"],
        ["rollout.filter_fn", "reward_varies"],
    ),
    "mask without partial rollout": (
        ["rollout.mask_old_policy_tokens=true"],
        ["rollout.mask_old_policy_tokens=true", "rollout.partial_rollout=true"],
    ),
    "unknown mode": (["rollout.mode=later"], ["rollout.mode='later'", "rollout.mode=sync"]),
    "unknown staleness policy": (["rollout.staleness_policy=wait"], ["rollout.staleness_policy"]),
    "unknown tis level": (["algo.tis_level=batch"], ["algo.tis_level", "token"]),
    "train only without dumps": (
        ["debug.train_only=true"],
        ["debug.train_only=true", "debug.load_rollouts=RUN_DIR"],
    ),
    "dumps that are not there": (
        ["debug.train_only=true", "debug.load_rollouts=/no/such/run"],
        ["debug.load_rollouts='/no/such/run'", "run.dump_rollouts=true"],
    ),
    "dumps without train only": (
        ["debug.load_rollouts=/tmp"],
        ["debug.load_rollouts", "debug.train_only=true"],
    ),
    "both debug halves": (["debug.train_only=true", "debug.rollout_only=true"], ["leave nothing to run"]),
    "rollout only in async": (
        ["debug.rollout_only=true", "rollout.mode=async", "algo.use_tis=true"],
        ["debug.rollout_only=true with rollout.mode=async", "rollout.mode=sync"],
    ),
    "profiling a step that never runs": (
        ["run.num_rollout=3", "debug.profile_train_steps=[1,3,7]"],
        ["debug.profile_train_steps: steps 3, 7 never run", "run.num_rollout - 1 = 2"],
    ),
    "profiling without a trainer": (
        ["debug.rollout_only=true", "debug.profile_train_steps=[0]"],
        ["debug.profile_train_steps=[0]", "debug.rollout_only=true"],
    ),
    "eval interval without sets": (
        ["run.eval_interval=5"],
        ["run.eval_interval=5", "data.eval", "run.eval_interval=0"],
    ),
    "eval sets never evaluated": (
        ["data=jsonl", "data.prompt_path=/etc/hostname", "+data.eval={test: {path: /etc/hostname}}"],
        ["data.eval names sets (test)", "run.eval_interval=N", "data.eval=null"],
    ),
    "failed fraction out of range": (["run.max_failed_frac=0"], ["run.max_failed_frac=0", "(0, 1]"]),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_rollout_mode_is_refused_naming_the_keys(case):
    overrides, expected = CASES[case]
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides))
    for text in expected:
        assert text in str(err.value), (text, str(err.value))


def test_a_sound_async_config_composes():
    validate(compose(["rollout.mode=async", "algo.use_tis=true", "rollout.max_staleness=2",
                      "rollout.update_weights_interval=2", "rollout.staleness_policy=drop",
                      "rollout.filter_fn=rlx.rollout.filters.reward_varies",
                      "rollout.over_sampling_batch_size=48", "rollout.partial_rollout=true",
                      "rollout.mask_old_policy_tokens=true"]))  # fmt: skip


def test_async_at_staleness_0_is_on_policy_and_needs_no_correction():
    cfg = compose(["rollout.mode=async", "rollout.max_staleness=0"])
    assert cfg.algo.use_tis is False and cfg.rollout.allow_uncorrected_async is False


def test_data_eval_null_drops_the_sets_a_config_composed_in():
    """An experiment's eval sets are dropped by data.eval=null; data.eval={} would merge into them."""
    base = ["data=jsonl", "data.prompt_path=/etc/hostname", "+data.eval={a: {path: /etc/hostname}}"]
    merged = compose([*base, "run.eval_interval=2", "data.eval={}"], validated=False)
    assert list(merged.data.eval) == ["a"]
    dropped = compose([*base, "run.eval_interval=0", "data.eval=null"], validated=False)
    assert to_object(dropped).data.eval == {}
    with pytest.raises(ConfigError, match="run.eval_interval=3 but data.eval names no set"):
        validate(compose([*base, "run.eval_interval=3", "data.eval=null"], validated=False))
