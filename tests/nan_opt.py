"""An optimizer that ruins the weights on purpose (`--job.custom_import=nan_opt --optimizer.name=nan_sgd`):
SGD with momentum, except that the update of step `[optimizer.nan_sgd] at_step` writes NaN into one weight (or,
with `into = "state"`, into its momentum, as an overflowing moment would), as an overflowing update or a
corrupt batch would. For the tests of what a diverged run does."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_te.config.schema import NON_NEGATIVE, opt
from titan_te.init_weights import local_tensor
from titan_te.optim import OPTIMIZERS, OptimizerSpec


@dataclass
class NanOptions:
    at_step: int = opt(0, "the step whose update writes NaN into the first weight (0: never)", bounds=NON_NEGATIVE)
    into: str = opt("weight", "what the NaN goes into: the weight or its momentum", choices=("weight", "state"))


class NanSGD(torch.optim.SGD):
    def __init__(self, params, lr: float, at_step: int, into: str):
        super().__init__(params, lr=lr, momentum=0.9)
        self.at_step, self.into, self.steps = at_step, into, 0

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        if self.param_groups[0]["lr"] == 0:  # torch's state-dict helper steps an optimizer without state at lr 0
            return
        self.steps += 1
        if self.steps == self.at_step:
            first = self.param_groups[0]["params"][0]
            target = first if self.into == "weight" else self.state[first]["momentum_buffer"]
            local_tensor(target).fill_(float("nan"))


if "nan_sgd" not in OPTIMIZERS:
    OPTIMIZERS.register("nan_sgd")(OptimizerSpec(
        name="nan_sgd", build=lambda named, ocfg, device_type, options: NanSGD([p for _, p in named], ocfg.lr,
                                                                                options.at_step, options.into),
        options=NanOptions, state_bytes=lambda ocfg, low_precision: 4.0, reads=("lr",),  # the momentum
        facts=lambda ocfg, o: {}))
