"""Split parameters into a weight-decay group and a no-decay group (norms, biases, 1-D tensors)."""
from __future__ import annotations


def decay_groups(named_params, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in named_params:
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups
