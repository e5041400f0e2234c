"""The folders a run writes into: one writer at a time, each made (or refused) in one line, and the log.

A `FolderLock` is an `flock` on `<folder>/.lock`, held by rank 0 for the life of the trainer (or of a
tool such as prepare). The kernel drops it when the process dies, however it dies, so a lock left by a
dead holder is simply taken over; the file names the holder (host, PID, start time, what it is) for
the message a second writer gets. A run locks its run folder and its checkpoint folder (which may lie
outside the run folder and be named by another run too).

`make_folder` is the one place where an OSError on a folder the run owns (a file in the way, a full
or read-only disk, a path too long) becomes a `config error:` line instead of a traceback.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from titan_te.errors import ConfigError, UserError
from titan_te.logging_setup import SignalErrorsPass

logger = logging.getLogger("titan_te")
LOCK = ".lock"


def why(e: OSError) -> str:
    """What an OSError on a folder means, in words."""
    text = e.strerror or str(e)
    if e.errno in (errno.EEXIST, errno.ENOTDIR):
        return f"{text}: a file is in the way"
    return text


def make_folder(path: Path, what: str, fix: str, error: type[UserError] = ConfigError) -> Path:
    """`path` created and proved writable, or one line (`error`) naming `what` and how to `fix` it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise error(f"{what} {path} cannot be created or written ({why(e)}); {fix}") from None
    return path


class FolderLock:
    """One writer at a time for `folder` (`what` names it in messages: "run folder", "checkpoint.folder")."""

    def __init__(self, folder: Path, what: str, fix: str, holder: str = "", error: type[UserError] = ConfigError):
        self.folder, self.what, self.fix, self.holder, self.error = Path(folder), what, fix, holder, error
        self._fd: int | None = None

    def acquire(self) -> None:
        make_folder(self.folder, self.what, self.fix, self.error)
        try:
            fd = os.open(self.folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise self.error(f"{self.what} {self.folder}: cannot create {LOCK} ({why(e)}); {self.fix}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise self.error(f"{self.what} {self.folder} is in use by another trainer ({holder}); wait for it "
                             f"to finish, stop it, or {self.fix}") from None
        except OSError as e:  # a file system without locks
            os.close(fd)
            raise self.error(f"{self.what} {self.folder}: cannot lock {LOCK} ({e.strerror or e}); use a local "
                              f"or lock-capable file system") from None
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                "holder": self.holder}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except OSError as e:  # a full disk: the lock is held, but nothing else could be written there
            os.close(fd)
            raise self.error(f"{self.what} {self.folder}: cannot write {LOCK} ({why(e)}); free space there or "
                              f"{self.fix}") from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        what = f", {info['holder']}" if info.get("holder") else ""
        return f"host {info['host']}, PID {info['pid']}, since {info['since']}{what}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"


class LineFlushingFileHandler(SignalErrorsPass, logging.FileHandler):
    """The run's log file: every line is on disk as soon as it is logged (a kill -9 loses nothing). A
    log file that stops taking lines (a full disk) is dropped with one warning on the console: the
    console keeps every line, and a run is never stopped by its own log."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self.stream is None:
                self.stream = self._open()
            logging.StreamHandler.emit(self, record)
            self.flush()
        except OSError as e:
            self._give_up(e)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 -- logging's name
        import sys

        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            self._give_up(err)
        else:  # a signal's error goes on (SignalErrorsPass); a formatting bug of ours: logging's own report
            super().handleError(record)

    def _give_up(self, e: OSError) -> None:
        log = logging.getLogger("titan_te")
        if self in log.handlers:
            log.removeHandler(self)
            log.warning(f"the run's log file {self.baseFilename} cannot be written ({why(e)}); its lines go to the "
                        f"console only from now on")


def attach_log_file(folder: Path, rank: int) -> Path:
    """Every rank logs everything (INFO and up) to `<run>/logs/rank<R>.log`, whatever LOG_RANK prints."""
    logs = make_folder(Path(folder) / "logs", "the run's log folder", "free space there or choose another "
                                                                      "--job.dump_folder")
    path = logs / f"rank{rank}.log"
    try:
        handler = LineFlushingFileHandler(path, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"the run's log file {path} cannot be opened ({why(e)}); choose another "
                          f"--job.dump_folder") from None
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    log = logging.getLogger("titan_te")
    # the file first: a line seen on the console is already on disk, even if the job is killed right after
    log.handlers = [handler] + [h for h in log.handlers if not isinstance(h, LineFlushingFileHandler)]
    log.setLevel(logging.INFO)  # the console handler keeps its own level
    return path


def detach_log_file() -> None:
    log = logging.getLogger("titan_te")
    for h in [h for h in log.handlers if isinstance(h, LineFlushingFileHandler)]:
        try:
            h.close()
        except OSError:
            pass
        log.removeHandler(h)


def log_to_file(text: str) -> None:
    """A line for the run's log file only (the console shows it another way, e.g. on stderr)."""
    log = logging.getLogger("titan_te")
    for h in log.handlers:
        if isinstance(h, LineFlushingFileHandler):
            h.emit(logging.LogRecord("titan_te", logging.ERROR, __file__, 0, text, None, None))
