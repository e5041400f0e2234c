"""SwiGLU's FP8 backward: TE's two kernels (the derivative in bf16, then a cast-transpose) against the fused one of
titan_te/te/swiglu.py (fp8.fused_swiglu), at the presets' MLP shapes, on one GPU. Prints, per shape, the
milliseconds of each (median of CUDA-event timings), the bytes the fused kernel must move over its time, and how
far its FP8 bytes lie from TE's.

    python benchmarks/swiglu_bench.py                 # the 1B and 8B presets' shapes (tokens of one step)
    python benchmarks/swiglu_bench.py --tokens 16384  # another token count for every shape
    python benchmarks/swiglu_bench.py --tiles 64x64x4,128x64x8,64x128x8   # the fused kernel's tile and warps
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_timing import median_ms  # noqa: E402
from titan_te.te import swiglu  # noqa: E402

SHAPES = {"1B": (4 * 8192, 8192), "8B": (8192, 14336)}  # (tokens per step, FFN width) of the presets


def quantizer(scale: float):
    """A delayed-scaling E5M2 quantizer (the gradients') of this scale, row-wise and column-wise."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    return Float8Quantizer(torch.full((1,), scale, device="cuda"), torch.zeros(1, device="cuda"),
                           tex.DType.kFloat8E5M2)


def agreement(a, b) -> tuple[float, float]:
    """(fraction of E5M2 bytes equal, largest difference relative to the larger value) of two tensors of one
    quantizer's scale, row-wise and column-wise bytes together."""
    equal, total, worst = 0, 0, 0.0
    for x, y in ((a._data, b._data), (a._transpose, b._transpose)):
        x, y = x.view(torch.float8_e5m2).float(), y.view(torch.float8_e5m2).float()
        equal += (x == y).sum().item()
        total += x.numel()
        worst = max(worst, ((x - y).abs() / torch.maximum(x.abs(), y.abs()).clamp_min(2.0 ** -16)).max().item())
    return equal / total, worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=0, help="tokens for every shape (0: the presets' step)")
    ap.add_argument("--tiles", default=f"{swiglu.BLOCK_ROWS}x{swiglu.BLOCK_COLS}x{swiglu.WARPS}",
                    help="comma-separated tiles of the fused kernel to time, rows x columns x warps")
    a = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in a.tiles.split(",")]
    if not torch.cuda.is_available():
        print("swiglu_bench needs a CUDA GPU with Transformer Engine", file=sys.stderr)
        return 2
    import transformer_engine.pytorch  # noqa: F401 -- initializes TE's extension
    import transformer_engine_torch as tex

    torch.manual_seed(0)
    print("| shape | tile | TE ms | fused ms | speedup | fused GB/s | E5M2 bytes equal | worst relative gap |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (m, n) in SHAPES.items():
        m = a.tokens or m
        x = torch.randn(m, 2 * n, device="cuda").mul_(2).bfloat16()
        g = torch.randn(m, n, device="cuda").mul_(1e-3).bfloat16()
        q_te, q_fused = quantizer(2.0 ** 14), quantizer(2.0 ** 14)
        te_fn = lambda: tex.bgrad_quantize(tex.dswiglu(g, x, None), q_te)[1]  # noqa: E731
        fused_fn = lambda: swiglu.dswiglu_fp8(tex.dswiglu, g, x, q_fused)[1]  # noqa: E731
        moved = g.numel() * 2 + x.numel() * 2 + 2 * x.numel()  # bf16 in, FP8 row-wise and column-wise out
        for rows, cols, warps in tiles:
            swiglu.BLOCK_ROWS, swiglu.BLOCK_COLS, swiglu.WARPS = rows, cols, warps
            q_te.amax.zero_()
            q_fused.amax.zero_()
            same, worst = agreement(te_fn(), fused_fn())
            amax_gap = abs(q_te.amax.item() - q_fused.amax.item()) / q_te.amax.item()
            t_te, t_fused = median_ms(te_fn, 20, warmup=1), median_ms(fused_fn, 20, warmup=1)
            print(f"| {name} ({m} x {n}) | {rows}x{cols}, {warps} warps | {t_te:.3f} | {t_fused:.3f} | "
                  f"{t_te / t_fused:.2f}x | {moved / t_fused / 1e6:,.0f} | {same:.5f} | {worst:.2f} (amax gap "
                  f"{amax_gap:.1e}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
