"""What this machine can run: device choice and the hardware checks of config validation."""
from __future__ import annotations

import torch


def resolve_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def resolve_backend(choice: str, device: str, family_backends: tuple[str, ...] | None = None) -> str:
    """"auto": te on a GPU where TE runs and the model family has te blocks, else torch."""
    if choice != "auto":
        return choice
    from titan_te.layers import BACKENDS

    te = device == "cuda" and not BACKENDS.get("te").available() and "te" in (family_backends or ("te",))
    return "te" if te else "torch"


def _check_optimizer(name: str, device: str, where: str) -> None:
    from titan_te.errors import ConfigError
    from titan_te.optim import OPTIMIZERS

    reason = OPTIMIZERS.get(name).unavailable(device)
    if reason:
        usable = [n for n in OPTIMIZERS.names() if not OPTIMIZERS.get(n).unavailable(device)]
        raise ConfigError(f"optimizer.name = '{name}' cannot run here: {reason}; use "
                          f"{' or '.join('--optimizer.name=' + n for n in usable)} {where}")


def _check_attention(kernel: str, spec, backend: str, where: str) -> None:
    from titan_te.errors import ConfigError
    from titan_te.layers import BACKENDS

    if kernel == "auto":
        return
    if spec.attention is None:
        able = " or ".join(repr(n) for n in BACKENDS.names() if BACKENDS.get(n).attention is not None)
        raise ConfigError(f"model.attention_kernel = '{kernel}' needs model.backend = {able} (this run uses "
                          f"'{backend}'); use --model.attention_kernel=auto {where}")
    reason = spec.attention.missing(kernel)
    if reason:
        raise ConfigError(f"model.attention_kernel = '{kernel}' cannot run here: {reason}; or use "
                          f"--model.attention_kernel=auto {where}")


def check_hardware(cfg, where: str) -> None:
    from titan_te.errors import ConfigError
    from titan_te.layers import BACKENDS

    device = resolve_device(cfg.training.device)
    fp8_backends = [n for n in BACKENDS.names() if BACKENDS.get(n).fp8]
    if device == "cuda" and not torch.cuda.is_available():
        installs = "; ".join(f"{n}: {BACKENDS.get(n).install}" for n in fp8_backends if BACKENDS.get(n).install)
        raise ConfigError(f"training.device = 'cuda' but no CUDA GPU is visible (a CUDA build of torch and a "
                          f"driver are needed; FP8 also needs {installs}); use --training.device=cpu {where}")
    from titan_te.models import MODELS

    family = MODELS.get(cfg.model.name)
    backend = resolve_backend(cfg.model.backend, device, family.backends)
    if family.backends is not None and backend not in family.backends:
        raise ConfigError(f"model.backend = '{backend}': the {family.name} model has blocks for "
                          f"{', '.join(family.backends)} only; use --model.backend={family.backends[0]} {where}")
    spec = BACKENDS.get(backend)
    portable = ", ".join(f"--model.backend={n}" for n in BACKENDS.names() if not BACKENDS.get(n).needs_cuda)
    reason = spec.available()
    if reason:
        install = f" (install: {spec.install})" if spec.install else ""
        raise ConfigError(f"model.backend = '{backend}' cannot run here: {reason}{install}; use {portable} "
                          f"(runs on CPU and GPU) {where}")
    if spec.needs_cuda and device != "cuda":
        raise ConfigError(f"model.backend = '{backend}' needs training.device = cuda; use {portable} {where}")
    if cfg.activation_checkpoint.mode == "mlp" and not spec.recomputes_mlp:
        able = " or ".join(repr(n) for n in BACKENDS.names() if BACKENDS.get(n).recomputes_mlp)
        raise ConfigError(f"activation_checkpoint.mode = 'mlp' needs model.backend = {able} (this run uses "
                          f"'{backend}'); use --activation_checkpoint.mode=every_n or full {where}")
    _check_attention(cfg.model.attention_kernel, spec, backend, where)
    _check_optimizer(cfg.optimizer.name, device, where)
    if not cfg.fp8.enable:
        return
    if not spec.fp8:
        raise ConfigError(f"fp8.enable = true needs model.backend = {' or '.join(repr(n) for n in fp8_backends)} "
                          f"(Transformer Engine on a CUDA GPU); this run uses '{backend}'. Use --fp8.enable=false to "
                          f"train in bf16/fp32 {where}")
    from titan_te.te.checks import check_fp8

    check_fp8(cfg, where)
    from titan_te import triton_support

    if cfg.fp8.head != "off" and not triton_support.available():
        raise ConfigError(f"fp8.head = '{cfg.fp8.head}' runs in the Triton cross-entropy kernel, and Triton "
                          f"cannot be imported here (a CUDA build of torch ships it); set --fp8.head=off {where}")
    if cfg.fp8.fused_swiglu and not triton_support.available():
        raise ConfigError(f"fp8.fused_swiglu = true runs a Triton kernel, and Triton cannot be imported here (a CUDA "
                          f"build of torch ships it); set --fp8.fused_swiglu=false {where}")

