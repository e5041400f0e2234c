"""Packed, sharded, shuffled, endlessly repeating sequences behind a StatefulDataLoader.

The order is a pure function of (seed, epoch): the windows of an epoch are permuted, and each step takes
the next `global_batch` of them. They are cut into blocks of one micro-batch, dealt to data-parallel
ranks round-robin, then to loader workers round-robin (a DataLoader interleaves its workers' batches in
the same way). So the global batch of a step is the same set of sequences for any data-parallel size,
accumulation split and number of workers, and where the data stands is one global `DataPosition`:
(epoch, windows of that epoch's order consumed by all ranks together). It is saved once and resumes on
any number of ranks and workers: the run goes on with exactly the batches it would have seen.
"""
from __future__ import annotations

import gc
import re
import signal
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_te.errors import DataError, OutOfMemory
from titan_te.preemption import STOP_SIGNALS

# torch's words when a loader worker ends: from its SIGCHLD handler, with the signal's name, or from a wait
# on the data queue (no signal named)
_WORKER_DEATH = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: (Killed|Bus error)|"
                           r"DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly")
# what the kernel ends a worker with: SIGKILL (the out-of-memory killer, as a rule) or SIGBUS (its shared-memory
# segment could not grow: /dev/shm is full, 64 MB in a default container)
_KERNEL_SIGNALS = {signal.SIGKILL: "SIGKILL: the kernel's out-of-memory killer, as a rule",
                   signal.SIGBUS: "SIGBUS: out of shared memory in /dev/shm, where workers hand over their batches"}


def ended_worker(err: BaseException, loader) -> tuple[int, str] | None:
    """(pid, how) of the loader worker that the kernel ended, if `err` is torch's word for one (raised in the
    main thread, wherever that is); None for anything else (a worker that crashed keeps its traceback)."""
    m = _WORKER_DEATH.search(str(err))
    if m is None:
        return None
    if m.group(1):
        return int(m.group(1)), _KERNEL_SIGNALS[signal.SIGKILL if m.group(2) == "Killed" else signal.SIGBUS]
    # which signal: the worker's exit status (torch waits on it without reaping it)
    pids = {int(p) for p in m.group(3).replace(" ", "").split(",")}
    ended = [(w.pid, _KERNEL_SIGNALS[-w.exitcode]) for w in getattr(getattr(loader, "_iterator", None), "_workers", [])
             if w.pid in pids and w.exitcode is not None and -w.exitcode in _KERNEL_SIGNALS]
    return ended[0] if ended else None


def worker_death(err: BaseException, loader) -> OutOfMemory | None:
    """The user's one line for a loader worker that the kernel ended during training; None for anything else."""
    ended = ended_worker(err, loader)
    if ended is None:
        return None
    pid, how = ended
    return OutOfMemory(f"data-loader worker (pid {pid}) was killed ({how}); lower data.num_workers, free host "
                       f"memory or enlarge /dev/shm, then rerun the same command to resume from the newest "
                       f"checkpoint (the step it stopped in was not saved)")


@dataclass
class DataPosition:
    """Where a run stands in its data: `offset` windows of epoch `epoch`'s order are consumed."""

    epoch: int = 0
    offset: int = 0

    def normalized(self, global_batch: int, n_windows: int) -> "DataPosition":
        """An epoch with less than one global batch left is over (the tail is skipped, as in every epoch)."""
        if n_windows - self.offset < global_batch:
            return DataPosition(self.epoch + 1, 0)
        return DataPosition(self.epoch, self.offset)

    def advance(self, global_batch: int, n_windows: int) -> None:
        """After a step that consumed one global batch."""
        nxt = DataPosition(self.epoch, self.offset + global_batch).normalized(global_batch, n_windows)
        self.epoch, self.offset = nxt.epoch, nxt.offset

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


class PackedSequences(IterableDataset):
    global_position = True  # where it stands is a DataPosition, the same on every rank

    def __init__(self, source, seq_len: int, batch_size: int, dp_rank: int, dp_world: int, seed: int,
                 shuffle: bool, global_batch: int):
        self.source, self.seq_len, self.batch_size = source, seq_len, batch_size
        self.dp_rank, self.dp_world, self.global_batch = dp_rank, dp_world, global_batch
        self.seed, self.shuffle = seed, shuffle
        self.n_windows = source.num_windows(seq_len)
        if self.n_windows < global_batch:
            raise DataError(f"dataset {source.name} ({source.num_tokens:,} tokens) holds {self.n_windows} sequences "
                            f"of training.seq_len + 1 = {seq_len + 1} tokens, fewer than one global batch of "
                            f"{global_batch}; use a shorter training.seq_len, a smaller batch or more data")
        self.start = DataPosition()

    def order(self) -> dict:
        """What the order of the windows depends on: a position saved under another order means nothing."""
        return {"windows": self.n_windows, "seq_len": self.seq_len, "seed": self.seed, "shuffle": self.shuffle}

    def start_at(self, position: DataPosition) -> None:
        """Where the next iteration begins (before the loader's workers start)."""
        self.start = DataPosition(position.epoch, position.offset)

    def _rank_blocks(self, position: DataPosition) -> np.ndarray:
        """This rank's micro-batches (rows of window indices) of one epoch, from `position` on."""
        idx = np.arange(self.n_windows)
        if self.shuffle:
            idx = np.random.default_rng([self.seed, position.epoch]).permutation(self.n_windows)
        usable = (self.n_windows - position.offset) // self.global_batch * self.global_batch  # whole steps
        blocks = idx[position.offset:position.offset + usable].reshape(-1, self.batch_size)
        return blocks[self.dp_rank::self.dp_world]

    def __iter__(self):
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        position = self.start.normalized(self.global_batch, self.n_windows)
        k = 0  # this rank's micro-batches since the start, over epochs: worker k % n_workers reads the k-th
        while True:
            blocks = self._rank_blocks(position)
            for block in blocks[(worker - k) % n_workers::n_workers]:
                for i in block:
                    w = torch.from_numpy(self.source.window(int(i), self.seq_len))
                    yield {"input": w[:-1], "labels": w[1:], "epoch": position.epoch}
            k += len(blocks)
            position = DataPosition(position.epoch + 1, 0)


def stop_workers(loader) -> None:
    """Stop a loader's worker processes now. Left to the garbage collector (the trainer sits in reference
    cycles), the loader's queues could be finalized before its iterator: the workers then never got their
    stop message, and the process exit waited out their 5 s polls (11 s at the end of every run with 2
    workers)."""
    it = getattr(loader, "_iterator", None)  # a StatefulDataLoader's persistent iterator (torch-internal)
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    for w in getattr(it, "_workers", []):
        if w.is_alive():  # past its stop message and torch's SIGTERM (which workers ignore): not left behind
            w.kill()
            w.join(timeout=5)


def _workers_ignore_stop_signals(worker_id: int) -> None:
    """Each loader worker's first act (after torch's own signal handlers): ignore SIGTERM, SIGINT and SIGHUP.
    Slurm's preemption signals every process of the job step and a terminal's Ctrl-C the whole process group;
    torch's workers die of a SIGTERM their parent did not send, and the trainer then raised "DataLoader worker
    ... is killed by signal: Terminated" in the middle of its step instead of finishing it and saving. The
    trainer decides when to stop and stops its workers itself (stop_workers)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class ForkSafeLoader(StatefulDataLoader):
    """A StatefulDataLoader whose workers never collect the parent's garbage.

    Workers are forked: each starts with a copy of every object of the trainer's process, garbage not yet collected
    included. A worker's collector then runs the destructors of that garbage, and some cannot run in a forked child:
    a gloo process group's waits forever (or aborts) on a condition variable whose waiters, gloo's threads, exist
    only in the parent (the loader-start hang of the test suite, where earlier runs leave process groups in
    reference cycles). Starting the iterator, which forks the workers, with every object frozen (gc.freeze, what
    Python's documentation advises before a fork) keeps them out of the workers' collections; the parent unfreezes
    them as soon as the workers are forked. (It also unfreezes objects frozen before by anyone else.)"""

    def __iter__(self):
        gc.freeze()
        try:
            return super().__iter__()
        finally:
            gc.unfreeze()


def build_dataloader(source, seq_len: int, batch_size: int, dp_rank: int, dp_world: int, seed: int,
                     shuffle: bool, num_workers: int, pin_memory: bool,
                     global_batch: int | None = None) -> ForkSafeLoader:
    """`global_batch`: sequences per optimizer step over all ranks (default: one micro-batch per rank)."""
    global_batch = global_batch or batch_size * dp_world
    if global_batch % (batch_size * dp_world):
        raise ValueError(f"global batch {global_batch} is not a multiple of {batch_size} x {dp_world}")
    if getattr(source, "sequences", None):  # a streamed source (hf) packs its own sequences, per rank
        ds = source.sequences(seq_len, batch_size, dp_rank, dp_world, seed, shuffle)
    else:  # token sources: packed by window index here
        ds = PackedSequences(source, seq_len, batch_size, dp_rank, dp_world, seed, shuffle, global_batch)
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 calls a deprecated API
    return ForkSafeLoader(ds, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory,
                          prefetch_factor=4 if num_workers else None, persistent_workers=num_workers > 0,
                          worker_init_fn=_workers_ignore_stop_signals)
