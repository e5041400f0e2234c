"""Llama's fused output head: the vocabulary projection and the cross-entropy summed over the valid tokens,
chunk by chunk, without building the [tokens, vocab] logits.

The fused head does its whole backward inside the forward: for each chunk of tokens it makes the
logits (one GEMM in the compute dtype), their log-sum-exp in FP32, the loss, and the gradient of the
loss with respect to the logits (softmax minus the one-hot target; on CUDA one Triton kernel,
ce_kernel.py beside this, writes it over the logits), from which the gradients of the hidden states and
of the weight follow (two more GEMMs). Only one chunk's logits exist at a time, instead of the whole
batch's FP32 logits, their gradient and their bf16 twins (what that saves: README, speed). Backward then
only scales the stored gradients by the incoming gradient of the loss (the loss is linear in them).

`fp8` ("dgrad" or "all", fp8.head) runs GEMMs of the head in FP8 on CUDA, with per-tensor scales taken
from the current values: "dgrad" the gradient into the model (the e5m2 logit gradient, which the
kernel writes beside the bf16 one, times the e4m3 weight), "all" the logits as well (e4m3 hidden states
times the e4m3 weight). The head's own weight gradient stays a bf16 GEMM with FP32 accumulation.
"""
from __future__ import annotations

import functools

import torch

from titan_te import triton_support
from titan_te.loss import IGNORE_INDEX
from titan_te.models.llama import ce_kernel
from titan_te.te import tensors

CHUNK_LOGITS = 1 << 29  # logits per chunk: 2 GiB in FP32 (torch path) or 1 GiB in bf16 (Triton path)
# The logit gradient (softmax minus one-hot) lies in [-1, 1]: times 2^15 it fits e5m2 (max 57344), whose
# subnormals then reach down to 2^-31.
GRAD_FP8_SCALE = 2.0 ** 15


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
    """Whether torch.mm and torch.addmm take out_dtype=float32 for bf16 inputs here (CUDA, recent torch)."""
    x = torch.ones(1, 1, dtype=torch.bfloat16, device=device_type)
    try:
        torch.addmm(torch.mm(x, x, out_dtype=torch.float32), x, x, out_dtype=torch.float32)
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


def _rows(logits: torch.Tensor, labels: torch.Tensor, write_grad: bool, kernel: bool,
          grad_fp8: torch.Tensor | None = None):
    if not kernel:
        return _rows_torch(logits, labels, write_grad)
    # the gradient replaces the logits (and lands in grad_fp8 too, scaled, when given)
    rows = ce_kernel.loss_rows_(logits, labels, IGNORE_INDEX, write_grad, grad_fp8, GRAD_FP8_SCALE)
    return rows.sum(), logits if write_grad else None


def _e4m3(t: torch.Tensor, transpose: bool = False):
    """t in e4m3 with its own scale (TE's current-scaling cast). The FP8 head runs with TE's FP8 layers only
    (fp8.enable), so TE is there."""
    return tensors.e4m3_current(t, transpose)


class _FP8Head:
    """The FP8 operands of one call: the weight (and its transpose, B of the gradient GEMM), the hidden
    states when the logits are FP8 too. torch._scaled_mm takes A row-major and B column-major."""

    def __init__(self, h: torch.Tensor, w: torch.Tensor, mode: str, need_h: bool):
        self.w8, self.wt8, self.w_scale = _e4m3(w, transpose=need_h)
        self.h8, _, self.h_scale = _e4m3(h) if mode == "all" else (None, None, None)
        self.g_scale = torch.full((), 1.0 / GRAD_FP8_SCALE, device=h.device)

    def logits(self, start: int, stop: int, hc: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.h8 is None:
            return hc @ w.t()
        return torch._scaled_mm(self.h8[start:stop], self.w8.t(), self.h_scale, self.w_scale,
                                out_dtype=hc.dtype, use_fast_accum=True)

    def grad_hidden(self, g8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # a long reduction (the vocabulary): no fast accumulation
        return torch._scaled_mm(g8, self.wt8.t(), self.g_scale, self.w_scale, out_dtype=dtype,
                                use_fast_accum=False)


def _loss_and_grads(hidden, weight, labels, chunk: int, kernel: bool, need_h: bool, need_w: bool,
                    fp8: str = "off"):
    """(summed loss, its gradient w.r.t. hidden or None, w.r.t. weight or None), chunk by chunk."""
    dtype = _compute_dtype(hidden)
    h, w = hidden.to(dtype), weight.to(dtype)
    n = h.shape[0]
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = None
    # the weight gradient adds up over chunks in FP32 (inside the GEMM where torch can)
    fp32_gemm = dtype != torch.float32 and h.is_cuda and _fp32_accumulating_addmm(h.device.type)
    head8 = _FP8Head(h, w, fp8, need_h) if fp8 != "off" and kernel else None
    with torch.autocast(h.device.type, enabled=False):
        for start in range(0, n, chunk):
            hc, lc = h[start:start + chunk], labels[start:start + chunk]
            logits = head8.logits(start, start + chunk, hc, w) if head8 is not None else hc @ w.t()
            g8 = torch.empty(logits.shape, dtype=torch.float8_e5m2, device=h.device) \
                if head8 is not None and need_h else None
            part, dlogits = _rows(logits, lc, need_h or need_w, kernel, g8)
            del logits
            loss += part
            if dlogits is None:
                continue
            if g8 is not None:
                grad_h[start:start + chunk] = head8.grad_hidden(g8, dtype)
                del g8
            elif need_h:
                torch.mm(dlogits, w, out=grad_h[start:start + chunk])
            if need_w:
                if grad_w is None:  # the first chunk's GEMM starts the sum: no zero-filled buffer to add to
                    grad_w = torch.mm(dlogits.t(), hc, out_dtype=torch.float32) if fp32_gemm else dlogits.t() @ hc
                elif fp32_gemm:
                    grad_w = torch.addmm(grad_w, dlogits.t(), hc, out_dtype=torch.float32)
                else:
                    grad_w.addmm_(dlogits.t(), hc)
            del dlogits
    return loss, grad_h, None if grad_w is None else grad_w.to(weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, kernel, fp8):
        loss, grad_h, grad_w = _loss_and_grads(hidden, weight, labels, chunk, kernel, *ctx.needs_input_grad[:2],
                                               fp8=fp8)
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
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk: int | None = None, kernel: bool | None = None, fp8: str = "off") -> torch.Tensor:
    """sum over valid tokens of cross_entropy(hidden @ weight.T, labels), never holding all the logits.

    hidden [..., dim], weight [vocab, dim], labels [...] (IGNORE_INDEX marks tokens without a target).
    kernel: the Triton kernel for the rows (None: on CUDA when Triton is there; False: torch ops).
    fp8: "off", "dgrad" or "all" (module docstring); FP8 needs the kernel (CUDA), dim and vocab
    multiples of 16."""
    h = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).contiguous()
    if kernel is None:
        kernel = h.is_cuda and triton_support.available()
    chunk = chunk or chunk_tokens(weight.shape[0], h.shape[0], kernel)
    if fp8 != "off" and not kernel:
        raise ValueError("the FP8 head needs the Triton cross-entropy kernel (CUDA with Triton)")
    if not torch.is_grad_enabled():  # validation: the loss only
        return _loss_and_grads(h, weight, labels, chunk, kernel, False, False, fp8)[0]
    return _LinearCrossEntropy.apply(h, weight, labels, chunk, kernel, fp8)
