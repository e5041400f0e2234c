"""Small helpers of the training step: determinism, DTensor-aware gradient clipping, finite weights."""
from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_te.errors import ConfigError
from titan_te.init_weights import local_tensor
from titan_te.te.tensors import is_quantized


def set_determinism(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def grad_norm(parameters) -> torch.Tensor:
    """Total gradient norm over all ranks (DTensor grads are reduced across their mesh), as a device
    tensor (no host sync). Local bf16 / fp16 gradients (model.wgrad_dtype) have their norms taken in FP32."""
    low, rest = [], []
    for p in parameters:
        if p.grad is not None:
            (low if _local_low_precision(p.grad) else rest).append(p.grad)
    if not low:
        return _total_norm(rest)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(low, 2.0, dtype=torch.float32)))
    return torch.hypot(total, _total_norm(rest).to(total.device)) if rest else total


def _local_low_precision(g: torch.Tensor) -> bool:
    return g.dtype in (torch.bfloat16, torch.float16) and not isinstance(g, DTensor)


def _total_norm(grads: list) -> torch.Tensor:
    """torch's total norm of `grads` (foreach), reduced over the mesh for DTensors."""
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    return total.full_tensor() if isinstance(total, DTensor) else total


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor gradient clipping multiplies the gradients by (torch's: at most 1)."""
    return (max_norm / (total + 1e-6)).clamp(max=1.0)


def clip_grad_norm(parameters, max_norm: float, optimizer=None) -> torch.Tensor:
    """The total gradient norm (before clipping); clips to max_norm when > 0. An optimizer with
    `scale_grads_in_step` gets the clip coefficient to apply inside its own update instead of a pass
    over all gradients here."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params)
    if max_norm > 0:
        if hasattr(optimizer, "scale_grads_in_step"):
            optimizer.scale_grads_in_step(clip_coefficient(total, max_norm))
        else:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def training_state_finite(model, optimizer) -> bool:
    """Whether every rank's shard of every high-precision weight and every floating optimizer state (FP32
    masters, moments) is finite (one all-reduce: every rank gets the same answer). FP8 weights are left out:
    their FP32 masters are in the optimizer's state. One min-max reduction per tensor (NaN propagates into
    both ends, +inf into the max, -inf into the min): one read of the state and no temporaries of its size."""
    params = [t for t in (local_tensor(p) for p in model.parameters()) if not is_quantized(t)]
    states = [local_tensor(v) for state in optimizer.state.values() for v in state.values()
              if torch.is_tensor(v) and v.is_floating_point()]
    device = params[0].device if params else torch.device("cpu")
    ends = [torch.stack(torch.aminmax(t.detach())).float().to(device) for t in params + states if t.numel()]
    bad = (~torch.isfinite(torch.cat(ends))).sum().float() if ends else torch.zeros((), device=device)
    if dist.is_initialized():
        dist.all_reduce(bad)
    return bool(bad == 0)


def global_batch_plan(t, dp_world: int, saved: int | None) -> tuple[int, int, str]:
    """(gradient accumulation, sequences per step, a line for the log or "") from the [training] section `t`.
    training.global_batch_size = -1 is local_batch_size x data-parallel ranks when a run starts; a resume keeps
    the batch its checkpoint trained with (`saved`), by gradient accumulation, on any rank count that can make
    it up, and refuses in one line on one that cannot."""
    per_step = t.local_batch_size * dp_world
    if t.global_batch_size > 0:
        return t.global_batch_size // per_step, t.global_batch_size, ""
    if saved is None or saved == per_step:
        return 1, per_step, ""
    if saved % per_step == 0:
        accum = saved // per_step
        return accum, saved, (f"batch: {saved} sequences per step, as the checkpoint trained (training."
                              f"global_batch_size = -1 is fixed when a run starts): {dp_world} rank(s) x "
                              f"{t.local_batch_size} x {accum} accumulation steps; --training.global_batch_size "
                              f"sets another")
    if saved % dp_world == 0:
        local = max(d for d in range(1, t.local_batch_size + 1) if (saved // dp_world) % d == 0)
        keep = f"--training.global_batch_size={saved} --training.local_batch_size={local}"
    else:
        keep = f"a number of data-parallel ranks that divides {saved}"
    raise ConfigError(f"the checkpoint trained with {saved} sequences per step (training.global_batch_size = -1: "
                      f"local_batch_size x data-parallel ranks when the run started); {dp_world} rank(s) x "
                      f"local_batch_size {t.local_batch_size} = {per_step} cannot make that up by gradient "
                      f"accumulation. Keep its batch with {keep}, or train on with {per_step} per step: "
                      f"--training.global_batch_size={per_step}")
