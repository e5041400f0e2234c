"""`sgd`: torch.optim.SGD, with options of its own in [optimizer.sgd] (momentum does not borrow beta1)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_te.config.schema import FRACTION, UNIT_OPEN, opt
from titan_te.optim import OPTIMIZERS, OptimizerSpec
from titan_te.optim.param_groups import decay_groups


@dataclass
class SGDOptions:
    momentum: float = opt(0.0, "momentum factor (0: plain SGD)", bounds=UNIT_OPEN)
    dampening: float = opt(0.0, "dampening of the momentum", bounds=FRACTION)
    nesterov: bool = opt(False, "Nesterov momentum (needs momentum > 0 and dampening = 0)")

    def check(self) -> str:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            return "nesterov = true needs momentum > 0 and dampening = 0"
        return ""


def build_sgd(named_params, ocfg, device_type: str, options: SGDOptions) -> torch.optim.Optimizer:
    return torch.optim.SGD(decay_groups(named_params, ocfg.weight_decay), lr=ocfg.lr, momentum=options.momentum,
                           dampening=options.dampening, nesterov=options.nesterov, foreach=True)


OPTIMIZERS.register("sgd")(OptimizerSpec(name="sgd", build=build_sgd, options=SGDOptions,
                                            state_bytes=lambda ocfg, low_precision: 4.0,  # the momentum buffer
                                            reads=("lr", "weight_decay"),
                                            # a momentum buffer exists only with momentum
                                            facts=lambda ocfg, o: {"sgd.momentum_buffer": o.momentum > 0}))
