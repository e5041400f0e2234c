"""Weight gradients written in FP32 by TE's own GEMMs (model.fuse_wgrad_accumulation), where one process trains
without a data-parallel reduction.

By default a TE weight-gradient GEMM writes a bf16 gradient, and autograd then casts it to the weight's FP32
dtype (for FP8 weights, their nominal dtype) in a separate kernel, and adds it up over micro-batches in another.
With TE's `fuse_wgrad_accumulation` the GEMM writes FP32 into the weight's `main_grad` instead, accumulating
from the second micro-batch on (its epilogue reads and adds), and hands autograd no gradient at all: one kernel
and no bf16 rounding. The buffers are allocated when TE's backward asks for them (TE calls `get_main_grad()` in
the backward of a weight marked `__fsdp_param__`, the lazy path it keeps for Megatron's FSDP), so they live no
longer than `param.grad` does without this; after the last micro-batch they become `param.grad`, which clipping
and the optimizers read, and `release()` frees them with the gradients.

Only where nothing reduces `param.grad` (the `none` parallelism: one rank, or fsdp / hsdp on one rank with
parallelism.unsharded_one_rank): FSDP2 and DDP reduce the gradients autograd hands them, which TE then leaves out.

`model.wgrad_dtype = "bfloat16"` makes the buffers bf16 (TE's GEMMs write their output in the buffer's dtype): half
the memory of FP32 gradients and half the bytes that clipping and the optimizer read. The weights stay FP32 by their
nominal dtype, so each is told to take a gradient of another dtype (`grad_dtype`, torch >= 2.11).
"""
from __future__ import annotations

import weakref

import torch


def _gemm_weights(module) -> list:
    """The GEMM weights (2-D FP32 parameters: for FP8 weights, their nominal dtype) of a TE module that can write
    its weight gradients in place."""
    if not hasattr(module, "fuse_wgrad_accumulation"):
        return []
    return [p for p in module.parameters(recurse=False) if p.requires_grad and p.dim() == 2
            and p.dtype == torch.float32]


class WeightGradBuffers:
    """Turns TE's in-place weight gradients (FP32, or `dtype`) on for the TE modules of `model`; the training step
    calls `microbatch(first)` before each forward, `publish()` after the last backward, `release()` after the
    step."""

    def __init__(self, model: torch.nn.Module, enabled: bool = True, dtype: torch.dtype = torch.float32):
        self.weights = []
        for module in model.modules() if enabled else ():
            weights = _gemm_weights(module)
            if not weights:
                continue
            module.fuse_wgrad_accumulation = True  # read by TE's forward, which hands it to its backward
            for p in weights:
                p.main_grad = None
                p.__fsdp_param__ = True  # TE then calls p.get_main_grad() in the backward (see above)
                p.get_main_grad = _allocator(p, dtype)
                if dtype != p.dtype:
                    p.grad_dtype = dtype  # param.grad may then be the buffer (publish)
                self.weights.append(p)

    def __len__(self) -> int:
        return len(self.weights)

    def microbatch(self, first: bool) -> None:
        """Before a micro-batch's forward (TE reads the flag there): the first overwrites the buffers, whose
        contents are then stale or never written, and the others add to them."""
        for p in self.weights:
            p.overwrite_main_grad = first

    def publish(self) -> None:
        """The buffers become the gradients that clipping and the optimizer read."""
        for p in self.weights:
            if p.main_grad is not None:
                p.grad = p.main_grad

    def release(self) -> None:
        """Frees the buffers with the gradients (optimizer.zero_grad(set_to_none=True) drops param.grad)."""
        for p in self.weights:
            p.main_grad = None


def _allocator(p, dtype: torch.dtype):
    ref = weakref.ref(p)  # the parameter holds this function: no cycle through it

    def get_main_grad() -> torch.Tensor:
        w = ref()
        if w.main_grad is None:
            w.main_grad = torch.empty(w.shape, dtype=dtype, device=w.device)
        return w.main_grad

    return get_main_grad
