"""Causal attention at the presets' shapes, forward and backward, on one GPU: TE's DotProductAttention as the
blocks call it (bshd, grouped-query heads) on cuDNN's fused kernels (`te`: model.attention_kernel = cudnn, TE's
own choice on Hopper) and on FlashAttention (`te_flash`: = flash; TE 2.20 runs FlashAttention-4 where the
`flash-attn-4` package is installed), torch's SDPA on cuDNN, and FlashAttention-4 called directly (CuTe DSL
kernels). Prints per
shape and kernel the milliseconds (median of CUDA-event timings) of the forward and of forward plus backward,
TFLOP/s by Megatron's count (causal attention's scores halved), the first call's time (a JIT kernel compiles
there) and the largest difference of the output and the input gradients from TE's, relative to TE's largest value.

    python benchmarks/attention_bench.py                    # the 1B and 8B presets' shapes
    python benchmarks/attention_bench.py --shapes 1B --reps 30
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from cuda_timing import median_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # titan_te of this checkout

from titan_te.te import attention  # noqa: E402  (imports no Transformer Engine until a kernel is chosen)

# (batch, sequence, query heads, key/value heads, head dim) of one step of each preset
SHAPES = {"1B": (4, 8192, 32, 8, 64), "8B": (1, 8192, 32, 8, 128)}


def te_attention(h: int, hkv: int, d: int, kernel: str = "cudnn"):
    """TE's DotProductAttention with model.attention_kernel's switches (titan_te/te/attention.py): cudnn, or
    flash (FlashAttention-4 once installed; TE 2.20 prefers cuDNN's fused kernels on Hopper otherwise)."""
    import transformer_engine.pytorch as te

    reason = attention.missing(kernel)
    if reason:
        raise RuntimeError(reason)
    attention.use(kernel)
    core = te.DotProductAttention(num_attention_heads=h, kv_channels=d, num_gqa_groups=hkv, attention_dropout=0.0,
                                  attn_mask_type="causal", qkv_format="bshd")
    return lambda q, k, v: core(q, k, v).view(q.shape)


def sdpa_cudnn(h: int, hkv: int, d: int):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)
    return run


def flash4(h: int, hkv: int, d: int, deterministic: bool = False):
    from flash_attn.cute import flash_attn_func

    return lambda q, k, v: flash_attn_func(q, k, v, causal=True, deterministic=deterministic)[0]


# flash4_det: FA4's deterministic backward, which training.deterministic asks for (exact reruns and resumes)
KERNELS = {"te": te_attention, "te_flash": lambda h, hkv, d: te_attention(h, hkv, d, "flash"),
           "sdpa_cudnn": sdpa_cudnn, "flash4": flash4, "flash4_det": lambda h, hkv, d: flash4(h, hkv, d, True)}


def inputs(b: int, s: int, h: int, hkv: int, d: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for n in (h, hkv, hkv))
    grad = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, grad


def measure(name: str, shape: tuple, reps: int) -> dict:
    b, s, h, hkv, d = shape
    q, k, v, grad = inputs(*shape)
    attend = KERNELS[name](h, hkv, d)
    t0 = time.perf_counter()
    out = attend(q, k, v)
    out.backward(grad)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    result = {"out": out.detach(), "grads": [t.grad.detach().clone() for t in (q, k, v)], "first_s": first,
              "backend": attention.ran() if name.startswith("te") else name}

    def step():
        for t in (q, k, v):
            t.grad = None
        attend(q, k, v).backward(grad)

    with torch.no_grad():
        result["fwd_ms"] = median_ms(lambda: attend(q, k, v), reps)
    result["step_ms"] = median_ms(step, reps)
    flops = 4 * b * s * s * h * d / 2  # causal: half the scores (Megatron's count)
    result["fwd_tflops"] = flops / result["fwd_ms"] / 1e9
    result["bwd_tflops"] = 2.5 * flops / (result["step_ms"] - result["fwd_ms"]) / 1e9
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {list(KERNELS)}")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    try:  # before torch loads its own cuDNN: TE's library links the machine's, and the second one loaded failed
        import transformer_engine.pytorch  # noqa: F401  (undefined cuDNN symbols in TE's rows, H200, 2026-12-07)
    except ImportError:
        pass
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print("| shape | kernel | ran | fwd ms | fwd+bwd ms | fwd TFLOP/s | bwd TFLOP/s | first call s | out gap | "
          "dq dk dv gaps |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for shape_name in args.shapes.split(","):
        ref = None
        for name in args.kernels.split(","):
            try:
                r = measure(name, SHAPES[shape_name], args.reps)
            except Exception as e:  # a kernel this machine lacks or refuses: its row says why, the others run
                print(f"| {shape_name} | {name} | {type(e).__name__}: {str(e).splitlines()[0][:120]} |")
                continue
            ref = ref or r
            gaps = " ".join(f"{attention.gap(a, b):.1e}" for a, b in zip(r["grads"], ref["grads"]))
            out_gap = attention.gap(r["out"], ref["out"])
            print(f"| {shape_name} | {name} | {r['backend']} | {r['fwd_ms']:.2f} | {r['step_ms']:.2f} | {r['fwd_tflops']:.0f} | "
                  f"{r['bwd_tflops']:.0f} | {r['first_s']:.1f} | {out_gap:.1e} | {gaps} |")
            del r
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
