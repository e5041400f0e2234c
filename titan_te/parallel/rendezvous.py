"""Rendezvous: every rank of the job meets rank 0 within a short, stated time, or one line says who did not.

torch's own env:// rendezvous waits for the collective timeout (30 minutes by default) and then raises
an error that names nothing; meanwhile its client prints a warning twenty times a second. Here rank 0
opens the TCPStore, every rank checks in under its rank number, and rank 0 waits at most
`parallelism.rendezvous_timeout_s`: after that the message names the nodes (and ranks) that never came.
The store is then handed to `init_process_group`.

A plain `python train.py` (no RANK in the environment) is a group of one on a port the kernel picks.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from titan_te.errors import ConfigError
from titan_te.head_address import check_head_address

logger = logging.getLogger("titan_te")
JOINED, GO = "titan_te/joined", "titan_te/go"
POLL_S = 0.1
ATTEMPT_S = 3.0


def _env_int(name: str, low: int, high: int | None = None) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} in the environment is not a whole number") from None
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{name}={value} in the environment must be within [{low}, {high if high is not None else 'inf'}]")
    return value


STALE = ("if no other process of this job is running, RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT are left in "
         "the environment from another job: unset them, or start with ./run_train.sh")


def join(timeout_s: int) -> tuple[dist.Store, int, int]:
    """(store, rank, world size) once every rank has checked in; a ConfigError line otherwise."""
    if "RANK" not in os.environ or os.environ.get("WORLD_SIZE", "").strip() == "1":
        # a group of one: on a port the kernel picks, which no other job can take meanwhile
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(store.port))
        return store, 0, 1
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0, world - 1)
    if os.environ.get("LOCAL_RANK", "").strip():  # init_distributed picks the GPU by it
        _env_int("LOCAL_RANK", 0, world - 1)
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not addr or not port:
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world} are set in the environment, MASTER_ADDR / MASTER_PORT "
                          f"are not; {STALE}")
    port_n = _env_int("MASTER_PORT", 1, 65535)
    where = f"{addr}:{port_n}"
    store = _open_store(addr, port_n, rank, world, timeout_s, where)
    _claim(store, rank, world, where)
    store.add(JOINED, 1)
    if rank == 0:
        _wait_for_everyone(store, world, timeout_s, where)
    else:
        _wait_for_go(store, rank, world, timeout_s, where)
    return store, rank, world


def _open_store(addr: str, port: int, rank: int, world: int, timeout_s: int, where: str):
    """Rank 0 listens; the others connect, in attempts of a few seconds so that a Ctrl-C is answered (a
    signal waits for a C++ call to return) and with torch's C++ log lines of each failed try kept off the
    console."""
    deadline = time.monotonic() + timeout_s
    while True:
        attempt = max(1.0, min(ATTEMPT_S, deadline - time.monotonic()))
        try:
            with _quiet_stderr():
                return dist.TCPStore(addr, port, None, rank == 0, timeout=timedelta(seconds=attempt),
                                     wait_for_workers=False)
        except (dist.DistNetworkError, dist.DistStoreError, RuntimeError) as e:
            if rank == 0:
                check_head_address(addr)
                raise ConfigError(f"rank 0 cannot listen at {where} ({_first_line(e)}): another job holds the "
                                  f"port; choose another MASTER_PORT (./run_train.sh picks a free one on one node)") \
                    from None
            if time.monotonic() >= deadline:
                raise ConfigError(f"rank {rank} of {world} could not reach rank 0 at {where} within {timeout_s} s "
                                  f"(parallelism.rendezvous_timeout_s): the head node is not up or MASTER_ADDR / "
                                  f"MASTER_PORT point elsewhere; {STALE}") from None


def _claim(store, rank: int, world: int, where: str) -> None:
    """Check in as `rank`, once: a second process with the same rank (two nodes given one NODE_RANK, or a rank
    of another job on the same MASTER_ADDR / MASTER_PORT) is refused in one line instead of both joining one
    process group, and so is a rank that finds the rendezvous already over (another job is running there)."""
    if rank and store.check([GO]):
        raise ConfigError(f"rank {rank} of {world}: the job at {where} had already started when this rank came: "
                          f"another job is running at that MASTER_ADDR / MASTER_PORT; give this job its own "
                          f"MASTER_PORT (the same on every node)")
    me = f"{socket.gethostname()} (pid {os.getpid()})"
    holder = store.compare_set(f"{JOINED}/{rank}", "", me).decode()  # sets it only if no one has
    if holder != me:
        raise ConfigError(f"rank {rank} of {world} already joined rank 0 at {where} from {holder}: two nodes were "
                          f"given the same NODE_RANK, or another job uses that MASTER_ADDR / MASTER_PORT; give "
                          f"every node its own NODE_RANK (0 .. NNODES-1) and every job its own MASTER_PORT")


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for the duration (C++ writes there directly, past sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _wait_for_everyone(store, world: int, timeout_s: int, where: str) -> None:
    if world > 1:
        logger.info(f"rendezvous: waiting up to {timeout_s} s for {world} ranks at {where} "
                    f"(parallelism.rendezvous_timeout_s)")
    deadline = time.monotonic() + timeout_s
    while store.add(JOINED, 0) < world:
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if not store.check([f"{JOINED}/{r}"])]
            raise ConfigError(f"the job did not start: {_who(missing, world)} did not join rank 0 at {where} within "
                              f"{timeout_s} s (parallelism.rendezvous_timeout_s); start the launcher on every node "
                              f"(NNODES, NODE_RANK) with the same MASTER_ADDR and MASTER_PORT") from None
        time.sleep(POLL_S)  # Python-level sleep: a Ctrl-C is answered at once
    store.set(GO, "1")


def _wait_for_go(store, rank: int, world: int, timeout_s: int, where: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not _go(store, rank, where):
        if time.monotonic() > deadline:
            raise ConfigError(f"rank {rank}: the other ranks of this job did not all join rank 0 at {where} within "
                              f"{timeout_s} s (parallelism.rendezvous_timeout_s); rank 0's log names them") from None
        time.sleep(POLL_S)


def _go(store, rank: int, where: str) -> bool:
    """Whether rank 0 has said go; a line if rank 0 has gone (it gave up on a rank that never came, or stopped)."""
    try:
        return store.check([GO])
    except (dist.DistNetworkError, dist.DistStoreError):
        raise ConfigError(f"rank {rank}: rank 0 at {where} stopped before every rank had joined (rank 0's log says "
                          f"why, e.g. the node that never came)") from None


def _who(missing: list[int], world: int) -> str:
    """'node 1 (rank 1)' / 'nodes 1, 2 (ranks 8-23)' from the launcher's ranks per node."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    ranks = _span(missing)
    if per_node <= 0 or world % per_node:
        return f"rank{'s' if len(missing) > 1 else ''} {ranks} of {world}"
    nodes = sorted({r // per_node for r in missing})
    return (f"node{'s' if len(nodes) > 1 else ''} {_span(nodes)} of {world // per_node} "
            f"(rank{'s' if len(missing) > 1 else ''} {ranks})")


def _span(xs: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
