"""The training loss: cross-entropy summed over the valid tokens, and a fused output head that computes
it chunk by chunk without building the [tokens, vocab] logits.

The fused head does its whole backward inside the forward: for each chunk of tokens it makes the
logits (one GEMM in the compute dtype), their log-sum-exp in FP32, the loss, and the gradient of the
loss with respect to the logits (softmax minus the one-hot target; on CUDA one Triton kernel,
titan_te/ce_kernel.py, writes it over the logits), from which the gradients of the hidden states and
of the weight follow (two more GEMMs). Only one chunk's logits exist at a time, so a
1B Llama at batch 4 x 8192 with a 128,256-row vocabulary needs about 2 GiB for its head instead of the
~50 GiB that FP32 logits, their gradient and their bf16 twins take. Backward then only scales the
stored gradients by the incoming gradient of the loss (the loss is linear in them).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from titan_te import ce_kernel, triton_support

IGNORE_INDEX = -100
CHUNK_LOGITS = 1 << 29  # logits per chunk: 2 GiB in FP32 (torch path) or 1 GiB in bf16 (Triton path)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the valid (not ignored) tokens, from full logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def chunk_tokens(vocab: int, tokens: int, kernel: bool = False) -> int:
    """Tokens per chunk: as many as keep one chunk within CHUNK_LOGITS logits (twice that for the Triton
    kernel, which needs no FP32 copy of them), in multiples of 128, at least one."""
    budget = CHUNK_LOGITS * (2 if kernel else 1)
    return max(1, min(max(128, budget // max(vocab, 1) // 128 * 128), tokens))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


@functools.cache
def _fp32_accumulating_addmm(device_type: str) -> bool:
    """Whether torch.addmm takes out_dtype=float32 for bf16 inputs here (CUDA, recent torch)."""
    x = torch.ones(1, 1, dtype=torch.bfloat16, device=device_type)
    try:
        torch.addmm(torch.zeros(1, 1, device=device_type), x, x, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def _rows_torch(logits: torch.Tensor, labels: torch.Tensor, write_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, gradient of it w.r.t. the logits in their dtype or None) with torch ops in FP32."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    valid = labels != IGNORE_INDEX
    target = labels.clamp(min=0).unsqueeze(1)
    loss = ((lse - x.gather(1, target).squeeze(1)) * valid).sum()
    if not write_grad:
        return loss, None
    probs = x.sub_(lse.unsqueeze(1)).exp_()  # softmax, in the FP32 copy's storage
    probs.scatter_add_(1, target, torch.full_like(lse, -1.0).unsqueeze(1))
    probs.masked_fill_(~valid.unsqueeze(1), 0.0)
    return loss, probs.to(logits.dtype)


def _rows(logits: torch.Tensor, labels: torch.Tensor, write_grad: bool, kernel: bool):
    if not kernel:
        return _rows_torch(logits, labels, write_grad)
    rows = ce_kernel.loss_rows_(logits, labels, IGNORE_INDEX, write_grad)  # the gradient replaces the logits
    return rows.sum(), logits if write_grad else None


def _loss_and_grads(hidden, weight, labels, chunk: int, kernel: bool, need_h: bool, need_w: bool):
    """(summed loss, its gradient w.r.t. hidden or None, w.r.t. weight or None), chunk by chunk."""
    dtype = _compute_dtype(hidden)
    h, w = hidden.to(dtype), weight.to(dtype)
    n = h.shape[0]
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = None
    # the weight gradient adds up over chunks in FP32 (inside the GEMM where torch can)
    fp32_gemm = dtype != torch.float32 and h.is_cuda and _fp32_accumulating_addmm(h.device.type)
    with torch.autocast(h.device.type, enabled=False):
        for start in range(0, n, chunk):
            hc, lc = h[start:start + chunk], labels[start:start + chunk]
            part, dlogits = _rows(hc @ w.t(), lc, need_h or need_w, kernel)
            loss += part
            if dlogits is None:
                continue
            if need_h:
                torch.mm(dlogits, w, out=grad_h[start:start + chunk])
            if need_w:
                if grad_w is None:
                    grad_w = torch.zeros(w.shape, dtype=torch.float32 if fp32_gemm else dtype, device=w.device)
                if fp32_gemm:
                    grad_w = torch.addmm(grad_w, dlogits.t(), hc, out_dtype=torch.float32)
                else:
                    grad_w.addmm_(dlogits.t(), hc)
            del dlogits
    return loss, grad_h, None if grad_w is None else grad_w.to(weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, kernel):
        loss, grad_h, grad_w = _loss_and_grads(hidden, weight, labels, chunk, kernel, *ctx.needs_input_grad[:2])
        ctx.save_for_backward(grad_h, grad_w)
        ctx.hidden_dtype = hidden.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = (grad_h * grad_loss.to(grad_h.dtype)).to(ctx.hidden_dtype)
        if grad_w is not None:
            grad_w = grad_w * grad_loss.to(grad_w.dtype)
        return grad_h, grad_w, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk: int | None = None, kernel: bool | None = None) -> torch.Tensor:
    """sum over valid tokens of cross_entropy(hidden @ weight.T, labels), never holding all the logits.

    hidden [..., dim], weight [vocab, dim], labels [...] (IGNORE_INDEX marks tokens without a target).
    kernel: the Triton kernel for the rows (None: on CUDA when Triton is there; False: torch ops)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).contiguous()
    if kernel is None:
        kernel = h.is_cuda and triton_support.available()
    chunk = chunk or chunk_tokens(weight.shape[0], h.shape[0], kernel)
    if not torch.is_grad_enabled():  # validation: the loss only
        return _loss_and_grads(h, weight, labels, chunk, kernel, False, False)[0]
    return _LinearCrossEntropy.apply(h, weight, labels, chunk, kernel)
