"""The errors a user can cause or fix: each carries its exit code and the prefix of its one-line message.

`main` catches `UserError` once and prints `<prefix>: <message>` on stderr. Everything else is a bug in
titan_te and keeps its traceback (exit code 1).
"""
from __future__ import annotations

import sys
import threading
from typing import Callable


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


def unreadable(path, e: OSError, key: str = "") -> DataError:
    """`[key: ]<path>: cannot be read (<why>)` for a file of the user's that the OS will not hand us."""
    return DataError(f"{key + ': ' if key else ''}{path}: cannot be read ({e.strerror or e})")


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


class Diverged(UserError):
    """A step whose loss or gradient norm is not finite (NaN / inf): every weight the optimizer then touched
    is lost, so training stops before saving them; the checkpoints before that step stay as they are."""

    exit_code = 5
    prefix = "diverged"


class Preempted(UserError):
    """Stopped by SIGTERM / SIGINT after saving; rerunning the same command resumes."""

    exit_code = 75  # EX_TEMPFAIL: "try again"
    prefix = "preempted"


class Interrupted(BaseException):
    """A stop signal before training started, or in a tool (prepare, export): exit 128 + N, one line.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    prefix = "interrupted"

    def __init__(self, signum: int, what: str):
        super().__init__(signum, what)
        self.signum, self.what = signum, what
        self.exit_code = 128 + signum

    def line(self) -> str:
        import signal

        return (f"{self.prefix}: {signal.Signals(self.signum).name} while {self.what}; nothing was saved or "
                f"changed (rerun the same command to start again)")


EXIT_CODES = {cls.exit_code: cls for cls in (ConfigError, CheckpointError, OutOfMemory, Diverged, Preempted)}


def say(line: str) -> None:
    """The one line on stderr; a closed terminal (SIGHUP) must not turn the exit code into a traceback."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


_QUIET: list[Callable] = []


def quiet_thread_failures(predicate: Callable[[threading.Thread | None, BaseException], bool]) -> None:
    """Failures of library threads that the main thread reports in its own one line (a DCP writer thread or
    TensorBoard's writer thread on a full disk): Python would print their traceback on stderr too."""
    if not _QUIET:
        default = threading.excepthook

        def hook(args):
            if args.exc_value is not None and any(q(args.thread, args.exc_value) for q in _QUIET):
                return
            default(args)

        threading.excepthook = hook
    _QUIET.append(predicate)
