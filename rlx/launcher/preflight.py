"""`python launch.py ARGS` checked by rlx before Hydra runs it: every composing error is rlx's.

Hydra reports a bad override in its own words ("Could not override 'x'. To append to your config
use +x=...", then advice to set HYDRA_FULL_ERROR=1), which names no near key and advises `+` for a
key rlx's schema lacks. `check(argv)` composes the same command line first with
`rlx.config.compose` (the same conf/, config name, search path and overrides), whose errors name
the key and where it was set (the command line, or the option file), the nearest keys or options,
and the fix. With `-m`, every value of every swept key is composed, in as many jobs as the longest
sweep has values, so a sweep with a value that cannot compose (a wrong type, an unknown option)
fails before its first job starts. The rules between keys are checked once, after this, by each
job (`rlx.launcher.job`): in a sweep a job that breaks one fails alone, and the others run.

Command lines this cannot compose as Hydra would (`--config-path`, `--config-dir`, `--help`,
`--info`, shell completion, `--experimental-rerun`) are left to Hydra.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence

from rlx.errors import ConfigError

_LEFT_TO_HYDRA = (
    "help",
    "hydra_help",
    "info",
    "shell_completion",
    "config_path",
    "config_dir",
    "experimental_rerun",
)


def check(argv: Sequence[str]) -> str | None:
    """The error message for `launch.py`'s arguments `argv` (None when they compose)."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(list(argv))  # a malformed flag: argparse's usage error
    if any(getattr(args, name, None) for name in _LEFT_TO_HYDRA):
        return None
    from rlx.config.compose import compose

    config_name = args.config_name or "config"
    try:
        jobs = job_overrides(args.overrides) if args.multirun else [args.overrides]
        for overrides in jobs:
            compose(overrides, config_name=config_name, validated=False)
    except ConfigError as e:
        where = f"job {' '.join(overrides)}: " if args.multirun and len(jobs) > 1 else ""
        return f"{where}{e}"
    return None


def job_overrides(overrides: Sequence[str]) -> list[list[str]]:
    """Jobs of a `-m` sweep that between them take every value of every swept key: job i takes
    value i of each sweep (its last value once it has fewer), so a sweep of 3 x 4 values is checked
    in 4 compositions rather than 12. An override Hydra cannot parse is a job of its own, so its
    error is reported as composing reports it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return [list(overrides)]
    choices = []
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override():
            try:
                choices.append([f"{key}={value}" for value in o.sweep_string_iterator()])
            except Exception:  # an interval sweep (a sweeper plugin's): no values to list
                continue
        else:
            choices.append([o.input_line])
    size = max((len(c) for c in choices), default=1)
    return [[c[min(i, len(c) - 1)] for c in choices] for i in range(size)]


def main_guard(argv: Sequence[str]) -> None:
    """Exit with rlx's message (status 1) when `argv` does not compose."""
    import sys

    if message := check(argv):
        sys.exit(f"error: {message}")


__all__ = ["check", "job_overrides", "main_guard"]


def import_from(directory: str, environ: MutableMapping[str, str], path: list[str]) -> None:
    """Make the modules in `directory` (the launch directory: `reward.fn=my_reward.score` beside
    the user's data) importable here (`path`, sys.path: after the checkout's own entry) and in
    the processes the run starts (`environ`'s PYTHONPATH, after the user's own entries: a one-node
    run's Ray workers inherit it), as `python -m` does for its own process alone."""
    if directory not in path:
        path.insert(1, directory)
    entries = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if directory not in entries:
        environ["PYTHONPATH"] = os.pathsep.join([*entries, directory])
