"""The task owns its reward and response length (issue 25): the data presets set `reward.fn` and
`rollout.max_response_len`, a run without a reward is refused at compose time, and the key's old
name (`rollout.reward_fn`) is answered with the new one. CPU, compose only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from rlx.config.compose import CONF_DIR, compose, to_object
from rlx.config.validate import TASK_PRESETS
from rlx.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TOY_REWARD = "rlx.reward.toy.position_match"


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "3 7 1 =", "label": "1 7 3"}) + "\n")
    return path


@pytest.fixture
def checkpoint(tmp_path):
    """A stand-in for a downloaded HF checkpoint (validation looks for its config.json)."""
    path = tmp_path / "hf"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def problem_count(error: ConfigError) -> int:
    return str(error).count("\n  - ")


# ---- the presets -------------------------------------------------------------------------------


def test_the_default_job_keeps_the_toy_reward_and_its_four_tokens():
    rc = to_object(compose())
    assert (rc.data.toy_task, rc.reward.fn, rc.rollout.max_response_len) == ("copy", TOY_REWARD, 4)
    rc = to_object(compose(["data=toy_reverse"]))
    assert (rc.data.toy_task, rc.reward.fn, rc.rollout.max_response_len) == ("reverse", TOY_REWARD, 4)


def test_launch_cfg_job_prints_the_reward_and_length_of_the_default():
    out = subprocess.run(
        [sys.executable, "launch.py", "--cfg", "job"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "  fn: rlx.reward.toy.position_match\n" in out.split("\nreward:\n")[1]
    assert "  max_response_len: 4\n" in out.split("\nrollout:\n")[1]
    assert "reward_fn" not in out


def test_task_presets_lists_every_data_option_that_names_a_reward():
    """validate.TASK_PRESETS (named in the no-reward message) is exactly the options setting reward.fn."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        options = sorted(p.stem for p in (CONF_DIR / "data").glob("*.yaml"))
        named = [f"data={o}" for o in options if hydra_compose("config", [f"data={o}"]).reward.fn]
    GlobalHydra.instance().clear()
    assert tuple(named) == TASK_PRESETS


@pytest.mark.parametrize(
    "overrides",
    [[], ["data=toy_reverse"], ["+experiment=reverse8_1gpu"]],
    ids=["default", "toy_reverse", "reverse8_1gpu"],
)
def test_toy_answers_fit_the_response_length(overrides):
    """A toy answer is toy_num_digits digits and EOS: 3 + 1 = 4 by default, 8 + 1 = 9 in reverse8_1gpu."""
    rc = to_object(compose(overrides))
    assert rc.data._target_ == "rlx.data.toy.ToySource"
    assert rc.rollout.max_response_len == rc.data.toy_num_digits + 1


def test_the_math_preset_is_a_file_source_with_its_reward_and_length(prompts, checkpoint):
    rc = to_object(
        compose(
            [
                "data=math",
                f"data.prompt_path={prompts}",
                "model=qwen3_4b",
                f"model.hf_checkpoint={checkpoint}",
            ]
        )
    )
    assert rc.data._target_ == "rlx.data.source.FileSource" and rc.data.apply_chat_template
    assert (rc.reward.fn, rc.rollout.max_response_len) == ("rlx.reward.math.math_answer", 1024)
    with pytest.raises(ConfigError, match=r"data\.prompt_path is not set; set data\.prompt_path="):
        compose(["data=math", "model=qwen3_4b", f"model.hf_checkpoint={checkpoint}"])


def test_an_experiment_switching_the_data_preset_takes_its_reward():
    rc = to_object(compose(["+experiment=reverse8_1gpu"]))  # override /data: toy_reverse
    assert (rc.data.toy_task, rc.reward.fn) == ("reverse", TOY_REWARD)
    rc = to_object(compose(["+experiment=tool_calc"]))  # its own reward over the default preset's
    assert rc.reward.fn == "examples.tool_calc.reward.answer_reward"


# ---- who scores --------------------------------------------------------------------------------


def test_no_reward_fn_and_no_url_names_reward_fn_the_presets_and_reward_url(prompts):
    with pytest.raises(ConfigError) as e:
        compose(["data=jsonl", f"data.prompt_path={prompts}", "rollout.max_response_len=4"])
    message = str(e.value)
    assert problem_count(e.value) == 1
    assert "reward.fn is not set and neither is reward.url" in message
    assert "(data=math, data=toy_copy, data=toy_reverse)" in message
    assert "reward.fn=rlx.reward.math.math_answer" in message and "reward.url=http://" in message


def test_a_file_source_with_its_reward_fn_composes(prompts):
    rc = to_object(
        compose(
            [
                "data=jsonl",
                f"data.prompt_path={prompts}",
                f"reward.fn={TOY_REWARD}",
                "rollout.max_response_len=4",
            ]
        )
    )
    assert rc.reward.fn == TOY_REWARD


def test_reward_fn_and_reward_url_together_are_refused():
    with pytest.raises(ConfigError) as e:
        compose(["reward.url=http://rm-host:8000/score"])  # the default preset set reward.fn
    assert problem_count(e.value) == 1
    assert f"reward.url='http://rm-host:8000/score' and reward.fn='{TOY_REWARD}' are both set" in str(e.value)
    assert "reward.fn=null" in str(e.value)
    compose(["reward.url=http://rm-host:8000/score", "reward.fn=null"])  # the server alone


def test_a_generate_fn_may_run_without_reward_fn():
    """It may set sample.reward itself; what it leaves unset fails at run time, reason no_reward
    (tests/unit/test_reward_scorer.py)."""
    rc = to_object(compose(["+experiment=tool_calc", "reward.fn=null"]))
    assert rc.reward.fn is None and rc.rollout.generate_fn == "examples.tool_calc.generate.generate"


# ---- the old key -------------------------------------------------------------------------------

MOVED = (
    "rollout.reward_fn has moved to reward.fn (the task names its reward beside its prompts: data=math, "
    "data=toy_copy set it); set reward.fn=... instead of rollout.reward_fn=..."
)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.reward_fn=rlx.reward.math.math_answer", MOVED),  # Hydra's 'Could not override'
        ("+rollout.reward_fn=x.y", f"invalid config (1 problem):\n  - {MOVED}"),  # added: validate's check
        ("++rollout.reward_fn=x.y", f"invalid config (1 problem):\n  - {MOVED}"),
    ],
)
def test_the_old_key_on_the_command_line_says_where_it_moved(override, message):
    with pytest.raises(ConfigError) as e:
        compose([override])
    assert str(e.value) == message


def test_the_old_key_in_a_yaml_file_says_where_it_moved(tmp_path):
    """A config file of its own (an older run's recorded config.yaml, say) setting the old key."""
    (tmp_path / "config.yaml").write_text(
        "defaults: [rlx_config, _self_]\nrollout:\n  reward_fn: rlx.reward.toy.position_match\n"
    )
    with pytest.raises(ConfigError) as e:
        compose([], config_dir=tmp_path)
    assert str(e.value) == MOVED


def test_launch_py_says_where_the_old_key_moved():
    done = subprocess.run(
        [sys.executable, "launch.py", "rollout.reward_fn=rlx.reward.math.math_answer"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and done.stderr.strip() == f"error: {MOVED}"
