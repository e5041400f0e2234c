"""What this machine's TE, GPU and cuDNN can run of the [fp8] section, checked with the config."""
from __future__ import annotations

import torch

from titan_te.errors import ConfigError
from titan_te.te.recipes import RECIPES

# cuDNN runs TE's FP8 attention backward deterministically from this version on (TE 2.20's backend rules)
DETERMINISTIC_FP8_ATTENTION_CUDNN = (9, 19, 0)


def cudnn_version() -> tuple[int, int, int]:
    """The cuDNN that TE's attention runs on."""
    from transformer_engine.pytorch.utils import get_cudnn_version

    return tuple(get_cudnn_version())


def check_fp8(cfg, where: str) -> None:
    """The recipe on this GPU's compute capability; FP8 attention on it and on this cuDNN."""
    need = RECIPES.get(cfg.fp8.recipe).min_compute_capability
    have = torch.cuda.get_device_capability()
    if have < need:
        here = ", ".join(n for n in RECIPES.names() if RECIPES.get(n).min_compute_capability <= have)
        raise ConfigError(f"fp8.recipe = '{cfg.fp8.recipe}' needs compute capability {need[0]}.{need[1]}+ "
                          f"(this GPU is {have[0]}.{have[1]}, {torch.cuda.get_device_name()}); "
                          f"this GPU runs {here or 'none of them'} {where}")
    if not cfg.fp8.attention:
        return
    spec = RECIPES.get(cfg.fp8.recipe)
    need = spec.fp8_attention
    if have < need:
        raise ConfigError(f"fp8.attention with the {spec.name} recipe needs compute capability {need[0]}.{need[1]}+ "
                          f"(this GPU is {have[0]}.{have[1]}); use --fp8.recipe=delayed or --fp8.attention=false "
                          f"{where}")
    cudnn = cudnn_version()
    if cfg.training.deterministic and cudnn < DETERMINISTIC_FP8_ATTENTION_CUDNN:
        raise ConfigError(f"fp8.attention with training.deterministic = true: cuDNN "
                          f"{'.'.join(map(str, cudnn))} has no deterministic FP8 attention backward (it needs "
                          f"{'.'.join(map(str, DETERMINISTIC_FP8_ATTENTION_CUDNN))}); set "
                          f"--training.deterministic=false or --fp8.attention=false {where}")
