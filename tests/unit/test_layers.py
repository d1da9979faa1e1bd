"""What each layer may import: a model family knows no task, and a trainer rank loads no Hydra
composition, validation, data or reward code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

RLX = Path(__file__).resolve().parents[2] / "rlx"


def _imports(package: str) -> dict[str, set[str]]:
    """file -> the rlx modules it imports (at any depth, lazy imports included)."""
    out = {}
    for path in sorted((RLX / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
        out[str(path.relative_to(RLX))] = {n for n in names if n.startswith("rlx.")}
    return out


def _probe(code: str) -> subprocess.CompletedProcess:
    """`code` run by a fresh interpreter in the repository: what it imports is its own."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=RLX.parent, timeout=120
    )


def test_model_families_import_no_task_data_or_rollout_code():
    forbidden = ("rlx.data", "rlx.reward", "rlx.rollout", "rlx.trainer", "rlx.algo", "rlx.runtime")
    bad = {f: sorted(m for m in mods if m.startswith(forbidden)) for f, mods in _imports("models").items()}
    assert not {f: m for f, m in bad.items() if m}


def test_a_trainer_rank_imports_no_composition_validation_data_or_reward_code():
    probe = (
        "import sys, rlx.trainer.megatron, rlx.trainer.group\n"
        "heavy = ('rlx.config.compose', 'rlx.config.validate', 'rlx.data', 'rlx.reward', 'hydra')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    loaded = _probe(probe)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr[-2000:]


def test_a_typo_on_the_command_line_fails_before_torch_is_imported():
    # launch.py imports rlx.config.store before Hydra composes: an override Hydra rejects must
    # fail in Hydra's time (1-2 s), not after torch's import too (the algorithm's option names
    # live in the torch-free rlx.algo.options; the loss functions check the same names)
    probe = (
        "import sys, rlx.config.store\n"
        "from rlx.config.compose import compose\n"
        "try:\n"
        "    compose(['rollout.batch_szie=4'])\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, 'batch_szie' in str(e), 'torch' in sys.modules)\n"
    )
    loaded = _probe(probe)
    assert loaded.stdout.split()[1:] == ["True", "False"], loaded.stdout + loaded.stderr[-2000:]
    from rlx.algo import losses, options

    assert sorted(losses.KL_ESTIMATORS) == sorted(options.KL_ESTIMATOR_NAMES)


def test_a_config_error_is_reported_before_the_driver_loads_megatron():
    # the driver reaches validation through launch.py -> rlx.launcher.job -> rlx.runtime; Megatron
    # (seconds to import) loads only once a trainer starts, so a typo fails in about 2 s, not 6
    probe = (
        "import sys, rlx.launcher.job, rlx.runtime\n"
        "from rlx.config.compose import compose\n"
        "from rlx.errors import ConfigError\n"
        "try:\n"
        "    rlx.runtime.run(compose(['train.global_batch_size=100']))\n"
        "except ConfigError:\n"
        "    print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('megatron', 'transformer_engine'))}))\n"
    )
    loaded = _probe(probe)
    assert loaded.stdout.strip() == "[]", loaded.stderr[-2000:]


def test_launch_py_validates_before_it_imports_the_runtime():
    # launch.py's job validates the config before importing rlx.runtime (Ray, transformers and the
    # loop's modules: 2 s more for every config error)
    probe = (
        "import sys\n"
        "from rlx.config.compose import compose\n"
        "from rlx.errors import ConfigError\n"
        "from rlx.launcher.job import run_on_nodes\n"
        "try:\n"
        "    run_on_nodes(compose(['train.global_batch_size=100']))\n"
        "except ConfigError:\n"
        "    print(sorted(m for m in ('ray', 'rlx.runtime', 'transformers') if m in sys.modules))\n"
    )
    loaded = _probe(probe)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr[-2000:]


def test_a_trainer_rank_on_the_drivers_node_is_handed_the_checkpoint_the_driver_found(tmp_path):
    # the driver works the tiny model's directory out (transformers' config classes: 1.5 s of CPU);
    # ranks on its node are handed it and never import transformers; ranks on other nodes, whose
    # caches are their own, work it out there
    (tmp_path / "config.json").write_text("{}")
    probe = (
        "import dataclasses, sys\n"
        "from rlx.config import build\n"
        "from rlx.config.compose import compose, to_object\n"
        "from rlx.runtime import _with_checkpoint_dir\n"
        "rc = to_object(compose([]))\n"
        f"ranks = _with_checkpoint_dir(rc, {str(tmp_path)!r})\n"
        "two_nodes = dataclasses.replace(rc, cluster=dataclasses.replace(rc.cluster, num_nodes=2))\n"
        f"print(str(build(ranks.model).checkpoint_dir()) == {str(tmp_path)!r}, rc.model.hf_checkpoint,\n"
        "      _with_checkpoint_dir(two_nodes, 'elsewhere') is two_nodes, 'transformers' in sys.modules)\n"
    )
    loaded = _probe(probe)
    assert loaded.stdout.split() == ["True", "None", "True", "False"], loaded.stdout + loaded.stderr[-2000:]
