"""Will the run fit? A lower bound of the memory a run needs, checked before the model is built.

Counted: weights, gradients and optimizer state (sharded over the FSDP shard degree) and, where the model
builds the whole [tokens, vocab] logits (no fused head and loss), the FP32 logits with their gradient; a fused
head holds one chunk of them at a time, which is not counted. Activations of the blocks are not counted, so a
run refused here can never fit, while a run admitted may still run out of memory later (exit code 4 then).
"""
from __future__ import annotations

import os

import torch

from titan_te.errors import OutOfMemory

GiB = 2**30


def available_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are): the GPU's total memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{torch.cuda.get_device_name(device)}"
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info["MemTotal"]), "available host RAM"
    except (OSError, KeyError, ValueError, IndexError):  # not Linux: no check
        return 0, "unknown"


def estimate(cfg, args, optimizer_spec, device: torch.device, shard: int, local_ranks: int,
             fused_head: bool = False) -> dict:
    """Bytes one device (a GPU, or the host for all of its CPU ranks) needs at least; `fused_head`: the model
    computes the head and loss chunk by chunk (model.fused_loss)."""
    fp8_weights = cfg.fp8.enable and cfg.fp8.params
    n = args.num_params()
    weights = 1 if fp8_weights else 4  # FSDP keeps sharded FP32 parameters (FP8 bytes with fp8.params)
    grads = getattr(torch, cfg.model.wgrad_dtype).itemsize  # a lower bound: TE's in-place ones in this dtype
    state = optimizer_spec.state_bytes(cfg.optimizer, fp8_weights)
    per_param = weights + grads + state
    t = cfg.training
    logits = 0 if fused_head else 2 * 4 * t.local_batch_size * t.seq_len * args.vocab_size  # FP32, and gradient
    ranks = local_ranks if device.type == "cpu" else 1  # CPU ranks share the host's memory
    total = ranks * (n * per_param / shard + logits)
    return {"total": total, "params": n, "per_param": per_param, "logits": ranks * logits, "shard": shard}


def check_fits(cfg, args, optimizer_spec, device: torch.device, shard: int, local_ranks: int,
               fused_head: bool = False) -> dict:
    est = estimate(cfg, args, optimizer_spec, device, shard, local_ranks, fused_head)
    have, what = available_bytes(device)
    if have and est["total"] > have:
        where = "per GPU" if device.type == "cuda" else "on this host"
        sharded = f", sharded over {shard} ranks" if shard > 1 else ""
        logits = f", plus {est['logits'] / GiB:,.1f} GiB of logits" if est["logits"] else ""
        raise OutOfMemory(
            f"this run needs at least {est['total'] / GiB:,.1f} GiB {where} ({est['params'] / 1e6:,.0f} M parameters "
            f"x {est['per_param']:g} bytes of weights, gradients and optimizer state{sharded}{logits}), but "
            f"{have / GiB:,.1f} GiB is there ({what}). Use a smaller model (--model.flavor, --model.n_layers), more "
            f"GPUs (NGPU) to shard the state, a smaller --training.local_batch_size or --training.seq_len, or "
            f"--optimizer.moment_dtype=bfloat16")
    return est


def local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
