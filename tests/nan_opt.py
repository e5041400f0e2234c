"""An optimizer that ruins the weights on purpose (`--job.custom_import=nan_opt --optimizer.name=nan_sgd`):
plain SGD, except that the update of step `[optimizer.nan_sgd] at_step` writes NaN into one weight, as an
overflowing update or a corrupt batch would. For the tests of what a diverged run does."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_te.config.schema import NON_NEGATIVE, opt
from titan_te.init_weights import local_tensor
from titan_te.optim import OPTIMIZERS, OptimizerSpec


@dataclass
class NanOptions:
    at_step: int = opt(0, "the step whose update writes NaN into the first weight (0: never)", bounds=NON_NEGATIVE)


class NanSGD(torch.optim.SGD):
    def __init__(self, params, lr: float, at_step: int):
        super().__init__(params, lr=lr)
        self.at_step, self.steps = at_step, 0

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        if self.param_groups[0]["lr"] == 0:  # torch's state-dict helper steps a stateless optimizer at lr 0
            return
        self.steps += 1
        if self.steps == self.at_step:
            local_tensor(self.param_groups[0]["params"][0]).fill_(float("nan"))


if "nan_sgd" not in OPTIMIZERS:
    OPTIMIZERS.register("nan_sgd")(OptimizerSpec(
        name="nan_sgd", build=lambda named, ocfg, device_type, options: NanSGD([p for _, p in named], ocfg.lr,
                                                                                options.at_step),
        options=NanOptions, state_bytes=lambda ocfg, low_precision: 0.0, reads=("lr",),
        facts=lambda ocfg, o: {}))
