"""activation_checkpoint.mode = auto: the planner's lightest recomputation that fits the GPU the run is on."""
from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.distributed as dist

logger = logging.getLogger("titan_te")


def smallest_card(device: torch.device, ranks_per_gpu: int) -> tuple[int, tuple[int, int], str]:
    """(bytes, compute capability, name) of the smallest GPU share over all ranks: every rank must choose alike,
    since FSDP's gathers follow the recomputed blocks. A rank's share is its card's memory over the ranks on it."""
    props = torch.cuda.get_device_properties(device)
    mine = torch.tensor([props.total_memory // ranks_per_gpu, props.major, props.minor], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)  # a CPU tensor: gloo carries it in every process group here
    return int(mine[0]), (int(mine[1]), int(mine[2])), torch.cuda.get_device_name(device)


def resolve(cfg, device: torch.device, world: int, ranks_per_gpu: int, vocab: int, recomputes_mlp: bool):
    """(the activation_checkpoint section with mode auto replaced by the choice (any other mode: unchanged), the
    line that says what was chosen and why (None when nothing was to choose), whether the choice fits)."""
    from titan_te.plan import GiB, gpu_of, lightest_recomputation

    acfg = cfg.activation_checkpoint
    if acfg.mode != "auto":
        return acfg, None, True
    if device.type != "cuda":
        return replace(acfg, mode="none"), "activation_checkpoint.mode = auto: none (nothing recomputed on a CPU)", True
    memory, capability, name = smallest_card(device, ranks_per_gpu)
    choice, none_peak = lightest_recomputation(cfg, world, gpu_of(memory, capability), vocab, recomputes_mlp)
    share = f" (a rank's share of {ranks_per_gpu})" if ranks_per_gpu > 1 else ""
    planned = f"planned peak {choice.peak / GiB:,.1f} GiB of {memory / GiB:,.1f} GiB on the {name}{share}"
    line = f"activation_checkpoint.mode = auto: {choice.describe()} ({planned}"
    if not choice.fits:
        line += ("): nothing fits by the plan, so expect to run out of memory; use a smaller "
                 "training.local_batch_size (training.global_batch_size keeps the batch) or more GPUs")
    else:
        line += f"; none would need {none_peak / GiB:,.1f} GiB)" if choice.mode != "none" else ")"
    return replace(acfg, mode=choice.mode, every_n=choice.every_n), line, choice.fits
