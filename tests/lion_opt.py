"""A second optimizer in one file, registered the way a user would (`--job.custom_import=lion_opt`): Lion
(Chen et al. 2023: the sign of an interpolated momentum), with options of its own in [optimizer.lion].

It reads lr and weight_decay from [optimizer] (setting Adam's beta1 for it is refused); its own betas,
bounded, and the dtype of its one state tensor, which its checkpoints depend on (a fact in the manifest).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_te.config.schema import UNIT_OPEN, opt
from titan_te.optim import OPTIMIZERS, OptimizerSpec
from titan_te.optim.param_groups import decay_groups


@dataclass
class LionOptions:
    beta1: float = opt(0.9, "Lion: weight of the momentum in the update's sign", bounds=UNIT_OPEN)
    beta2: float = opt(0.99, "Lion: decay of the momentum", bounds=UNIT_OPEN)
    momentum_dtype: str = opt("float32", "Lion: dtype of its momentum", choices=("float32", "bfloat16"))

    def check(self) -> str:
        return "" if self.beta2 >= self.beta1 else f"beta2 ({self.beta2}) below beta1 ({self.beta1}) is not Lion"


class Lion(torch.optim.Optimizer):
    def __init__(self, groups, lr: float, betas: tuple[float, float], momentum_dtype: torch.dtype):
        super().__init__(groups, {"lr": lr, "betas": betas, "weight_decay": 0.0})
        self.momentum_dtype = momentum_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.momentum_dtype)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_((m.float() * b1 + p.grad * (1 - b1)).sign(), alpha=-group["lr"])
                m.copy_(m.float() * b2 + p.grad * (1 - b2))


def build_lion(named_params, ocfg, device_type: str, options: LionOptions) -> Lion:
    return Lion(decay_groups(named_params, ocfg.weight_decay), lr=ocfg.lr, betas=(options.beta1, options.beta2),
                momentum_dtype=getattr(torch, options.momentum_dtype))


if "lion" not in OPTIMIZERS:
    OPTIMIZERS.register("lion")(OptimizerSpec(name="lion", build=build_lion, options=LionOptions,
                                              state_bytes=lambda ocfg, low_precision: 4.0, reads=("lr", "weight_decay"),
                                              facts=lambda ocfg, o: {"lion.momentum_dtype": o.momentum_dtype}))
