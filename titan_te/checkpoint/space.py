"""Does a checkpoint fit its disk? The size of one save, computed from the state before anything is written.

The size is what the saved tensors occupy (each rank its own shards; a tensor subclass such as an FP8
weight counts the plain tensors it holds) plus the pickled per-rank parts; DCP adds a few kB of
metadata. A run whose single checkpoint does not fit the free space of its folder is refused before it
trains; one whose `keep_latest_k` (or, keeping all, every save it will make) does not fit is warned.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


def tensor_bytes(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t._local_tensor
    if type(t) not in (torch.Tensor, torch.nn.Parameter):  # a wrapper subclass: the plain tensors inside it
        inner = [v for v in vars(t).values() if isinstance(v, torch.Tensor)]
        if inner:
            return sum(tensor_bytes(v) for v in inner)
    return t.numel() * t.element_size()


def state_bytes(obj) -> int:
    """Bytes a (nested) state dict puts on disk, roughly: tensors, byte strings; other values are small."""
    if isinstance(obj, torch.Tensor):
        return tensor_bytes(obj)
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def saves_left(start: int, total: int, interval: int) -> int:
    """How many saves a run from step `start` to `total` makes: every `interval` steps and the last one."""
    if start >= total:
        return 0
    return total // interval - start // interval + (0 if total % interval == 0 else 1)


def human(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{math.ceil(n / 1e3):,} kB"
