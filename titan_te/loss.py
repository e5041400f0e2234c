"""The training loss: cross-entropy summed over the valid tokens, and a fused output head that computes
it chunk by chunk without building the [tokens, vocab] logits.

The fused head does its whole backward inside the forward: for each chunk of tokens it makes the
logits (one GEMM in the compute dtype), their log-sum-exp in FP32, the loss, and the gradient of the
loss with respect to the logits (softmax minus the one-hot target), from which the gradients of the
hidden states and of the weight follow (two more GEMMs). Only one chunk's logits exist at a time, so a
1B Llama at batch 4 x 8192 with a 128,256-row vocabulary needs about 2 GiB for its head instead of the
~50 GiB that FP32 logits, their gradient and their bf16 twins take. Backward then only scales the
stored gradients by the incoming gradient of the loss (the loss is linear in them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
CHUNK_LOGITS = 1 << 29  # logits per chunk (2 GiB in FP32)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the valid (not ignored) tokens, from full logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def chunk_tokens(vocab: int, tokens: int) -> int:
    """Tokens per chunk: as many as keep one chunk's FP32 logits within CHUNK_LOGITS, in multiples of 128."""
    per = max(128, CHUNK_LOGITS // max(vocab, 1) // 128 * 128)
    return min(per, tokens)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):
        dtype = _compute_dtype(hidden)
        h, w = hidden.to(dtype), weight.to(dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = h.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        # Several chunks add their weight gradients in FP32; a single chunk's GEMM result is used as is.
        grad_w = None
        with torch.autocast(h.device.type, enabled=False):
            for start in range(0, n, chunk):
                hc, lc = h[start:start + chunk], labels[start:start + chunk]
                logits = (hc @ w.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                valid = lc != IGNORE_INDEX
                target = lc.clamp(min=0).unsqueeze(1)
                loss += ((lse - logits.gather(1, target).squeeze(1)) * valid).sum()
                if not (need_h or need_w):
                    continue
                probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in the logits' storage
                probs.scatter_add_(1, target, torch.full_like(lse, -1.0).unsqueeze(1))
                dlogits = probs.mul_(valid.unsqueeze(1)).to(dtype)
                del logits, probs
                if need_h:
                    torch.mm(dlogits, w, out=grad_h[start:start + chunk])
                if need_w:
                    part = dlogits.t() @ hc
                    if grad_w is None:
                        grad_w = part if chunk >= n else part.float()
                    else:
                        grad_w += part
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = hidden.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = (grad_h * grad_loss.to(grad_h.dtype)).to(ctx.dtypes)
        if grad_w is not None:
            grad_w = grad_w * grad_loss.to(grad_w.dtype)
        return grad_h, grad_w, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk: int | None = None) -> torch.Tensor:
    """sum over valid tokens of cross_entropy(hidden @ weight.T, labels), never holding all the logits.

    hidden [..., dim], weight [vocab, dim], labels [...] (IGNORE_INDEX marks tokens without a target)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    return _LinearCrossEntropy.apply(h, weight, labels, chunk or chunk_tokens(weight.shape[0], h.shape[0]))
