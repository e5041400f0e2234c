"""SIGTERM / SIGINT: every rank finishes the current step, the save completes, then exit 75.

The same signal often arrives twice within moments: Slurm and a terminal's Ctrl-C signal the whole
process group, and the launcher forwards what it receives to its workers as well. Repeats within
REPEAT_WINDOW_S count as one request; a signal after that exits at once.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from titan_te.errors import Preempted

logger = logging.getLogger("titan_te")
EXIT_PREEMPTED = Preempted.exit_code
REPEAT_WINDOW_S = 3.0


def preempted(step: int, saved: bool) -> Preempted:
    return Preempted(f"stopped by a signal after step {step}"
                     + ("; checkpoint saved, rerun the same command to resume" if saved else
                        "; checkpointing is off, nothing was saved"))


class PreemptionGuard:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.flag = False
        self._first = 0.0
        self._old = {}

    def _handler(self, signum, frame):
        now = time.monotonic()
        if self.flag:
            if now - self._first < REPEAT_WINDOW_S:
                return  # the same request, delivered twice (process group + launcher)
            os._exit(128 + signum)  # asked again: no more waiting
        self.flag, self._first = True, now
        logger.warning(f"received {signal.Signals(signum).name}: finishing this step, then saving and exiting "
                       f"(send it again to exit at once)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        return False

    def requested_everywhere(self, group=None) -> bool:
        """True on every rank as soon as any rank got a signal (all ranks must save together)."""
        flag = torch.tensor([1 if self.flag else 0])  # a CPU tensor: goes over gloo on GPU runs too
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
