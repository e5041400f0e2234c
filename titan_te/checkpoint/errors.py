"""Which save failures a run may survive, and one-line descriptions of DCP's errors.

Only environmental I/O failures are survivable (disk full, I/O error, permission denied, a read-only or
vanished folder), and only a bounded number of times in a row. Anything else raised while saving is a
bug in titan_te and stops the run with its traceback.
"""
from __future__ import annotations

import errno
import pickle
import re

from torch.distributed.checkpoint.api import CheckpointException

from titan_te.checkpoint.integrity import ChecksumMismatch

ENVIRONMENTAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EACCES, errno.EPERM, errno.EROFS,
                        errno.ENOENT, errno.ENOTDIR, errno.ESTALE, errno.EFBIG, errno.ENODEV}


def causes(err: BaseException) -> list[BaseException]:
    """The underlying exceptions: DCP's CheckpointException carries one per failed rank."""
    if isinstance(err, CheckpointException) and err.failures:
        out = []
        for wrapped in err.failures.values():
            out += causes(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
        return out
    return [err]


def _environmental_oserror(err: BaseException | None) -> OSError | None:
    """The OSError of the environment in `err`'s chain: itself, its cause, or the error it was raised while
    handling (torch's zip writer turns ENOSPC into `RuntimeError: ... unexpected pos ...` whose
    __context__, not __cause__, is the OSError)."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno in ENVIRONMENTAL_ERRNOS:
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def environmental_cause(err: BaseException) -> OSError | None:
    """The OSError of the environment behind `err` (for the one line a user reads), if there is one."""
    return next(filter(None, map(_environmental_oserror, causes(err))), None)


# torch's zip writer when the file system took fewer bytes than it wrote (disk full, quota, I/O error); its
# OSError is only the exception's __context__, which DCP loses when it sends a rank's failure to the others
ZIP_WRITE_FAILED = re.compile(r"unexpected pos \d+ vs \d+")


def write_failed(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and bool(ZIP_WRITE_FAILED.search(str(err)))


def is_environmental(err: BaseException) -> bool:
    found = causes(err)
    return bool(found) and all(_environmental_oserror(e) is not None or write_failed(e) for e in found)


# what reading damaged checkpoint data raises (besides OSError): torch's readers' own words included
DATA_ERRORS = (OSError, EOFError, pickle.UnpicklingError, UnicodeDecodeError, ChecksumMismatch)
READER_WORDS = re.compile(r"PytorchStreamReader|zip archive|central directory|unexpected EOF|Weights only load")


def is_unreadable_data(err: BaseException) -> bool:
    """Whether `err` (DCP's CheckpointException: every rank's cause) is damaged data, not a bug of ours."""
    found = causes(err)
    return bool(found) and all(isinstance(e, DATA_ERRORS) or (isinstance(e, RuntimeError) and
                                                             READER_WORDS.search(str(e))) for e in found)


def describe(err: BaseException) -> str:
    """One line for an error; DCP's CheckpointException is reduced to its first rank's cause, and an
    error raised while handling an OSError of the environment (disk full ...) to that OSError."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, wrapped = sorted(err.failures.items())[0]
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {describe(cause)}"
    env = environmental_cause(err) if not isinstance(err, OSError) else None
    if env is not None:
        return describe(env)
    if isinstance(err, OSError) and err.errno is not None and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        return f"{type(err).__name__}: [Errno {err.errno}] {err.strerror}{where}"
    text = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
