"""An optimizer with a bug on one rank (`--job.custom_import=bug_opt --optimizer.name=bug_sgd`): SGD, except
that on rank `[optimizer.bug_sgd] on_rank` the update of step `at_step` divides by zero. For the test that a
bug keeps its traceback on the console when the other ranks only lost the rank it ended."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from titan_te.config.schema import NON_NEGATIVE, opt
from titan_te.optim import OPTIMIZERS, OptimizerSpec


@dataclass
class BugOptions:
    at_step: int = opt(0, "the step whose update fails (0: never)", bounds=NON_NEGATIVE)
    on_rank: int = opt(1, "the rank it fails on", bounds=NON_NEGATIVE)


class BugSGD(torch.optim.SGD):
    def __init__(self, params, lr: float, at_step: int, on_rank: int):
        super().__init__(params, lr=lr)
        self.at_step, self.on_rank, self.steps = at_step, on_rank, 0

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        if self.param_groups[0]["lr"] == 0:  # torch's state-dict helper steps an optimizer without state at lr 0
            return
        self.steps += 1
        if self.steps == self.at_step and int(os.environ.get("RANK", "0")) == self.on_rank:
            self.steps / 0  # the bug


if "bug_sgd" not in OPTIMIZERS:
    OPTIMIZERS.register("bug_sgd")(OptimizerSpec(
        name="bug_sgd", build=lambda named, ocfg, device_type, options: BugSGD([p for _, p in named], ocfg.lr,
                                                                                options.at_step, options.on_rank),
        options=BugOptions, state_bytes=lambda ocfg, low_precision: 0.0, reads=("lr",), facts=lambda ocfg, o: {}))
