"""Command-line tools around runs: `python -m rlx.tools.<name> --help`."""
