"""Which kernels TE's DotProductAttention runs (model.attention_kernel): its own choice, cuDNN's fused kernels, or
an installed FlashAttention package (flash-attn-4's CuTe kernels, FlashAttention 3 or 2).

TE 2.20 chooses per call among the backends its environment switches leave on (NVTE_FUSED_ATTN, NVTE_FLASH_ATTN),
and on Hopper prefers cuDNN where both could run; it caches the choice until the switches' cache is marked stale.
With training.deterministic, torch's deterministic mode is on before the model is built, and TE then asks every
backend for its deterministic backward (FlashAttention's included).

TE 2.20.2 hands flash-attn-4 FlashAttention 2's window convention: (-1, 0) for causal attention, -1 meaning
unbounded. FA4 reads a window edge of -1 as a local window of -1 keys (None is unbounded there), so every query
attended to no earlier token: 1B-wide blocks trained 39% above cuDNN's loss in 20 steps and attention took a ninth
of its time (H200, 2026-12-07). `use("flash")` therefore passes negative window edges to FA4 as None, and
`check(...)` compares TE's flash attention with torch's on a small causal problem before a run trusts it.
"""
from __future__ import annotations

import importlib.util
import os

# the import names of the FlashAttention packages TE 2.20 runs, newest first
FLASH_PACKAGES = (("flash_attn.cute", "flash-attn-4"), ("flash_attn_interface", "flash-attn 3"),
                  ("flash_attn", "flash-attn 2"))


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package missing
        return False


def flash_package() -> str:
    """The installed FlashAttention package TE would run, or ''."""
    return next((label for name, label in FLASH_PACKAGES if _importable(name)), "")


def missing(kernel: str) -> str:
    """Why `kernel` cannot run here ('' when it can)."""
    if kernel == "flash" and not flash_package():
        return "no FlashAttention package is installed (pip install flash-attn-4)"
    return ""


def use(kernel: str) -> None:
    """Turn TE's backend switches for this process to `kernel` (auto: as the environment set them)."""
    switches = {"cudnn": {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0"},
                "flash": {"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "1"}}.get(kernel, {})
    if not switches:
        return
    os.environ.update(switches)
    _backends()["backend_selection_requires_update"] = True  # TE caches its choice, not the switches
    if kernel == "flash":
        _unbounded_windows_as_none()


def _unbounded_windows_as_none() -> None:
    """Wrap TE's handles on FA4's functions so that a negative window edge (FlashAttention 2's "unbounded") reaches
    FA4 as None (its "unbounded"); TE looks the handles up at each call."""
    from transformer_engine.pytorch.attention.dot_product_attention import backends

    for name in ("flash_attn_func_v4", "flash_attn_varlen_func_v4"):
        fa4 = getattr(backends, name, None)
        if fa4 is None or getattr(fa4, "unbounded_as_none", False):
            continue

        def call(*args, _fa4=fa4, window_size=(None, None), **kwargs):
            return _fa4(*args, window_size=window_edges(window_size), **kwargs)

        call.unbounded_as_none = True
        setattr(backends, name, call)


def window_edges(window: tuple) -> tuple:
    """FlashAttention 2's window edges (-1: unbounded) in FA4's terms (None: unbounded)."""
    return tuple(None if edge is not None and edge < 0 else edge for edge in window)


def check(kernel: str, heads: int, kv_heads: int, head_dim: int, device) -> str:
    """Why `kernel` computes causal attention wrongly here ('' when its output and input gradients match torch's
    attention in FP32 within bf16's rounding): a run checks the kernel it asked for before it trains with it."""
    if kernel != "flash":
        return ""
    import torch
    import torch.nn.functional as F
    import transformer_engine.pytorch as te
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, 256, n, head_dim, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
               for n in (heads, kv_heads, kv_heads))
    core = te.DotProductAttention(num_attention_heads=heads, kv_channels=head_dim, num_gqa_groups=kv_heads,
                                  attention_dropout=0.0, attn_mask_type="causal", qkv_format="bshd")
    out = core(q, k, v).view(q.shape)
    out.float().square().sum().backward()
    ran_here = ran()
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):  # the plain formula (deterministic, as training.deterministic may demand)
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref_in), is_causal=True,
                                             enable_gqa=True).transpose(1, 2)
    ref.square().sum().backward()
    worst = max(gap(a, b) for a, b in [(out, ref)] + [(t.grad, r.grad) for t, r in zip((q, k, v), ref_in)])
    if not ran_here.startswith("FlashAttention"):
        return f"TE ran {ran_here} instead of FlashAttention for a causal {head_dim}-wide problem"
    if worst > 0.05:
        return (f"TE's FlashAttention ({ran_here}) computes causal attention wrongly here: its output or input "
                f"gradients differ from torch's attention by {worst:.2f} of their largest value")
    return ""


def gap(a, ref) -> float:
    """The largest difference of `a` from `ref`, relative to ref's largest value."""
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def ran() -> str:
    """The kernels TE chose for its latest attention call, in words."""
    chosen = _backends()
    if chosen.get("use_flash_attention"):
        return f"FlashAttention {chosen.get('flash_attention_backend')}"
    if chosen.get("use_fused_attention"):
        return f"cuDNN fused attention (sub-backend {int(chosen['fused_attention_backend'])})"
    return "TE's unfused attention" if chosen.get("use_unfused_attention") else "none yet"


def _backends() -> dict:
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

    return dpa._attention_backends
