"""What this machine can run: device choice and the hardware checks of config validation."""
from __future__ import annotations

import torch

# cuDNN runs TE's FP8 attention backward deterministically from this version on (TE 2.20's backend rules)
DETERMINISTIC_FP8_ATTENTION_CUDNN = (9, 19, 0)


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
    fp8_backends = [n for n in BACKENDS.names() if BACKENDS.get(n).fp8]
    if device == "cuda" and not torch.cuda.is_available():
        installs = "; ".join(f"{n}: {BACKENDS.get(n).install}" for n in fp8_backends if BACKENDS.get(n).install)
        raise ConfigError(f"training.device = 'cuda' but no CUDA GPU is visible (a CUDA build of torch and a "
                          f"driver are needed; FP8 also needs {installs}); use --training.device=cpu {where}")
    backend = resolve_backend(cfg.model.backend, device)
    spec = BACKENDS.get(backend)
    portable = ", ".join(f"--model.backend={n}" for n in BACKENDS.names() if not BACKENDS.get(n).needs_cuda)
    reason = spec.available()
    if reason:
        install = f" (install: {spec.install})" if spec.install else ""
        raise ConfigError(f"model.backend = '{backend}' cannot run here: {reason}{install}; use {portable} "
                          f"(runs on CPU and GPU) {where}")
    if spec.needs_cuda and device != "cuda":
        raise ConfigError(f"model.backend = '{backend}' needs training.device = cuda; use {portable} {where}")
    if not cfg.fp8.enable:
        return
    if not spec.fp8:
        raise ConfigError(f"fp8.enable = true needs model.backend = {' or '.join(repr(n) for n in fp8_backends)} "
                          f"(Transformer Engine on a CUDA GPU); this run uses '{backend}'. Use --fp8.enable=false to "
                          f"train in bf16/fp32 {where}")
    from titan_te.fp8 import RECIPES

    need = RECIPES.get(cfg.fp8.recipe).min_compute_capability
    have = torch.cuda.get_device_capability()
    if have < need:
        here = ", ".join(n for n in RECIPES.names() if RECIPES.get(n).min_compute_capability <= have)
        raise ConfigError(f"fp8.recipe = '{cfg.fp8.recipe}' needs compute capability {need[0]}.{need[1]}+ "
                          f"(this GPU is {have[0]}.{have[1]}, {torch.cuda.get_device_name()}); "
                          f"this GPU runs {here or 'none of them'} {where}")
    if cfg.fp8.attention:
        _check_fp8_attention(cfg, RECIPES.get(cfg.fp8.recipe), have, where)
    if cfg.fp8.head != "off":
        from titan_te import triton_support

        if not triton_support.available():
            raise ConfigError(f"fp8.head = '{cfg.fp8.head}' runs in the Triton cross-entropy kernel, and Triton "
                              f"cannot be imported here (a CUDA build of torch ships it); set --fp8.head=off {where}")


def _cudnn_version() -> tuple[int, int, int]:
    """The cuDNN that TE's attention runs on."""
    from transformer_engine.pytorch.utils import get_cudnn_version

    return tuple(get_cudnn_version())


def _check_fp8_attention(cfg, spec, have: tuple[int, int], where: str) -> None:
    from titan_te.errors import ConfigError

    need = spec.fp8_attention
    if have < need:
        raise ConfigError(f"fp8.attention with the {spec.name} recipe needs compute capability {need[0]}.{need[1]}+ "
                          f"(this GPU is {have[0]}.{have[1]}); use --fp8.recipe=delayed or --fp8.attention=false "
                          f"{where}")
    cudnn = _cudnn_version()
    if cfg.training.deterministic and cudnn < DETERMINISTIC_FP8_ATTENTION_CUDNN:
        raise ConfigError(f"fp8.attention with training.deterministic = true: cuDNN "
                          f"{'.'.join(map(str, cudnn))} has no deterministic FP8 attention backward (it needs "
                          f"{'.'.join(map(str, DETERMINISTIC_FP8_ATTENTION_CUDNN))}); set "
                          f"--training.deterministic=false or --fp8.attention=false {where}")
