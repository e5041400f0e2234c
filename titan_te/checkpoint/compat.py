"""Does a checkpoint fit this run? Compares DCP's metadata with what the run would load, before loading.

A mismatch (more or fewer layers, another vocabulary, another optimizer) is reported as what differs,
both from the manifest's facts (model flavor, layers, optimizer ...) and from the tensors themselves
(the first keys missing, unexpected or of another shape), never as a corrupt checkpoint.
"""
from __future__ import annotations

import re

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def flat_tensors(prefix: str, obj) -> dict[str, tuple]:
    """{dotted key: global shape} of the tensors in a (nested) state dict, keyed as DCP flattens them."""
    out: dict[str, tuple] = {}
    if torch.is_tensor(obj):
        out[prefix] = tuple(obj.shape)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(f"{prefix}.{k}", v))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(f"{prefix}.{i}", v))
    return out


def missing_keys(meta, part: str, target) -> list[str]:
    """The keys of a part's load target (every leaf, as DCP flattens nested dicts) the checkpoint lacks."""
    def leaves(prefix: str, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from leaves(f"{prefix}.{k}", v)
        else:
            yield prefix

    saved = meta.state_dict_metadata
    return [k for k in leaves(part, target) if k not in saved]


def _summarize(keys: list[str], limit: int = 3) -> str:
    """'layers.2.*, layers.3.* (12 keys)': block-level names where blocks differ."""
    groups: list[str] = []
    for k in keys:
        g = re.sub(r"^(.*?\blayers\.\d+)\..*$", r"\1.*", k.split(".", 1)[1] if "." in k else k)
        if g not in groups:
            groups.append(g)
    shown = ", ".join(groups[:limit]) + (", ..." if len(groups) > limit else "")
    return f"{shown} ({len(keys)} tensor{'s' if len(keys) != 1 else ''})"


def tensor_differences(meta, wanted: dict[str, tuple], part: str, strict_unexpected: bool) -> list[str]:
    """What differs between the checkpoint's tensors of `part` and the run's."""
    saved = {k: tuple(m.size) for k, m in meta.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata) and k.startswith(part + ".")}
    out = []
    missing = sorted(k for k in wanted if k not in saved)
    if missing:
        out.append(f"the checkpoint lacks {part} tensors {_summarize(missing)}")
    if strict_unexpected:
        extra = sorted(k for k in saved if k not in wanted)
        if extra:
            out.append(f"the checkpoint holds {part} tensors this run does not have: {_summarize(extra)}")
    shapes = [k for k in wanted if k in saved and saved[k] != wanted[k]]
    for k in shapes[:2]:
        out.append(f"{k} is {list(saved[k])} in the checkpoint, {list(wanted[k])} in this run")
    if len(shapes) > 2:
        out.append(f"and {len(shapes) - 2} more tensors of another shape")
    return out


# the part each group of facts guards: a tokenizer that differs matters only to the model's weights
FACT_PARTS = {"model": "model", "optimizer": "optimizer", "tokenizer": "model"}


def fact_differences(saved: dict, current: dict, parts: set[str]) -> list[str]:
    """'model.n_layers: 4 in the checkpoint, 2 in this run', for the facts of the loaded parts (a group
    the checkpoint does not record, from an older titan_te, is not compared)."""
    out = []
    for section, part in FACT_PARTS.items():
        if part not in parts or section not in current:
            continue
        a, b = saved.get(section, {}), current[section]
        for key in b:
            if key in a and a[key] != b[key]:
                out.append(f"{section}.{key} is {a[key]!r} in the checkpoint, {b[key]!r} in this run")
    return out
