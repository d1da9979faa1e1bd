"""`rlx.config.build.locate`: a dotted path's object, or one line naming what is missing and the
closest name there is (a user's reward.fn, data.filter or _target_ with a typo)."""

from __future__ import annotations

import sys

import pytest

from rlx.config.build import load_function, locate
from rlx.errors import ConfigError


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def contains_answer(sample):\n    return 1.0\n")
    (tmp_path / "broken_reward.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "raising_reward.py").write_text("raise RuntimeError('bad config at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("my_reward", "broken_reward", "raising_reward"):
        sys.modules.pop(name, None)


def test_locate_finds_functions_classes_and_methods(user_module):
    import my_reward

    assert locate("my_reward.contains_answer") is my_reward.contains_answer
    assert locate("rlx.config.build.locate") is locate
    assert locate("pathlib.Path.exists") is __import__("pathlib").Path.exists


@pytest.mark.parametrize(
    "path, message",
    [
        (
            "my_reward.contains_answr",
            "module 'my_reward' has no name 'contains_answr'; did you mean my_reward.contains_answer?",
        ),
        (
            "my_rewrd.contains_answer",
            "no module named 'my_rewrd' (is it installed, or is its directory on PYTHONPATH",
        ),
        (
            "rlx.reward.mathx.f",
            "module 'rlx.reward' has no name or submodule 'mathx'; did you mean rlx.reward.math?",
        ),
        ("rlx.reward.math.math_answr", "has no name 'math_answr'; did you mean rlx.reward.math.math_answer?"),
        ("pathlib.Path.exsts", "type 'pathlib.Path' has no name 'exsts'; did you mean pathlib.Path.exists?"),
        ("broken_reward.f", "importing 'broken_reward' failed: No module named 'no_such_dependency_xyz'"),
        ("raising_reward.f", "importing 'raising_reward' failed: RuntimeError: bad config at import"),
        ("my_reward", "'my_reward' is not a dotted path"),
        (
            "/data/user/my_reward.py:contains_answer",
            "'/data/user/my_reward.py:contains_answer' is a file path; a dotted path is wanted: put the "
            "file's directory on the import path and name module.function, e.g. PYTHONPATH=/data/user ... "
            "=my_reward.contains_answer",
        ),
        ("my_reward.py", "e.g. PYTHONPATH=. ... =my_reward.FUNCTION"),
        ("my_reward..f", "is not a dotted path"),
    ],
)
def test_locate_names_what_is_missing_in_one_line(user_module, path, message):
    with pytest.raises(ImportError) as err:
        locate(path)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_load_function_error_names_the_key_the_path_and_the_fix(user_module):
    with pytest.raises(ConfigError) as err:
        load_function("reward.fn", "my_reward.contains_answr", "give module.function")
    assert str(err.value) == (
        "reward.fn='my_reward.contains_answr' cannot be imported: module 'my_reward' has no name "
        "'contains_answr'; did you mean my_reward.contains_answer?\nfix: give module.function"
    )


def test_a_module_that_fails_its_own_import_is_not_told_to_fix_the_path(user_module):
    with pytest.raises(ConfigError) as err:
        load_function("reward.fn", "broken_reward.f", "give module.function")
    assert str(err.value) == (
        "reward.fn='broken_reward.f' cannot be imported: importing 'broken_reward' failed: No module named "
        "'no_such_dependency_xyz'\nfix: the module was found; make its import work (install what it "
        "imports, or correct its code)"
    )
