"""`python launch.py` speaks rlx for every composing error (rlx.launcher.preflight): a typo, an
unknown option, a wrong type, a missing value, an unreadable override, a bad key in the user's own
option file, a bad value in a `-m` sweep. Each message names the key (and the file it came from),
the nearest key or option and the fix; none is Hydra's ("Could not override", "+key", the
HYDRA_FULL_ERROR footer), none is a traceback. Each case runs the real command line (about 2 s:
it fails before anything starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HYDRAS_WORDS = ("HYDRA_FULL_ERROR", "To append to your config use", "Could not override", "Traceback")


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "launch.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def options(tmp_path_factory) -> Path:
    """A user's search path with one good and one mistyped algorithm option."""
    root = tmp_path_factory.mktemp("my_conf")
    (root / "algo").mkdir()
    (root / "algo" / "my_grpo.yaml").write_text("defaults:\n  - grpo\n  - _self_\neps_clip: 0.3\n")
    (root / "algo" / "my_typo.yaml").write_text("defaults:\n  - grpo\n  - _self_\neps_clipp: 0.3\n")
    return root


CASES = {
    "unknown key": (
        ["model.hidden_sizee=64"],
        ["model.hidden_sizee does not exist", "did you mean model.hidden_size?", "set model.hidden_size="],
    ),
    "misspelt key": (["rollout.temprature=0.5"], ["rollout.temprature does not exist", "did you mean rollout.temperature?"]),
    "near a real key": (["run.num_rollouts=3"], ["run.num_rollouts does not exist", "did you mean run.num_rollout?"]),
    "unknown group option": (
        ["algo=grpoo"],
        ["algo=grpoo: no option grpoo in algo", "did you mean algo=grpo?", "the options: dr_grpo, grpo, gspo"],
    ),
    "wrong type": (
        ["rollout.temperature=abc"],
        ["rollout.temperature=abc: abc is not a number", "e.g. rollout.temperature=1.0 (the default)"],
    ),
    "no value": (["rollout.temperature"], ["rollout.temperature is given no value", "write rollout.temperature=VALUE"]),
    "null for a key that takes none": (["rollout.temperature=null"], ["rollout.temperature cannot be null"]),
    "unreadable override": (
        ["rollout.temperature=[1,2"],
        ["the override 'rollout.temperature=[1,2' cannot be read", "quote a value"],
    ),
    "a verl key": (
        ["data.train_files=train.parquet"],
        ["data.train_files does not exist; it is verl's key; here write data.prompt_path=FILE"],
    ),
    "a verl key of a section rlx has not": (
        ["actor_rollout_ref.rollout.n=8"],
        ["actor_rollout_ref.rollout.n does not exist; it is verl's key; here write rollout.n_samples_per_prompt=N"],
    ),
    "a bare ~ in a path": (
        ["model.hf_checkpoint=~/models/qwen"],
        ["model.hf_checkpoint=~/models/qwen: Hydra's grammar takes no bare ~",
         "write model.hf_checkpoint=$HOME/models/qwen", "'model.hf_checkpoint=\"~/models/qwen\"'"],
    ),  # fmt: skip
    "bad value in a sweep": (
        ["-m", "rollout.temperature=0.5,abc", "run.seed=1,2,3"],
        ["rollout.temperature=abc: abc is not a number"],
    ),
    "bad option in a sweep": (["-m", "algo=grpo,gsppo"], ["algo=gsppo: no option gsppo", "did you mean algo=gspo?"]),
}  # fmt: skip


@pytest.mark.parametrize("args, fragments", CASES.values(), ids=CASES.keys())
def test_a_bad_command_line_gets_rlxs_message(args, fragments):
    result = launch(*args)
    assert result.returncode == 1, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr[-2000:]
    for words in HYDRAS_WORDS:
        assert words not in result.stderr, result.stderr[-2000:]
    assert result.stderr.startswith("error: "), result.stderr[-2000:]


def test_a_bad_key_in_the_users_option_file_names_the_file(options):
    result = launch(f"hydra.searchpath=[file://{options}]", "algo=my_typo")
    assert result.returncode == 1
    message = result.stderr
    assert f"algo.eps_clipp does not exist (set in {options / 'algo' / 'my_typo.yaml'})" in message, message
    assert "did you mean algo.eps_clip? rename eps_clipp to eps_clip there" in message, message
    assert not [w for w in HYDRAS_WORDS if w in message], message


def test_a_good_command_line_reaches_hydra_unchanged(options):
    """The pre-flight refuses nothing Hydra accepts: a user's option file from a search path, a
    Hydra key and `--cfg job` print the composed config."""
    result = launch(
        f"hydra.searchpath=[file://{options}]", "algo=my_grpo", "hydra.run.dir=/tmp/x", "--cfg", "job"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "eps_clip: 0.3" in result.stdout


def test_every_verl_key_points_at_a_key_or_group_of_rlx():
    from rlx.config.keys import VERL_KEYS, schema_keys

    keys = schema_keys()
    for verl, hint in VERL_KEYS.items():
        for word in hint.split(" ("):
            for setting in word.split():
                name = setting.strip("'+").split("=")[0]
                if "=" in setting and name not in ("algo",):
                    assert name.split("={")[0] in keys, (verl, name)
