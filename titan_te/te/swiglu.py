"""SwiGLU and its backward fused with their FP8 casts, for TE's LayerNormMLP under delayed scaling (fp8.fused_swiglu).

TE 2.20 runs an FP8 SwiGLU MLP's activation in separate passes over the FFN-wide tensors: forward, SwiGLU with its
row-wise FP8 cast, then a transpose of those bytes (the column-wise copy the FC2 weight gradient reads);
backward, SwiGLU's derivative written in bf16, then a cast-transpose of it that also sums a bias gradient that a
bias-free MLP discards. Each kernel here does one pass: it reads SwiGLU's input (and the incoming gradient) once
and writes the row-wise and the column-wise FP8 bytes. With the scale known before the data (delayed scaling:
it comes from earlier passes' amaxes) the cast needs no second pass; each kernel records its amax into the
quantizer's amax and writes scale_inv = 1 / scale, as TE's casts do.

Numerics follow TE's kernels: SwiGLU(x) = silu(a) * b for x = [a | b]; its derivative is
[g * b * silu'(a), g * silu(a)], rounded to bf16 before its cast as TE's two-kernel path does (its amax is that of
the rounded values); casts saturate and round to nearest even. `install(model)` puts these functions into TE's
activation table for swiglu under delayed scaling (the FP8 policy calls it, fp8.fused_swiglu); any other case
(another quantizer, a layout the kernels do not take) runs TE's own functions.
"""
from __future__ import annotations

import functools

import torch

from titan_te.te import tensors

BLOCK_ROWS = 64
BLOCK_COLS = 64


@functools.cache
def _kernels():
    from titan_te.te import swiglu_kernels  # imports triton

    return swiglu_kernels.swiglu_cast_transpose, swiglu_kernels.dswiglu_cast_transpose


def _takes(quantizer, *ts: torch.Tensor) -> bool:
    """Whether the kernels take this case: a delayed-scaling quantizer that wants row-wise bytes, contiguous CUDA
    inputs of a float dtype and an even last dimension."""
    return (tensors.is_delayed_quantizer(quantizer) and tensors.quantizer_usage(quantizer)[0]
            and all(t.is_cuda and t.is_contiguous() and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
                    for t in ts)
            and ts[-1].shape[-1] % 2 == 0)


def _launch(kernel, out, args, M: int, N: int) -> None:
    grid = (-(-M // BLOCK_ROWS), -(-N // BLOCK_COLS))
    kernel[grid](*args, out.data, out.transpose if out.transpose is not None else out.data, out.scale, out.amax,
                 out.scale_inv, M, N, out.fp8_max, TRANSPOSE=out.transpose is not None, BM=BLOCK_ROWS,
                 BN=BLOCK_COLS, num_warps=4)


def swiglu_fp8(te_swiglu, x: torch.Tensor, quantizer, **act_params):
    """SwiGLU of `x` ([..., 2N]) quantized by `quantizer`: one kernel, or TE's `te_swiglu` where it does not apply."""
    if quantizer is None or act_params or not _takes(quantizer, x):
        return te_swiglu(x, quantizer, **act_params)
    n = x.shape[-1] // 2
    result, out = tensors.new_delayed(quantizer, (*x.shape[:-1], n), x.dtype, x.device)
    m = x.numel() // x.shape[-1]
    if m:
        _launch(_kernels()[0], out, (x,), m, n)
    return result


def dswiglu_fp8(te_dswiglu, grad: torch.Tensor, x: torch.Tensor, quantizer, **act_params):
    """(None, the gradient into SwiGLU's input `x` quantized by `quantizer`) for the incoming gradient `grad`: one
    kernel, or TE's `te_dswiglu` and cast where it does not apply. None: the bias gradient, which an MLP
    without biases does not read (install() checks that every MLP is one)."""
    if act_params or not _takes(quantizer, grad, x) or grad.shape[-1] * 2 != x.shape[-1]:
        import transformer_engine_torch as tex

        return tex.bgrad_quantize(te_dswiglu(grad, x, None, **act_params), quantizer)
    n = grad.shape[-1]
    result, out = tensors.new_delayed(quantizer, x.shape, grad.dtype, x.device)
    m = grad.numel() // n
    if m:
        _launch(_kernels()[1], out, (grad, x), m, n)
    return None, result


_ON = False  # whether the patched table hands out the fused functions (install / uninstall)


def _patched(original):
    """TE's activation-table lookup with the fused functions for swiglu under delayed scaling while _ON."""

    @functools.wraps(original)
    def act_func(activation, recipe=None):
        funcs = original(activation, recipe)
        if not _ON or activation != "swiglu" or recipe is None or not recipe.delayed():
            return funcs
        fwd, bwd, _ = funcs
        return (functools.partial(swiglu_fp8, fwd), bwd, functools.partial(dswiglu_fp8, bwd))

    act_func.titan_te_fused = True
    return act_func


def install(model) -> int:
    """Route the SwiGLU MLPs of this process through the fused kernels: the number of `model`'s MLPs that use them
    (0, and nothing routed, when some MLP has a bias, whose gradient the fused backward does not compute, or
    another activation)."""
    global _ON
    from transformer_engine.pytorch.module import layernorm_mlp

    mlps = [m for m in model.modules() if isinstance(m, layernorm_mlp.LayerNormMLP)]
    _ON = bool(mlps) and all(m.activation == "swiglu" and not m.use_bias for m in mlps)
    if _ON and not getattr(layernorm_mlp._act_func, "titan_te_fused", False):
        layernorm_mlp._act_func = _patched(layernorm_mlp._act_func)
    return len(mlps) if _ON else 0


def uninstall() -> None:
    """TE's own kernels again (a later run in this process without fp8.fused_swiglu)."""
    global _ON
    _ON = False
