"""Paths the operating system can take: checked where they are read (config options, tool arguments)."""
from __future__ import annotations

import os

from titan_te.errors import ConfigError

PATH_MAX, NAME_MAX = 4095, 255  # bytes, Linux's limits
RUN_FOLDER_ROOM = 160  # bytes the run writes below its folder (checkpoint/step-N.tmp/__R_I.distcp, tb/events...)


def check_path(key: str, value: str, where: str, room: int = 0, required: bool = False) -> None:
    """A path the operating system can take: no NUL byte, no name over 255 bytes, at most 4095 bytes in
    all with `room` bytes to spare for what the run writes below it; when `required`, not empty (an unset
    variable in a script, which would otherwise mean the current directory)."""
    where = f" {where}" if where else ""
    if required and not value:
        raise ConfigError(f"{key} is empty; it names a file or folder{where}")
    if "\0" in value:
        raise ConfigError(f"{key} = {value!r} holds a NUL character, which a file path cannot hold{where}")
    raw = os.fsencode(value)
    long = next((p for p in raw.split(b"/") if len(p) > NAME_MAX), None)
    if long is not None:
        raise ConfigError(f"{key}: the name {long[:40].decode(errors='replace')}... is {len(long)} bytes long, "
                          f"longer than a file name can be ({NAME_MAX}){where}")
    full = len(os.fsencode(os.path.abspath(value))) if value else 0
    if full + room > PATH_MAX:
        below = f"; with the {room} bytes the run writes below it" if room else ""
        raise ConfigError(f"{key}: the path is {full:,} bytes long{below}, over the limit of {PATH_MAX:,} bytes; "
                          f"choose a shorter one{where}")
