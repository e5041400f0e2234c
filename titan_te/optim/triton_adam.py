"""One Triton kernel for AdamW on FP32 weights, or on TE delayed-scaling FP8 weights with FP32 masters,
with moments of any dtype.

Per element it reads the gradient, the FP32 weight (or master) and both moments once and writes them
once, and for FP8 weights the FP8 byte too (21 bytes with FP32 gradients and bf16 moments), where the
two-pass path (TE's multi_tensor_adam on the masters, then one `quantize_` per weight) reads the new
master a second time and launches several kernels per weight. TE's multi_tensor_adam on FP32 weights
with bf16 moments moves the same bytes at a fraction of this kernel's bandwidth (README: optimizers), and
needs the gradient-clipping factor applied in a pass of its own. The math is TE's AdamW (mode 1, bias
correction): m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m/bc1 / (sqrt(v/bc2) + eps) + wd p).
The FP8 write follows TE's delayed-scaling cast: saturate(p * scale), amax = max(amax, |p|) into the
quantizer's amax, scale_inv = 1 / scale.
"""
from __future__ import annotations

import functools

import torch

from titan_te.te import tensors


BLOCK, WARPS = 4096, 8  # elements per program and its warps (benchmarks/optim_bench.py --triton_block/_warps)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adam(g_ptr, p_ptr, m_ptr, v_ptr, q_ptr, scale_ptr, amax_ptr, scale_inv_ptr, gscale_ptr, n, lr, beta1,
             beta2, eps, wd, bc1, bc2, fp8_max, HAS_GSCALE: tl.constexpr, WRITE_FP8: tl.constexpr,
             BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_GSCALE:  # the gradient-clipping coefficient, applied here instead of in a pass of its own
            g = g * tl.load(gscale_ptr)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.sqrt(v / bc2) + eps
        p = p - lr * ((m / bc1) / denom + wd * p)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
        if WRITE_FP8:
            scale = tl.load(scale_ptr)
            q = tl.minimum(tl.maximum(p * scale, -fp8_max), fp8_max)
            tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
            tl.atomic_max(amax_ptr, tl.max(tl.where(mask, tl.abs(p), 0.0), axis=0))
            tl.store(scale_inv_ptr, 1.0 / scale, mask=pid == 0)

    return adam


def adam_fp8_(grads, weights, masters, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, wd, step,
              grad_scale: torch.Tensor | None = None) -> None:
    """Update FP32 masters and moments in place and write each delayed-scaling Float8Tensor weight
    from its new master (one launch per tensor); the gradients are read times `grad_scale` (a device
    scalar) when given."""
    kernel = _kernel()
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    for g, w, p, m, v in zip(grads, weights, masters, exp_avgs, exp_avg_sqs):
        n = p.numel()
        if n == 0:
            continue
        fp8 = tensors.delayed_fp8(w)
        gscale = grad_scale if grad_scale is not None else fp8.scale  # any pointer when unused
        kernel[(-(-n // BLOCK),)](g, p, m, v, fp8.data, fp8.scale, fp8.amax, fp8.scale_inv, gscale, n, lr,
                                  beta1, beta2, eps, wd, bc1, bc2, fp8.fp8_max,
                                  HAS_GSCALE=grad_scale is not None, WRITE_FP8=True, BLOCK=BLOCK, num_warps=WARPS)
        tensors.written_in_place(w)


def adam_(grads, weights, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, wd, step,
          grad_scale: torch.Tensor | None = None) -> None:
    """Update FP32 weights and their moments in place (one launch per tensor); the gradients are read
    times `grad_scale` (a device scalar) when given."""
    kernel = _kernel()
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    for g, p, m, v in zip(grads, weights, exp_avgs, exp_avg_sqs):
        n = p.numel()
        if n == 0:
            continue
        gscale = grad_scale if grad_scale is not None else p  # any pointer when unused
        kernel[(-(-n // BLOCK),)](g, p, m, v, p, p, p, p, gscale, n, lr, beta1, beta2, eps, wd, bc1, bc2, 0.0,
                                  HAS_GSCALE=grad_scale is not None, WRITE_FP8=False, BLOCK=BLOCK, num_warps=WARPS)
