"""Run a server module with the API key from its environment, not from its command line.

    RLX_ENGINE_API_KEY=KEY python -m rlx.rollout.keyed_launch MODULE ARGS...

runs `python -m MODULE ARGS... --api-key=KEY` in this process, the key taken out of the environment
first. SGLang's server and sglang-router take their key as a flag only, and a process's command
line is readable by every user of the machine (`ps`), its environment only by its owner; a key on
the command line would also reach every error message that quotes the command.
"""

from __future__ import annotations

import os
import runpy
import sys

from rlx.ports import API_KEY_ENV


def main(argv: list[str] | None = None) -> None:
    module, *args = sys.argv[1:] if argv is None else argv
    key = os.environ.pop(API_KEY_ENV, "")
    if not key:
        raise SystemExit(f"rlx.rollout.keyed_launch: {API_KEY_ENV} is not set, no key to hand to {module}")
    sys.argv = [module, *args, f"--api-key={key}"]  # joined: a key may start with "-"
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
