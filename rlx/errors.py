"""Errors that are the user's to fix: the launcher prints them as one clean message, no traceback."""

from __future__ import annotations


class UserError(Exception):
    """A user's mistake (config, data, paths); its message says what is wrong and how to fix it."""


class ConfigError(UserError, ValueError):
    """The composed config is invalid: unknown or mistyped keys, broken cross-group rules."""


class DataError(UserError):
    """A data file is missing or has bad rows; the message names the file, line and key."""


class CheckpointError(UserError):
    """A checkpoint directory is unusable: another family or shape, missing, truncated or corrupt
    weight files, a tokenizer that does not fit the vocabulary; the message names the file and fix."""


class Stopped(Exception):
    """The run stopped on SIGTERM/SIGINT after finishing a step (and checkpointing it); the
    launcher exits with 128 + `signum`, as a process killed by the signal would."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class StoppedNow(KeyboardInterrupt):
    """A second SIGTERM/SIGINT: the run stops at once, the step in progress unfinished (its
    requests cancelled, every process ended); a KeyboardInterrupt, so that no `except Exception`
    on the way holds it. The launcher prints the message and exits with 128 + `signum`."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
