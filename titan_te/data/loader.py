"""Packed, sharded, shuffled, endlessly repeating sequences behind a StatefulDataLoader.

The order is a pure function of (seed, epoch): window indices are permuted per epoch and cut into
blocks of one micro-batch; blocks are dealt to data-parallel ranks round-robin, then to loader
workers round-robin (a DataLoader interleaves its workers' batches in the same way). So the global
batch of a step is the same set of sequences for any data-parallel size and accumulation split. The dataset's state is
(epoch, position); StatefulDataLoader saves it per worker, so a restored loader yields exactly the
batches an uninterrupted run would have seen next.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_te.errors import DataError


class PackedSequences(IterableDataset):
    def __init__(self, source, seq_len: int, batch_size: int, dp_rank: int, dp_world: int, seed: int,
                 shuffle: bool):
        self.source, self.seq_len, self.batch_size = source, seq_len, batch_size
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.seed, self.shuffle = seed, shuffle
        self.n_windows = source.num_windows(seq_len)
        if self.n_windows < dp_world * batch_size:
            raise DataError(f"dataset {source.name} ({source.num_tokens:,} tokens) holds {self.n_windows} sequences "
                            f"of training.seq_len + 1 = {seq_len + 1} tokens, fewer than one micro-batch on every "
                            f"rank ({dp_world} x {batch_size}); use a shorter training.seq_len, a smaller "
                            f"local_batch_size or more data")
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int, worker: int, n_workers: int) -> np.ndarray:
        idx = np.arange(self.n_windows)
        if self.shuffle:
            idx = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        per_round = self.batch_size * self.dp_world  # equal whole blocks for every rank
        blocks = idx[: (self.n_windows // per_round) * per_round].reshape(-1, self.batch_size)
        return blocks[self.dp_rank::self.dp_world][worker::n_workers].reshape(-1)

    def __iter__(self):
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        while True:
            order = self._order(self.epoch, worker, n_workers)
            while self.position < len(order):
                w = torch.from_numpy(self.source.window(int(order[self.position]), self.seq_len))
                self.position += 1
                yield {"input": w[:-1], "labels": w[1:], "epoch": self.epoch}
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def build_dataloader(source, seq_len: int, batch_size: int, dp_rank: int, dp_world: int, seed: int,
                     shuffle: bool, num_workers: int, pin_memory: bool) -> StatefulDataLoader:
    # A streamed source (hf) packs its own sequences; token sources are packed by window index here.
    make = getattr(source, "sequences", None) or (lambda *a: PackedSequences(source, *a))
    ds = make(seq_len, batch_size, dp_rank, dp_world, seed, shuffle)
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 calls a deprecated API
    return StatefulDataLoader(ds, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory,
                              prefetch_factor=4 if num_workers else None,
                              persistent_workers=num_workers > 0)
