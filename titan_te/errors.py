"""The errors a user can cause or fix: each carries its exit code and the prefix of its one-line message.

`main` catches `UserError` once and prints `<prefix>: <message>` on stderr. Everything else is a bug in
titan_te and keeps its traceback (exit code 1).
"""
from __future__ import annotations


class UserError(Exception):
    """A mistake or condition the user can act on; never shown with a traceback."""

    exit_code = 1
    prefix = "error"

    def __init__(self, msg: str):
        super().__init__(msg)
        self.msg = msg

    def __reduce__(self):  # survives the trip from a DataLoader worker or a child process
        return (type(self), (self.msg,))

    def line(self) -> str:
        text = " ".join(str(self.msg).split("\n"))
        return f"{self.prefix}: {text}"


class ConfigError(UserError):
    """A mistake in the config file, the command line or the launcher's environment."""

    exit_code = 2
    prefix = "config error"


class DataError(ConfigError):
    """Bad input data (a missing path, an empty dataset, bad UTF-8, a corrupt shard ...)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be written or read; the message says what to do."""

    exit_code = 3
    prefix = "checkpoint error"


class OutOfMemory(UserError):
    """The run does not fit the memory of the device; the message says what to change."""

    exit_code = 4
    prefix = "out of memory"


class ExportError(UserError):
    """A mistake in the input of `python -m titan_te.export`."""

    exit_code = 2
    prefix = "export error"


class Preempted(UserError):
    """Stopped by SIGTERM / SIGINT after saving; rerunning the same command resumes."""

    exit_code = 75  # EX_TEMPFAIL: "try again"
    prefix = "preempted"


EXIT_CODES = {cls.exit_code: cls for cls in (ConfigError, CheckpointError, OutOfMemory, Preempted)}
