"""`adamw`: torch.optim.AdamW, fused kernels on CUDA, foreach on CPU."""
from __future__ import annotations

import torch

from titan_te.optim import OPTIMIZERS, OptimizerSpec
from titan_te.optim.param_groups import decay_groups


def build_adamw(named_params, ocfg, device_type: str) -> torch.optim.Optimizer:
    kernel = {"fused": True} if device_type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(decay_groups(named_params, ocfg.weight_decay), lr=ocfg.lr,
                             betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, **kernel)


OPTIMIZERS.register("adamw")(OptimizerSpec(name="adamw", build=build_adamw,
                                              state_bytes=lambda ocfg, low_precision: 8.0,  # 2 FP32 moments
                                              facts=lambda ocfg, _: {"moment_dtype": "float32"}))
