"""SIGTERM / SIGINT: finish the current step, save, exit with EXIT_PREEMPTED; a second signal exits at once."""
from __future__ import annotations

import logging
import os
import signal
import threading

import torch
import torch.distributed as dist

logger = logging.getLogger("titan_te")
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again" -- rerunning the same command resumes


class Preempted(Exception):
    def __init__(self, step: int, saved: bool):
        self.step, self.saved = step, saved
        super().__init__(f"stopped by a signal after step {step}"
                         + ("; checkpoint saved, rerun the same command to resume" if saved else
                            "; checkpointing is off, nothing was saved"))


class PreemptionGuard:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.flag = False
        self._old = {}

    def _handler(self, signum, frame):
        if self.flag:  # second signal: no more waiting
            os._exit(128 + signum)
        self.flag = True
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

    def requested_everywhere(self) -> bool:
        """True on every rank as soon as any rank got a signal (all ranks must save together)."""
        flag = torch.tensor([1 if self.flag else 0])  # a CPU tensor: goes over gloo on GPU runs too
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
