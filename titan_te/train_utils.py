"""Small helpers of the training step: determinism and DTensor-aware gradient clipping."""
from __future__ import annotations

import os
import random

import numpy as np
import torch
from torch.distributed.tensor import DTensor


def set_determinism(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Total gradient norm over all ranks (DTensor grads are reduced across their mesh), as a device
    tensor (no host sync); clips if max_norm > 0."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
