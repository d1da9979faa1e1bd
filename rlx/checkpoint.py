"""Run checkpoints: Megatron's distributed checkpoint plus the loop's own state, and HF exports.

Layout under the run directory:

    checkpoints/step_000009/megatron/    model + optimizer (megatron dist_checkpointing)
    checkpoints/step_000009/megatron_critic/  PPO's critic + its optimizer, beside the policy
    checkpoints/step_000009/state.json   step, policy version, data position, rollout buffer
    checkpoints/latest                   name of the newest complete checkpoint

A checkpoint is written as step_NNNNNN.partial/ and renamed when complete, and `latest` is
rewritten only after that, so a crash while saving leaves the previous one in force.

A checkpoint is code: loading one unpickles its metadata (torch distributed checkpoint's
`megatron/.metadata`, read by `pickle.load`), and unpickling runs whatever the file says. Load
only checkpoints your own runs wrote. `run.resume_from` and `rlx.tools.export` refuse, before
anything in it is read (`check_written_by_rlx`), a checkpoint whose run directory lacks rlx's run
record (`RUN_RECORD`, which `rlx.config.record` writes there at the start of every run). The record
tells a directory rlx wrote from another program's checkpoint; it is no signature, and proves
nothing of a run directory someone else hands you.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from rlx.errors import ConfigError

RUN_RECORD = ("config.yaml", "run_info.json")  # rlx.config.record's, in every run directory
# Files of a source HF directory an exported policy needs besides its weights.
_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")  # fmt: skip


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def save(trainer, run_dir: Path, step: int, state: dict[str, Any], keep: int = 0) -> Path:
    """Checkpoint the trainer and `state` (JSON) as step `step`; mark it latest; then delete all
    but the newest `keep` checkpoints (0: keep all). Written under a temporary name and renamed
    when complete, so a crash while saving never leaves a half checkpoint in force."""
    path = step_dir(run_dir, step)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a half-written earlier attempt at this step
    trainer.save(str(partial / "megatron"))
    (partial / "state.json").write_text(json.dumps(state, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(partial, path)
    latest = path.parent / "latest"
    tmp = latest.with_suffix(".tmp")
    tmp.write_text(path.name)
    os.replace(tmp, latest)
    if keep:
        done = sorted(p for p in path.parent.glob("step_*") if not p.name.endswith(".partial"))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def find_latest(resume_from: str, run_dir: Path | None = None) -> Path | None:
    """The newest complete checkpoint under a run directory or its checkpoints/ directory, or the
    checkpoint `resume_from` names itself; `resume_from="auto"`: under `run_dir`, None when it has
    none (a fresh start). Reads only `latest` and looks for `state.json`: see `check_written_by_rlx`."""
    if resume_from == "auto":
        latest = Path(run_dir) / "checkpoints" / "latest"
        return find_latest(str(run_dir)) if latest.is_file() else None
    root = Path(resume_from).expanduser().resolve()
    if (root / "state.json").is_file() and (root / "megatron").is_dir():  # one checkpoint
        return root
    for candidate in (root / "checkpoints", root):
        latest = candidate / "latest"
        if latest.is_file():
            path = candidate / latest.read_text().strip()
            if (path / "state.json").is_file():
                return path
    raise ConfigError(
        f"run.resume_from={resume_from}: no checkpoint there (expected {root}/checkpoints/latest); "
        "point it at the directory of a run that had run.save=true"
    )


def check_written_by_rlx(run_dir: Path, what: str) -> None:
    """ConfigError unless `run_dir`, the run directory of the checkpoint to load, holds rlx's run
    record (`RUN_RECORD`; run_info.json a JSON object with rlx's entry); `what` names the setting
    or tool and the checkpoint. Call before anything of the checkpoint is loaded (module docstring)."""
    run_dir = Path(run_dir)
    missing = [name for name in RUN_RECORD if not (run_dir / name).is_file()]
    if not missing:
        try:
            info = json.loads((run_dir / "run_info.json").read_text())
        except (ValueError, OSError):
            info = None
        if not (isinstance(info, dict) and "rlx" in info):
            missing = ["run_info.json as rlx writes it"]
    if missing:
        raise ConfigError(
            f"{what}: refused: {run_dir} has no {' and no '.join(missing)} (the run record rlx writes "
            "into every run directory, beside checkpoints/), so rlx did not write this checkpoint. "
            "A checkpoint is loaded with pickle (torch distributed checkpoint metadata), which runs "
            "any code its files hold: load only checkpoints your own rlx runs wrote, from their run directory"
        )


def run_dir_of(ckpt: Path) -> Path:
    """The run directory of checkpoint `ckpt` (RUN for RUN/checkpoints/step_NNNNNN)."""
    return Path(ckpt).parent.parent


def load_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "state.json").read_text())


def export_hf(trainer, out_dir: Path, source_hf_dir: Path, adapter_dir: Path | None = None) -> Path:
    """Write the trainer's policy as a loadable HF directory: weight shards + config and tokenizer
    (a LoRA policy merged); with `adapter_dir`, its LoRA adapters there too, in PEFT's format."""
    trainer.export_weights(str(out_dir))
    copy_hf_side_files(source_hf_dir, out_dir)
    if adapter_dir is not None:
        trainer.export_adapter(str(adapter_dir))
    return out_dir


def copy_hf_side_files(source_hf_dir: Path, out_dir: Path) -> None:
    """Config, generation config and tokenizer files of the source checkpoint, beside new weights."""
    for name in _HF_SIDE_FILES:
        if (Path(source_hf_dir) / name).is_file():
            shutil.copy2(Path(source_hf_dir) / name, out_dir / name)
