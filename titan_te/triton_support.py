"""Whether Triton kernels can run here: a CUDA GPU and the triton package (it ships with CUDA builds of torch)."""
from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True
