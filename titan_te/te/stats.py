"""Delayed-scaling statistics of a model's TE modules, for the metrics (fp8/<group>/<fwd|bwd>_amax, _scale_min)."""
from __future__ import annotations


def gradient_scales_set(model) -> bool:
    """Whether any TE module's backward amax history holds a value: a gradient has been quantized under delayed
    scaling since the run began (or its checkpoint was saved). All zeros, or no backward state yet (bf16 weights
    create it in their first FP8 pass), is a run whose next backward would use the initial scale of 1. Equal on
    every rank (amaxes are reduced over the data-parallel group)."""
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        scaling = meta.get("scaling_bwd") if meta else None
        if scaling is not None and hasattr(scaling, "amax_history") and bool(scaling.amax_history.any()):
            return True
    return False


def fp8_stats(model, groups: dict[str, str]) -> dict[str, float]:
    """Per layer group, over all blocks: the largest amax in the history window and the smallest scale of the
    tensors quantized in the forward (activations, weights) and the backward (gradients). `groups` maps a TE
    module's own name (the last part of its path, e.g. "proj") to the group it is reported under: the model
    family's (ModelSpec.fp8_stat_groups). Empty for recipes that keep no scaling state (current, block)."""
    acc: dict[str, list[float]] = {}
    for name, module in model.named_modules():
        meta = getattr(module, "fp8_meta", None)
        group = groups.get(name.rsplit(".", 1)[-1])
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
