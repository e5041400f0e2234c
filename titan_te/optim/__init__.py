"""Optimizer and LR-decay registries."""
from dataclasses import dataclass
from typing import Callable

from titan_te.registry import Registry


@dataclass
class OptimizerSpec:
    name: str
    build: Callable  # build(named_params, optimizer_cfg, device_type) -> torch.optim.Optimizer


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer")
LR_DECAYS: Registry[Callable[[float], float]] = Registry("lr decay")  # progress in [0, 1] -> factor in [0, 1]

from titan_te.optim import adamw, fused_adam, lr_schedule, te_fused_adam  # noqa: E402,F401  (register entries)
