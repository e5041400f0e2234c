"""FP8 with Transformer Engine: recipes, the FP8-weight init context and the forward autocast.

Each recipe builder is registered by its `fp8.recipe` name. Imports of TE stay inside functions so
the CPU-only paths never need it.
"""
from __future__ import annotations

import contextlib
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


RECIPES: Registry[RecipeSpec] = Registry("fp8 recipe")


def recipe(name: str, min_cc: tuple[int, int], fp8_attention: tuple[int, int] | None = None):
    def add(build):
        RECIPES.register(name)(RecipeSpec(name, build, min_cc, fp8_attention))
        return build

    return add


def _format(fcfg):
    from transformer_engine.common.recipe import Format

    return getattr(Format, fcfg.fp8_format)


@recipe("delayed", (8, 9), fp8_attention=(9, 0))
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


class FP8Context:
    """Everything the trainer needs from the [fp8] section."""

    def __init__(self, fcfg, amax_group=None):
        self.cfg = fcfg
        self.enabled = fcfg.enable
        self.recipe = RECIPES.get(fcfg.recipe).build(fcfg) if fcfg.enable else None
        self.amax_group = amax_group

    def model_init(self):
        """Context for building the model: FP8 weights when fp8.params is on."""
        if not (self.enabled and self.cfg.params):
            return contextlib.nullcontext()
        import transformer_engine.pytorch as te

        return te.quantized_model_init(enabled=True, recipe=self.recipe)

    def bf16_block_ids(self, n_layers: int) -> set[int]:
        return {i % n_layers for i in self.cfg.bf16_layers}

    def autocast(self):
        """Context for the forward pass; amaxes are reduced over the data-parallel group."""
        if not self.enabled:
            return contextlib.nullcontext()
        import transformer_engine.pytorch as te

        return te.autocast(enabled=True, recipe=self.recipe, amax_reduction_group=self.amax_group)


# TE module name -> the layer group its FP8 statistics are reported under.
STAT_GROUPS = {"layernorm_qkv": "attention_qkv", "proj": "attention_proj", "layernorm_mlp": "mlp"}


def fp8_stats(model) -> dict[str, float]:
    """Delayed-scaling statistics per layer group, over all blocks: the largest amax in the history
    window and the smallest scale of the tensors quantized in the forward (activations, weights) and
    the backward (gradients). Empty for recipes that keep no scaling state (current, block)."""
    acc: dict[str, list[float]] = {}
    for name, module in model.named_modules():
        meta = getattr(module, "fp8_meta", None)
        group = STAT_GROUPS.get(name.rsplit(".", 1)[-1])
        if not meta or group is None:
            continue
        for direction in ("fwd", "bwd"):
            scaling = meta.get(f"scaling_{direction}")
            if scaling is None or not hasattr(scaling, "amax_history"):
                continue
            window = scaling.amax_history.amax(dim=0)  # per tensor slot, over the history window
            used = window > 0  # slots a GEMM never quantizes (e.g. outputs) keep amax 0 and scale 1
            if not bool(used.any()):
                continue
            amax = window.max().item()
            scale = scaling.scale[used].min().item()
            key = f"{group}/{direction}"
            prev = acc.get(key)
            acc[key] = [max(amax, prev[0]), min(scale, prev[1])] if prev else [amax, scale]
    out = {}
    for key, (amax, scale) in acc.items():
        out[f"fp8/{key}_amax"] = amax
        out[f"fp8/{key}_scale_min"] = scale
    return out
