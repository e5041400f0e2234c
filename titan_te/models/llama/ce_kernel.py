"""Cross-entropy of logit rows in one Triton kernel, with the gradient written over the logits.

Per row (a token): pass 1 reads the logits once for their max and sum of exponentials (online), pass 2
reads them again and writes softmax minus the one-hot target in their place (zero for ignored tokens),
and optionally an FP8 (e5m2) copy of that gradient times a fixed scale for an FP8 GEMM (the gradient
lies in [-1, 1], so a fixed power of two fits it to e5m2's range without an amax pass).
6 bytes per bf16 logit in all (7 with the FP8 copy), where the torch ops (FP32 copy, log-sum-exp, exp, scatter, mask, cast back)
move about 30 and need an FP32 copy of the chunk.
"""
from __future__ import annotations

import functools

import torch


BLOCK = 4096


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ce_rows(logits_ptr, labels_ptr, loss_ptr, g8_ptr, g8_scale, n_cols, stride, ignore_index,
                WRITE_GRAD: tl.constexpr, WRITE_G8: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        label = tl.load(labels_ptr + row)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK):  # every block holds at least one real column
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
            m = new_m
        lse = m + tl.log(s)
        valid = label != ignore_index
        safe = tl.where(valid, label, 0)
        target = tl.load(base + safe).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
        if WRITE_GRAD:
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < n_cols
                x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.exp(x - lse) - tl.where(cols == safe, 1.0, 0.0)
                g = tl.where(valid, g, 0.0)
                tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)
                if WRITE_G8:
                    tl.store(g8_ptr + row * n_cols + cols,
                             (g * g8_scale).to(g8_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    return ce_rows


def loss_rows_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, write_grad: bool,
               grad_fp8: torch.Tensor | None = None, grad_fp8_scale: float = 1.0) -> torch.Tensor:
    """FP32 loss of each row of `logits` [rows, vocab] (0 where labels == ignore_index); with write_grad
    the logits are replaced by the gradient of the summed loss with respect to them, and grad_fp8 (a
    contiguous FP8 tensor of the logits' shape), when given, receives that gradient times grad_fp8_scale."""
    rows, cols = logits.shape
    assert logits.stride(1) == 1 and labels.is_contiguous()
    assert grad_fp8 is None or (write_grad and grad_fp8.is_contiguous() and grad_fp8.shape == logits.shape)
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _kernel()[(rows,)](logits, labels, loss, grad_fp8 if grad_fp8 is not None else logits, grad_fp8_scale,
                           cols, logits.stride(0), ignore_index, WRITE_GRAD=write_grad,
                           WRITE_G8=grad_fp8 is not None, BLOCK=BLOCK, num_warps=8)
    return loss
