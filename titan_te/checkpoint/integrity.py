"""Checksums of checkpoint files: recorded in the manifest as a save is written, verified before a load.

DCP keeps none, so a flipped bit in a `.distcp`, or a `.distcp` copied in from another step, would load
silently. Each rank checksums the files it wrote itself (CRC32 of 64 MiB pieces, one thread per core;
zlib releases the GIL), right after writing them, while they are still in the page cache; every rank
gets the whole list, which rank 0 writes into the manifest. On load every rank verifies its share of
the files, and a mismatch names the file.
"""
from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

CHUNK = 64 * 2**20  # checksummed apart, so that one big file is read by many threads at once
METADATA = ".metadata"


class ChecksumMismatch(Exception):
    """A checkpoint file that is not what was saved (its message names the file)."""


def _chunk_crc(path: Path, offset: int, size: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        crc, done = 0, 0
        while done < size:
            data = os.pread(fd, min(CHUNK // 4, size - done), offset + done)
            if not data:
                raise EOFError(f"{path.name} ended at {offset + done:,} bytes")
            crc, done = zlib.crc32(data, crc), done + len(data)
        return crc
    finally:
        os.close(fd)


def checksums(paths: list[Path], threads: int = 0) -> dict[str, list[int]]:
    """{name: [size, checksum]}: the CRC32 of the CRC32s of each 64 MiB piece, the pieces of all files read
    by `threads` threads (default: one per CPU core, at most 32)."""
    sizes = {p: p.stat().st_size for p in paths}
    pieces = [(p, off, min(CHUNK, sizes[p] - off)) for p in paths for off in range(0, max(sizes[p], 1), CHUNK)]
    with ThreadPoolExecutor(threads or min(32, os.cpu_count() or 1)) as pool:
        crcs = list(pool.map(lambda piece: _chunk_crc(*piece), pieces))
    out: dict[str, list[int]] = {}
    for (p, _, _), crc in zip(pieces, crcs):
        size, acc = out.get(p.name, [sizes[p], 0])
        out[p.name] = [size, zlib.crc32(crc.to_bytes(4, "little"), acc)]
    return out


def own_files(folder: Path, rank: int) -> list[Path]:
    """The files rank `rank` wrote in a DCP folder: its `__<rank>_*.distcp`, and `.metadata` on rank 0."""
    mine = sorted(Path(folder).glob(f"__{rank}_*.distcp"))
    return mine + ([Path(folder) / METADATA] if rank == 0 else [])


def record(folder: Path, group) -> dict[str, list[int]]:
    """After a save: {file: [size, checksum]} of every file of the checkpoint, on every rank of `group`."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    mine = checksums(own_files(folder, rank))
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return mine
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return {name: value for part in everyone for name, value in part.items()}


def verify(folder: Path, recorded: dict[str, list[int]], group, only: str | None = None) -> None:
    """Raise ChecksumMismatch naming the first file that differs from `recorded` (missing, changed, or a
    `.distcp` the save did not write); `only`: that one file. Each rank reads its share of the files."""
    if not recorded:  # a checkpoint of an older titan_te, or checkpoint.verify_checksums = false
        return
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    names = sorted(recorded) if only is None else [only] if only in recorded else []
    problems = []
    if rank == 0 and only is None:
        extra = sorted(p.name for p in Path(folder).glob("*.distcp") if p.name not in recorded)
        problems += [f"{name} was not written by this save (copied in from another checkpoint?)" for name in extra]
    share = [Path(folder) / n for n in names[rank::world]]
    missing = [p for p in share if not p.is_file()]
    problems += [f"{p.name} is missing" for p in missing]
    found = checksums([p for p in share if p not in missing])
    problems += [f"{name} differs from what was saved ({value[0]:,} bytes, checksum {value[1]:08x}; saved "
                 f"{recorded[name][0]:,} bytes, {recorded[name][1]:08x}): a damaged file, or one copied from another "
                 f"checkpoint" for name, value in found.items() if list(value) != list(recorded[name])]
    if dist.is_initialized() and world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, problems, group=group)
        problems = [p for part in everyone for p in part]
    if problems:
        raise ChecksumMismatch(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
