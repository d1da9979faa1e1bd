"""A user's module in the launch directory (`reward.fn=my_reward.score`, a `_target_` of their own)
imports in the driver and in the Ray workers the run starts (`rlx.launcher.preflight.import_from`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlx.launcher.preflight import import_from

ROOT = Path(__file__).resolve().parents[2]


def test_the_directory_goes_after_the_checkout_and_after_the_users_pythonpath():
    environ, path = {"PYTHONPATH": f"/a{os.pathsep}/b"}, ["/rlx", "/site"]
    import_from("/work/data", environ, path)
    assert path == ["/rlx", "/work/data", "/site"]
    assert environ["PYTHONPATH"] == os.pathsep.join(["/a", "/b", "/work/data"])
    import_from("/work/data", environ, path)  # twice: no second entry
    assert path.count("/work/data") == 1 and environ["PYTHONPATH"].count("/work/data") == 1
    empty: dict[str, str] = {}
    import_from("/w", empty, [])
    assert empty == {"PYTHONPATH": "/w"}


SCRIPT = """
import os, sys
import ray
from rlx.launcher.preflight import import_from
import_from(os.getcwd(), os.environ, sys.path)
import my_module  # the driver
os.chdir(os.environ["ELSEWHERE"])  # as Hydra's job.chdir does before the run (Ray adds the cwd)
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
@ray.remote
def worker():
    import my_module
    return my_module.VALUE
print(my_module.VALUE, ray.get(worker.remote()))
ray.shutdown()
"""


def test_a_module_in_the_launch_directory_imports_in_the_driver_and_a_ray_worker(tmp_path):
    (elsewhere := tmp_path / "outputs").mkdir()
    launch_dir = tmp_path / "data"
    launch_dir.mkdir()
    (launch_dir / "my_module.py").write_text("VALUE = 41 + 1\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"PYTHONPATH": str(ROOT), "ELSEWHERE": str(elsewhere)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=launch_dir, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["42", "42"]
