"""Every `python launch.py ...` command in README.md and docs/*.md composes and validates, so a
reader who copies one gets a run, not a config error. CPU, compose only (nothing is run).

A command is taken from a code line (indented four spaces, or inside a ``` fence) from
`python launch.py` to the end of the line, or from an inline code span; a trailing backslash joins
the next line; the line is split as a shell would (`shlex`, so `# comments` go). Flags are Hydra's:
`-m` (multirun) expands each comma sweep into its jobs, every one composed; `--cfg job` only prints
the config, so the overrides after it are composed as well. Nothing is skipped.

What may fail is narrow and listed in `READER_SUPPLIES`: a problem about a file or directory the
reader brings (a prompt or eval file, an HF checkpoint directory, a run directory to replay) or
SGLang itself, which this machine cannot install (`pip install '.[sglang]'` on a GPU machine). Every
other problem fails the test. `DELIBERATE` lists the commands the docs show failing on purpose (the
time a config error takes), and they must still fail with the key they are about.
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from rlx.config.compose import compose
from rlx.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LAUNCH = "python launch.py"

READER_SUPPLIES = {  # a problem the reader fixes by bringing the thing, not by editing the command
    "prompt file": re.compile(r"^data\.(eval\.\w+\.path|prompt_path)='[^']+': no such file \("),
    "HF checkpoint directory": re.compile(r"^model\.hf_checkpoint='[^']+' is not a directory \("),
    "Hugging Face repo not in this machine's cache": re.compile(
        r"^model\.hf_checkpoint='[\w.-]+/[\w.-]+' is neither a local directory \(.*nor a Hugging Face repo in the cache"
    ),
    "run directory with dumped rollouts": re.compile(
        r"^debug\.load_rollouts='[^']+': no rollouts/step_NNNNNN\.jsonl there"
    ),
    "SGLang (not installable here)": re.compile(
        r"^rollout\.server_module=sglang\.launch_server is not installed"
    ),
}
DELIBERATE = {  # command overrides -> the key its error must name (docs/benchmarks.md times them)
    "train.global_batch_size=100": "train.global_batch_size",
    "rollout.batch_szie=4": "rollout.batch_szie",
}


def doc_commands() -> list[tuple[str, str]]:
    """(where, the overrides after `python launch.py`) for every command in the docs."""
    commands = []
    for doc in DOCS:
        lines, fenced = doc.read_text().splitlines(), False
        i = 0
        while i < len(lines):
            line, where = lines[i], f"{doc.name}:{i + 1}"
            fenced ^= line.lstrip().startswith("```")
            spans = re.findall(r"`([^`]*" + re.escape(LAUNCH) + r"[^`]*)`", line)
            if fenced or line.startswith("    "):
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                spans = [line] if LAUNCH in line else []
            commands += [(where, span.split(LAUNCH, 1)[1].strip()) for span in spans]
            i += 1
    return commands


COMMANDS = doc_commands()


def jobs(args: str) -> list[list[str]]:
    """The override lists a command composes: one, or with -m one per point of its sweeps."""
    words = shlex.split(args, comments=True)
    multirun = "-m" in words or "--multirun" in words
    if "--cfg" in words:  # `--cfg job|hydra|all` prints the config it composes
        del words[words.index("--cfg") : words.index("--cfg") + 2]
    words = [w for w in words if w not in ("-m", "--multirun")]
    assert all(not w.startswith("-") for w in words), f"a flag this test does not know: {args}"
    if not multirun:
        return [words]
    choices = []
    for override in OverridesParser.create().parse_overrides(words):
        if override.is_sweep_override():
            values = override.sweep_string_iterator()
            choices.append([f"{override.get_key_element()}={value}" for value in values])
        else:
            choices.append([override.input_line])
    return [list(job) for job in itertools.product(*choices)]


def problems(error: ConfigError) -> list[str]:
    text = str(error)
    if not text.startswith("invalid config ("):
        return [text]
    return [item.strip() for item in text.split("\n  - ")[1:]]


def test_the_docs_have_commands():
    assert len(COMMANDS) >= 40
    assert any(args == "" for _, args in COMMANDS)  # the default job


@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=[f"{w} {a}"[:90] for w, a in COMMANDS])
def test_every_doc_command_composes(where, args):
    for overrides in jobs(args):
        try:
            compose(overrides)
        except ConfigError as e:
            if args in DELIBERATE:
                assert DELIBERATE[args] in str(e)
                continue
            theirs = [p for p in problems(e) if not any(r.search(p) for r in READER_SUPPLIES.values())]
            assert not theirs, f"{where}: python launch.py {' '.join(overrides)}\n" + "\n".join(theirs)
        else:
            assert args not in DELIBERATE, f"{where}: {args} was meant to fail"
