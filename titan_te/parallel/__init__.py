"""Parallelism registry: how the model is spread over the data-parallel ranks."""
from dataclasses import dataclass
from typing import Callable

from titan_te.registry import Registry


@dataclass
class ParallelSpec:
    name: str
    # apply(model, dist_env, parallelism_cfg, mp_policy_dtypes) -> model, called on the meta model
    apply: Callable
    casts_params: bool = False  # True when it applies the mixed-precision policy itself (FSDP2)


PARALLELISMS: Registry[ParallelSpec] = Registry("data parallelism")

from titan_te.parallel import data_parallel  # noqa: E402,F401  (registers fsdp, hsdp, ddp, none)
