"""rlx.rollout.router's import check: sglang-router that cannot start in this environment (a
missing dependency: on the GPU machine, `setproctitle` and `orjson`) is found while the engines
start, in seconds, instead of when the router exits after every engine has loaded its model."""

from __future__ import annotations

import pytest

from rlx.rollout import router


def test_a_router_that_cannot_be_imported_is_refused_with_the_import_error_and_the_fix():
    check = router.start_import_check("rlx_no_such_module.launch_router")
    with pytest.raises(RuntimeError) as refused:
        router.finish_import_check(check, "rlx_no_such_module.launch_router")
    message = str(refused.value)
    assert "cannot start in this environment" in message
    assert "ModuleNotFoundError: No module named 'rlx_no_such_module'" in message
    assert "pip install sglang-router==0.3.2" in message and "rollout.num_engines=1" in message
    assert "rlx_no_such_module.launch_router" not in router._imports


def test_an_importable_router_is_checked_once_a_process(monkeypatch):
    monkeypatch.setattr(router, "_imports", set())
    check = router.start_import_check("json")  # stands in for sglang_router.launch_router
    assert check is not None
    router.finish_import_check(check, "json")
    assert router.start_import_check("json") is None  # found importable: no second child process
    router.finish_import_check(None, "json")


def test_the_real_launcher_imports_here():
    """CI's environment has sglang-router with its dependencies (the router tests start it)."""
    router.finish_import_check(router.start_import_check())
