"""Linear warmup, then a registered decay (cosine, linear, constant) down to min_lr_ratio."""
from __future__ import annotations

import math

import torch

from titan_te.optim import LR_DECAYS

LR_DECAYS.register("cosine")(lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)))
LR_DECAYS.register("linear")(lambda progress: 1.0 - progress)
LR_DECAYS.register("constant")(lambda progress: 1.0)


def lr_factor(step: int, total_steps: int, warmup: int, decay_type: str, min_ratio: float) -> float:
    """LR multiplier for the optimizer step numbered `step` (1-based)."""
    if step <= warmup:
        return step / (warmup + 1)
    span = max(total_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * LR_DECAYS.get(decay_type)(progress)


def build_lr_scheduler(optimizer, scfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    # LambdaLR calls the lambda with its own counter (0 at construction): step k of training uses k+1.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: lr_factor(i + 1, total_steps, scfg.warmup_steps, scfg.decay_type, scfg.min_lr_ratio))
