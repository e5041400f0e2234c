"""Optimizer and LR-decay registries."""
from dataclasses import dataclass
from typing import Callable

from titan_te.registry import Registry


def adam_state_bytes(ocfg, low_precision_weights: bool) -> float:
    """Bytes per parameter of Adam's state: two moments, plus an FP32 master of low-precision weights."""
    moments = 2 * (2 if ocfg.moment_dtype == "bfloat16" else 4)
    return moments + (4 if ocfg.master_weights and low_precision_weights else 0)


ADAM = ("lr", "weight_decay", "beta1", "beta2", "eps")
LEAN_ADAM = ADAM + ("master_weights", "moment_dtype", "store_param_remainders")


def adam_facts(ocfg, options=None) -> dict:
    """What an Adam checkpoint's state depends on (another value cannot load into it)."""
    return {"moment_dtype": ocfg.moment_dtype, "master_weights": ocfg.master_weights}


@dataclass
class OptimizerSpec:
    name: str
    # build(named_params, optimizer_cfg, device_type[, options]) -> torch.optim.Optimizer; `options` (the
    # instance of `options` below, from [optimizer.<name>]) is passed when the spec declares options
    build: Callable
    # state_bytes(optimizer_cfg, low_precision_weights) -> optimizer-state bytes per parameter (memory estimate)
    state_bytes: Callable = adam_state_bytes
    # seeds its FP32 masters from the pre-quantization init values (fp8.preserve_high_precision_init)
    takes_high_precision_init: bool = False
    # reads bf16 gradients of FP32 weights (model.wgrad_dtype = bfloat16), e.g. by converting as it loads them
    reads_low_precision_grads: bool = False
    options: type | None = None  # a dataclass of opt() fields: this optimizer's own [optimizer.<name>] section
    reads: tuple[str, ...] = ADAM  # the shared [optimizer] options it uses (--help says so; others are refused)
    # facts(optimizer_cfg, its own options or None) -> what its checkpointed state depends on (kept in the
    # manifest, checked on resume)
    facts: Callable = adam_facts
    # unavailable(device) -> why it cannot run on `device` ("cpu" or "cuda") on this machine; "" when it can
    unavailable: Callable[[str], str] = lambda device: ""


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer")
LR_DECAYS: Registry[Callable[[float], float]] = Registry("lr decay")  # progress in [0, 1] -> factor in [0, 1]

from titan_te.optim import adamw, fused_adam, lr_schedule, sgd, te_fused_adam  # noqa: E402,F401  (register entries)
