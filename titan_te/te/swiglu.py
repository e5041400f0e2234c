"""SwiGLU's derivative fused with its FP8 cast and transpose, for TE's LayerNormMLP under delayed scaling
(fp8.fused_swiglu).

TE 2.20's backward of an FP8 SwiGLU MLP makes two passes over FFN-wide tensors: it writes SwiGLU's derivative in
bf16, then reads it back in a cast-transpose that also sums a bias gradient, which a bias-free MLP discards. The
kernel here reads the incoming gradient and SwiGLU's input once and writes the row-wise and the column-wise FP8
bytes (the FC1 data and weight gradients read one each). With the scale known before the data (delayed scaling:
it comes from earlier passes' amaxes) the cast needs no second pass; the kernel records its amax into the
quantizer's amax and writes scale_inv = 1 / scale, as TE's casts do. (The forward has nothing to fuse: TE's
SwiGLU already writes its FP8 output in one pass, and makes its transpose only in the backward.)

Numerics follow TE's kernels: for x = [a | b] and the incoming gradient g, the derivative is
[g * b * silu'(a), g * silu(a)], rounded to bf16 before its cast as TE's two-pass path does (its amax is that of
the rounded values); casts saturate and round to nearest even. `install(model)` puts the function into TE's
activation table for swiglu under delayed scaling (the FP8 policy calls it, fp8.fused_swiglu); any other case
(another quantizer, a layout the kernel does not take) runs TE's own functions. Before that the policy checks the
kernel against TE's passes on the machine it runs on (`differs_from_te`) and keeps TE's kernels if they differ.
"""
from __future__ import annotations

import functools

import torch

from titan_te.te import tensors

BLOCK_ROWS, BLOCK_COLS, WARPS = 64, 64, 4  # the kernel's tile and warps per tile


def _takes(quantizer, grad: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the kernel takes this case: a delayed-scaling quantizer that wants row-wise bytes, contiguous bf16
    CUDA inputs (TE then writes the derivative in bf16, the rounding the kernel repeats), the gradient half as wide
    as SwiGLU's input."""
    return (tensors.is_delayed_quantizer(quantizer) and tensors.wants_rowwise(quantizer)
            and all(t.is_cuda and t.is_contiguous() and t.dtype == torch.bfloat16 for t in (grad, x))
            and x.shape[-1] == 2 * grad.shape[-1] and x.numel() == 2 * grad.numel())


def dswiglu_fp8(te_dswiglu, grad: torch.Tensor, x: torch.Tensor, quantizer, **act_params):
    """(None, the gradient into SwiGLU's input `x` quantized by `quantizer`) for the incoming gradient `grad`: one
    kernel, or TE's `te_dswiglu` and cast where it does not apply. None: the bias gradient, which an MLP
    without biases does not read (install() checks that every MLP is one)."""
    if act_params or not _takes(quantizer, grad, x):
        import transformer_engine_torch as tex

        return tex.bgrad_quantize(te_dswiglu(grad, x, None, **act_params), quantizer)
    from titan_te.te.swiglu_kernels import dswiglu_cast_transpose  # imports triton

    result, out = tensors.new_delayed(quantizer, x.shape, grad.dtype, x.device)
    n = grad.shape[-1]
    m = grad.numel() // n if n else 0
    if m:
        t = out.transpose
        dswiglu_cast_transpose[(-(-m // BLOCK_ROWS), -(-n // BLOCK_COLS))](
            grad, x, out.data, t if t is not None else out.data, out.scale, out.amax, out.scale_inv, m, n, out.fp8_max,
            TRANSPOSE=t is not None, BM=BLOCK_ROWS, BN=BLOCK_COLS, num_warps=WARPS)
    return None, result


def differs_from_te(device: torch.device) -> str:
    """'' when the kernel, compiled as training runs it (a shape every tile divides: Triton specializes on that),
    writes the bytes TE's two passes write, with and without the transpose; else what differed. Triton's code for
    it comes from the ptxas it bundles, and under some a tile of FP8 values stored twice, row-major and transposed,
    has come out corrupt in the transposed store (triton-lang/triton#11111; an Adam kernel of ours hit it), so
    training checks the kernel on its own machine before using it."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    gen = torch.Generator(device=device).manual_seed(0)
    m, n = 4 * BLOCK_ROWS, 4 * BLOCK_COLS
    x = (torch.randn(m, 2 * n, device=device, generator=gen) * 2).bfloat16()
    grad = (torch.randn(m, n, device=device, generator=gen) * 1e-3).bfloat16()
    for columnwise in (True, False):
        te_q, our_q = [Float8Quantizer(torch.full((1,), 2.0 ** 14, device=device), torch.zeros(1, device=device),
                                       tex.DType.kFloat8E5M2, rowwise=True, columnwise=columnwise) for _ in range(2)]
        (te_rows, _), (rows, cols) = (tensors.fp8_bytes(tex.bgrad_quantize(tex.dswiglu(grad, x, None), te_q)[1]),
                                      tensors.fp8_bytes(dswiglu_fp8(tex.dswiglu, grad, x, our_q)[1]))
        apart = (rows != te_rows).sum().item()  # TE's exp may round an element differently: a few may differ
        if apart > rows.numel() // 1000:
            return f"{apart} of the {rows.numel()} row-wise FP8 bytes of a {m}x{2 * n} gradient differ from TE's"
        if columnwise and not torch.equal(cols, rows.t()):
            return (f"{(cols != rows.t()).sum().item()} of the {cols.numel()} transposed FP8 bytes of a {m}x{2 * n} "
                    f"gradient are not the row-wise ones transposed")
    return ""


_ON = False  # whether the patched table hands out the fused backward (install / uninstall)


def _patched(original):
    """TE's activation-table lookup with the fused backward for swiglu under delayed scaling while _ON."""

    @functools.wraps(original)
    def act_func(activation, recipe=None):
        funcs = original(activation, recipe)
        if not _ON or activation != "swiglu" or recipe is None or not recipe.delayed():
            return funcs
        fwd, bwd, _ = funcs  # the third: TE's fused "derivative, bias gradient and cast", which it has for gelu
        return fwd, bwd, functools.partial(dswiglu_fp8, bwd)

    act_func.titan_te_fused = True
    return act_func


def install(model) -> int:
    """Route the SwiGLU MLPs of this process through the fused backward: the number of `model`'s MLPs that use them
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
