"""What a run used, written to its run directory: `config.yaml` and `run_info.json`.

`config.yaml` is the composed config, interpolations resolved, with `model.hf_checkpoint` set to
the checkpoint directory actually loaded (the tiny model's cache directory included) and
`run.output_dir` cleared, so that it reruns as it stands, typed on rlx's schema, into a new
run directory:

    python launch.py --config-path /abs/path/to/RUN_DIR --config-name config [overrides]

Provenance that is not config goes to `run_info.json` beside it (a key of its own in
config.yaml would be an unknown key on rerun): the run directory, the checkpoint directory as
given and as resolved, package versions (torch, megatron-core, transformers, ray, sglang-router,
hydra-core, omegaconf; sglang when installed), rlx's git commit and whether its tracked files
had uncommitted changes (when rlx runs from a git checkout), Python, host, command line, time.
"""

from __future__ import annotations

import json
import platform
import socket
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlx.config.store import ROOT_SCHEMA

PACKAGES = (
    "torch",
    "megatron-core",
    "transformers",
    "ray",
    "sglang-router",
    "sglang",
    "hydra-core",
    "omegaconf",
)
RLX_ROOT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages) holding rlx/
GIT_TIMEOUT_S = 10.0

_HEADER = """\
# The config this run used (written by rlx.config.record): interpolations resolved,
# model.hf_checkpoint = the checkpoint directory loaded, run.output_dir cleared. Rerun with
#   python launch.py --config-path {out_dir} --config-name config
# (a tiny model's directory is a cache: on another machine set model.hf_checkpoint=null to rewrite it).
# Package versions, rlx's git commit and the rest: run_info.json beside this file.
"""


def write_run_config(cfg: DictConfig, out_dir: str | Path, hf_dir: str | Path) -> None:
    """Write `out_dir/config.yaml` (rerunnable) and `out_dir/run_info.json` (provenance) for a run
    of `cfg` (composed and validated) that loads the HF checkpoint at `hf_dir`."""
    out_dir, hf_dir = Path(out_dir).resolve(), Path(hf_dir).resolve()
    recorded = OmegaConf.to_container(cfg, resolve=True)
    recorded["model"]["hf_checkpoint"] = str(hf_dir)
    recorded["run"]["output_dir"] = None
    _absolute_paths(recorded["data"])
    text = OmegaConf.to_yaml({"defaults": [ROOT_SCHEMA, "_self_"], **recorded})
    (out_dir / "config.yaml").write_text(_HEADER.format(out_dir=out_dir) + text)
    info = run_info(out_dir, hf_dir, given=cfg.model.hf_checkpoint)
    (out_dir / "run_info.json").write_text(json.dumps(info, indent=2) + "\n")


def _absolute_paths(data: dict[str, Any]) -> None:
    """The prompt and eval files as absolute paths (resolved as the run read them), so that the
    recorded config reruns from any directory."""
    from rlx.data.readers import resolve

    if data.get("prompt_path"):
        data["prompt_path"] = str(resolve(data["prompt_path"]))
    for eval_set in (data.get("eval") or {}).values():
        if eval_set.get("path"):
            eval_set["path"] = str(resolve(eval_set["path"]))


def run_info(out_dir: Path, hf_dir: Path, given: str | None) -> dict[str, Any]:
    """The provenance `write_run_config` records (see the module docstring)."""
    return {
        "run_dir": str(out_dir),
        "hf_checkpoint": str(hf_dir),
        "hf_checkpoint_given": given,  # null: the tiny model, written to the cache on first use
        "rlx": {"path": str(RLX_ROOT), **git_state(RLX_ROOT)},
        "packages": package_versions(),
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "command": sys.argv,
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed version of each distribution in `names`; those not installed are left out."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def git_state(root: Path) -> dict[str, Any]:
    """{"git_commit", "git_dirty"} of the checkout at `root` (dirty: tracked files changed, untracked
    ones not counted); both None when `root` is not a git checkout or git cannot answer."""
    if not (root / ".git").exists():
        return {"git_commit": None, "git_dirty": None}
    try:
        commit = _git(root, "rev-parse", "HEAD")
        dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": dirty}


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=True
    )
    return done.stdout.strip()


def run_dir_summary(out_dir: str | Path) -> str:
    """The line a finished run ends with: its directory and what that holds (hidden entries such as
    Hydra's .hydra/ left out), with the command that shows its TensorBoard scalars."""
    out_dir = Path(out_dir).resolve()
    names = [
        p.name + ("/" if p.is_dir() else "") for p in sorted(out_dir.iterdir()) if not p.name.startswith(".")
    ]
    line = f"run directory {out_dir}: {', '.join(names) or 'empty'}"
    if (out_dir / "tensorboard").is_dir():
        line += f"; tensorboard --logdir {out_dir / 'tensorboard'}"
    return line
