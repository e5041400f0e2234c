"""FP8 recipes: each builder is registered by its `fp8.recipe` name, with the compute capability it needs.

TE is imported inside the builders, so config validation can list recipes on a machine without TE.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from titan_te.registry import Registry


@dataclass
class RecipeSpec:
    name: str
    build: Callable  # build(fp8_cfg) -> a TE recipe object
    min_compute_capability: tuple[int, int]  # Hopper (9, 0) runs delayed/current/block; MX/NV FP4 need Blackwell
    # the compute capability from which TE runs attention itself in FP8 under this recipe (fp8.attention,
    # cuDNN's FP8 kernels); None: never
    fp8_attention: tuple[int, int] | None = None
    reads: tuple[str, ...] = ()  # the [fp8] options of only some recipes that this one reads (delayed scaling's)
    # scales that come from earlier passes' amaxes (delayed scaling): a run's first backward has none to use, and
    # a cast knows its scale before it sees the data (one pass: fp8.fused_swiglu)
    scales_from_history: bool = False


RECIPES: Registry[RecipeSpec] = Registry("fp8 recipe")


def recipe(name: str, min_cc: tuple[int, int], fp8_attention: tuple[int, int] | None = None,
           reads: tuple[str, ...] = (), scales_from_history: bool = False):
    def add(build):
        RECIPES.register(name)(RecipeSpec(name, build, min_cc, fp8_attention, reads, scales_from_history))
        return build

    return add


def _format(fcfg):
    from transformer_engine.common.recipe import Format

    return getattr(Format, fcfg.fp8_format)


@recipe("delayed", (8, 9), fp8_attention=(9, 0), scales_from_history=True,
        reads=("amax_history_len", "amax_compute_algo", "margin", "calibrate_first_step", "fused_swiglu"))
def _delayed(fcfg):
    from transformer_engine.common.recipe import DelayedScaling

    return DelayedScaling(fp8_format=_format(fcfg), amax_history_len=fcfg.amax_history_len,
                          amax_compute_algo=fcfg.amax_compute_algo, margin=fcfg.margin, fp8_dpa=fcfg.attention)


@recipe("current", (8, 9), fp8_attention=(10, 0))  # TE: FP8 attention with current scaling on Blackwell
def _current(fcfg):
    from transformer_engine.common.recipe import Float8CurrentScaling

    return Float8CurrentScaling(fp8_format=_format(fcfg), fp8_dpa=fcfg.attention)


@recipe("block", (9, 0))
def _block(fcfg):
    from transformer_engine.common.recipe import Float8BlockScaling

    return Float8BlockScaling(fp8_format=_format(fcfg))


@recipe("mxfp8", (10, 0))
def _mxfp8(fcfg):
    from transformer_engine.common.recipe import MXFP8BlockScaling

    return MXFP8BlockScaling(fp8_format=_format(fcfg))


@recipe("nvfp4", (10, 0))
def _nvfp4(fcfg):
    from transformer_engine.common.recipe import NVFP4BlockScaling

    return NVFP4BlockScaling()
