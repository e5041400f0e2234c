"""Writes that survive a crash of the machine, not only of the process: fsync of files and of folders' entries.

A file written and renamed into place can come back empty after a power loss or a kernel crash unless its data
and the folder entries naming it were synced before anything older is deleted or replaced.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

# what fsync of a folder raises on file systems that cannot sync one (some FUSE and network mounts)
CANNOT_SYNC = (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS, errno.EBADF)


def sync(path: Path) -> None:
    """fsync a file, or a folder's entries. A folder this user may write but not read, or a file system that
    cannot sync a folder, is left as it is; an I/O error is raised."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in CANNOT_SYNC:
            raise
    finally:
        os.close(fd)


def sync_folder(folder: Path) -> None:
    """Sync every file of `folder`, then its entries: what a rename will publish whole."""
    for f in Path(folder).iterdir():
        sync(f)
    sync(folder)
