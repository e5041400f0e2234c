"""What this machine can run: device choice and the hardware checks of config validation."""
from __future__ import annotations

import torch

# FP8 recipe -> minimum CUDA compute capability. Hopper (sm_90) runs delayed/current/block scaling;
# MXFP8 and NVFP4 need Blackwell (sm_100).
FP8_RECIPE_MIN_CC = {"delayed": (8, 9), "current": (8, 9), "block": (9, 0), "mxfp8": (10, 0), "nvfp4": (10, 0)}


TE_INSTALL = "pip install --no-build-isolation 'transformer_engine[pytorch]'"


def resolve_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def resolve_backend(choice: str, device: str) -> str:
    if choice != "auto":
        return choice
    from titan_te.layers import BACKENDS

    return "te" if device == "cuda" and not BACKENDS.get("te").available() else "torch"


def check_hardware(cfg, where: str) -> None:
    from titan_te.errors import ConfigError
    from titan_te.layers import BACKENDS

    device = resolve_device(cfg.training.device)
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"training.device = 'cuda' but no CUDA GPU is visible (a CUDA build of torch and a "
                          f"driver are needed; FP8 also needs Transformer Engine: {TE_INSTALL}); use "
                          f"--training.device=cpu {where}")
    backend = resolve_backend(cfg.model.backend, device)
    reason = BACKENDS.get(backend).available()
    if reason:
        install = f" (install: {TE_INSTALL})" if backend == "te" else ""
        raise ConfigError(f"model.backend = '{backend}' cannot run here: {reason}{install}; "
                          f"use --model.backend=torch (runs on CPU and GPU) {where}")
    if backend == "te" and device != "cuda":
        raise ConfigError(f"model.backend = 'te' needs training.device = cuda; use --model.backend=torch {where}")
    if not cfg.fp8.enable:
        return
    if backend != "te":
        raise ConfigError(f"fp8.enable = true needs model.backend = 'te' (Transformer Engine on a CUDA GPU); "
                          f"this run uses '{backend}'. Use --fp8.enable=false to train in bf16/fp32 {where}")
    need = FP8_RECIPE_MIN_CC[cfg.fp8.recipe]
    have = torch.cuda.get_device_capability()
    if have < need:
        raise ConfigError(f"fp8.recipe = '{cfg.fp8.recipe}' needs compute capability {need[0]}.{need[1]}+ "
                          f"(this GPU is {have[0]}.{have[1]}, {torch.cuda.get_device_name()}); "
                          f"on Hopper use delayed, current or block {where}")
