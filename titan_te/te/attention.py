"""Which kernels TE's DotProductAttention runs (model.attention_kernel): its own choice, cuDNN's fused kernels, or
an installed FlashAttention package (flash-attn-4's CuTe kernels, FlashAttention 3 or 2).

TE 2.20 chooses per call among the backends its environment switches leave on (NVTE_FUSED_ATTN, NVTE_FLASH_ATTN),
and on Hopper prefers cuDNN where both could run; it caches the choice until the switches' cache is marked stale.
With training.deterministic, torch's deterministic mode is on before the model is built, and TE then asks every
backend for its deterministic backward (FlashAttention's included).
"""
from __future__ import annotations

import importlib.util
import os

KERNELS = ("auto", "cudnn", "flash")
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
        return "no FlashAttention package is installed (pip install flash-attn-4; on Hopper its kernels need CUDA 12.9+)"
    return ""


def use(kernel: str) -> None:
    """Turn TE's backend switches for this process to `kernel` (auto: as the environment set them)."""
    switches = {"cudnn": {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0"},
                "flash": {"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "1"}}.get(kernel, {})
    if not switches:
        return
    os.environ.update(switches)
    _backends()["backend_selection_requires_update"] = True  # TE caches its choice, not the switches


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
