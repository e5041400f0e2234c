"""Optimizers that go wrong on purpose, once, after the update of step `at_step` (`--job.custom_import=nan_opt`):
- `nan_sgd`: SGD with momentum that writes NaN into one weight (or, with `into = "state"`, into its momentum, as
  an overflowing moment would), as an overflowing update or a corrupt batch would. For the tests of what a
  diverged run does.
- `bug_sgd`: SGD that divides by zero on rank `on_rank`. For the test that a bug keeps its traceback on the
  console when the other ranks only lost the rank it ended."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from titan_te.config.schema import NON_NEGATIVE, opt
from titan_te.init_weights import local_tensor
from titan_te.optim import OPTIMIZERS, OptimizerSpec


class _FaultySGD(torch.optim.SGD):
    def __init__(self, params, lr: float, at_step: int, momentum: float = 0.0):
        super().__init__(params, lr=lr, momentum=momentum)
        self.at_step, self.steps = at_step, 0

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        if self.param_groups[0]["lr"] == 0:  # torch's state-dict helper steps an optimizer without state at lr 0
            return
        self.steps += 1
        if self.steps == self.at_step:
            self.fault()

    def fault(self) -> None:
        raise NotImplementedError


@dataclass
class NanOptions:
    at_step: int = opt(0, "the step whose update writes NaN into the first weight (0: never)", bounds=NON_NEGATIVE)
    into: str = opt("weight", "what the NaN goes into: the weight or its momentum", choices=("weight", "state"))


class NanSGD(_FaultySGD):
    def __init__(self, params, lr: float, at_step: int, into: str):
        super().__init__(params, lr, at_step, momentum=0.9)
        self.into = into

    def fault(self) -> None:
        first = self.param_groups[0]["params"][0]
        target = first if self.into == "weight" else self.state[first]["momentum_buffer"]
        local_tensor(target).fill_(float("nan"))


@dataclass
class BugOptions:
    at_step: int = opt(0, "the step whose update fails (0: never)", bounds=NON_NEGATIVE)
    on_rank: int = opt(1, "the rank it fails on", bounds=NON_NEGATIVE)


class BugSGD(_FaultySGD):
    def __init__(self, params, lr: float, at_step: int, on_rank: int):
        super().__init__(params, lr, at_step)
        self.on_rank = on_rank

    def fault(self) -> None:
        if int(os.environ.get("RANK", "0")) == self.on_rank:
            self.steps / 0  # the bug


if "nan_sgd" not in OPTIMIZERS:
    OPTIMIZERS.register("nan_sgd")(OptimizerSpec(
        name="nan_sgd", build=lambda named, ocfg, device_type, options: NanSGD([p for _, p in named], ocfg.lr,
                                                                                options.at_step, options.into),
        options=NanOptions, state_bytes=lambda ocfg, low_precision: 4.0, reads=("lr",),  # the momentum
        facts=lambda ocfg, o: {}))
if "bug_sgd" not in OPTIMIZERS:
    OPTIMIZERS.register("bug_sgd")(OptimizerSpec(
        name="bug_sgd", build=lambda named, ocfg, device_type, options: BugSGD([p for _, p in named], ocfg.lr,
                                                                                options.at_step, options.on_rank),
        options=BugOptions, state_bytes=lambda ocfg, low_precision: 0.0, reads=("lr",), facts=lambda ocfg, o: {}))
