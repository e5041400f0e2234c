"""The Triton kernel of swiglu.py (this module imports triton; swiglu.py imports it only where it runs).

Each program takes a BM x BN tile of the incoming gradient (M x N; SwiGLU's input is [a | b], 2N wide), computes
both halves of the derivative there, casts them with the quantizer's scale and writes their row-wise bytes and,
with TRANSPOSE, their column-wise ones; its amax goes into the quantizer's amax by an atomic max.
"""
import triton
import triton.language as tl


@triton.jit
def _cast_store(v, data_ptr, t_ptr, rows, cols, offset, ld, M, N, scale, fp8_max, TRANSPOSE: tl.constexpr):
    """Saturating cast of the tile `v` (rows x cols of M x N) to the row-wise bytes (element (r, c) at
    r * ld + offset + c) and, with TRANSPOSE, to the column-wise ones (at (offset + c) * M + r)."""
    v = tl.minimum(tl.maximum(v * scale, -fp8_max), fp8_max)
    tl.store(data_ptr + rows[:, None] * ld + (offset + cols)[None, :], v.to(data_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))
    if TRANSPOSE:  # transposed before the cast (the same rounding): 32-bit tiles are what every layout takes
        tl.store(t_ptr + (offset + cols)[:, None] * M + rows[None, :], tl.trans(v).to(t_ptr.dtype.element_ty),
                 mask=(cols[:, None] < N) & (rows[None, :] < M))


@triton.jit
def dswiglu_cast_transpose(g_ptr, x_ptr, data_ptr, t_ptr, scale_ptr, amax_ptr, scale_inv_ptr, M, N, fp8_max,
                           TRANSPOSE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """FP8([g * b * silu'(a), g * silu(a)]) for x = [a | b] and the incoming gradient g, each half rounded to
    bf16 first (TE writes it in bf16 before its cast)."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    g = tl.load(g_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xrow = x_ptr + rows[:, None] * (2 * N) + cols[None, :]
    a = tl.load(xrow, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(xrow + N, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-a))
    da = ((a * s * (1.0 - s) + s) * g * b).to(tl.bfloat16).to(tl.float32)
    db = (a * s * g).to(tl.bfloat16).to(tl.float32)
    scale = tl.load(scale_ptr)
    _cast_store(da, data_ptr, t_ptr, rows, cols, 0, 2 * N, M, N, scale, fp8_max, TRANSPOSE)
    _cast_store(db, data_ptr, t_ptr, rows, cols, N, 2 * N, M, N, scale, fp8_max, TRANSPOSE)
    amax = tl.maximum(tl.where(mask, tl.abs(da), 0.0), tl.where(mask, tl.abs(db), 0.0))
    tl.atomic_max(amax_ptr, tl.max(tl.max(amax, axis=1), axis=0))
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
    tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale), mask=first)  # IEEE 1 / scale, as TE writes it
