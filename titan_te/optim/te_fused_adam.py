"""`te_fused_adam`: Transformer Engine's FusedAdam as shipped (CUDA only)."""
from __future__ import annotations

import torch

from titan_te.init_weights import local_tensor
from titan_te.optim import LEAN_ADAM, OPTIMIZERS, OptimizerSpec
from titan_te.optim.param_groups import decay_groups
from titan_te.te import kernels, tensors
from titan_te.te.layers import te_unavailable_reason


def build_te_fused_adam(named_params, ocfg, device_type: str):
    moment = getattr(torch, ocfg.moment_dtype)
    opt = kernels.shipped_fused_adam()(decay_groups(named_params, ocfg.weight_decay), lr=ocfg.lr,
                                       betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, adam_w_mode=True,
                                       master_weights=ocfg.master_weights, master_weight_dtype=torch.float32,
                                       exp_avg_dtype=moment, exp_avg_sq_dtype=moment,
                                       store_param_remainders=ocfg.store_param_remainders)
    # Its FP8 path writes the weights' bytes in place but leaves their cached transposes valid; a weight
    # that is not re-gathered every step (no FSDP) would feed the stale one to the next backward.
    fp8 = [w for w in (local_tensor(p) for _, p in named_params) if tensors.is_float8(w)]
    opt.register_step_post_hook(lambda *_: [tensors.written_in_place(w) for w in fp8])
    return opt


def _unavailable(device: str) -> str:
    return "Transformer Engine's FusedAdam runs on a CUDA GPU only" if device != "cuda" else te_unavailable_reason()


OPTIMIZERS.register("te_fused_adam")(OptimizerSpec(name="te_fused_adam", build=build_te_fused_adam,
                                                     reads=LEAN_ADAM, unavailable=_unavailable))
