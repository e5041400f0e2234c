"""TE's compiled kernels and classes that other components use: the multi-tensor Adam kernels, FusedAdam."""
from __future__ import annotations

import logging

import torch

from titan_te.errors import ConfigError

logger = logging.getLogger("titan_te")


def adam_kernels(who: str):
    """TE's extension module with its multi-tensor Adam kernels, or None without TE or CUDA (`who` names the
    option that asked, for the messages). An installed but broken TE is the user's to fix: one line."""
    if not torch.cuda.is_available():
        return None
    try:
        # the extension runs its Adam kernels slower unless transformer_engine.pytorch has initialized it
        # first (train_bench measures it), so load it the way TE does
        import transformer_engine.pytorch  # noqa: F401
        import transformer_engine_torch as tex
    except ImportError:  # not installed: the caller's fallback, said once
        logger.warning(f"{who}: Transformer Engine is not installed; its CUDA kernels are replaced by torch's "
                       f"foreach math (slower)")
        return None
    except Exception as e:  # noqa: BLE001 -- installed but broken (a wrong CUDA or torch build)
        raise ConfigError(f"{who}: Transformer Engine is installed but cannot be loaded "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); reinstall it for "
                          f"this torch and CUDA, or use --optimizer.name=adamw") from None
    return tex


def shipped_fused_adam():
    """TE's own FusedAdam optimizer class."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    return FusedAdam
