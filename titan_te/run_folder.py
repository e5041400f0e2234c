"""The run folder `<job.dump_folder>/<job.name>/`: one trainer at a time, and the run's own log.

The lock is an `flock` on `<run>/.lock`, held by rank 0 for the life of the trainer. The kernel drops
it when the process dies, however it dies, so a lock left by a dead trainer is simply taken over; the
file names the holder (host, PID, start time) for the message a second trainer gets.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from titan_te.errors import ConfigError

logger = logging.getLogger("titan_te")
LOCK = ".lock"


class RunFolderLock:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"run folder {self.folder} cannot be created or written ({e.strerror or e}); "
                              f"choose another --job.dump_folder or --job.name") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(f"run folder {self.folder} is in use by another trainer ({holder}); wait for it "
                              f"to finish, stop it, or choose another --job.name") from None
        except OSError as e:  # a file system without locks
            os.close(fd)
            raise ConfigError(f"run folder {self.folder}: cannot lock {LOCK} ({e.strerror or e}); use a local "
                              f"or lock-capable file system for job.dump_folder") from None
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {info['host']}, PID {info['pid']}, since {info['since']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"


class LineFlushingFileHandler(logging.FileHandler):
    """The run's log file: every line is on disk as soon as it is logged (a kill -9 loses nothing)."""

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        self.flush()


def attach_log_file(folder: Path, rank: int) -> Path:
    """Every rank logs everything (INFO and up) to `<run>/logs/rank<R>.log`, whatever LOG_RANK prints."""
    path = Path(folder) / "logs" / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = LineFlushingFileHandler(path, encoding="utf-8")
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
        h.close()
        log.removeHandler(h)


def log_to_file(text: str) -> None:
    """A line for the run's log file only (the console shows it another way, e.g. on stderr)."""
    log = logging.getLogger("titan_te")
    for h in log.handlers:
        if isinstance(h, LineFlushingFileHandler):
            h.emit(logging.LogRecord("titan_te", logging.ERROR, __file__, 0, text, None, None))
