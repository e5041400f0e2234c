"""Which save failures a run may survive, and one-line descriptions of DCP's errors.

Only environmental I/O failures are survivable (disk full, I/O error, permission denied, a read-only or
vanished folder), and only a bounded number of times in a row. Anything else raised while saving is a
bug in titan_te and stops the run with its traceback.
"""
from __future__ import annotations

import errno

from torch.distributed.checkpoint.api import CheckpointException

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


def is_environmental(err: BaseException) -> bool:
    found = causes(err)
    return bool(found) and all(_environmental_oserror(e) is not None for e in found)


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
