"""World-size-independent weight init.

Every parameter's *full* value is drawn from its own generator, seeded by (seed, parameter name),
and each rank copies only its shard out of it. So the full weights are the same for any world size,
and no two shards repeat each other (the trap of calling `reset_parameters()` on sharded tensors
with one shared seed: every shard draws the same numbers).
"""
from __future__ import annotations

import zlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def clean_name(name: str) -> str:
    """Parameter name without the prefixes that wrappers (AC, compile, DDP) insert."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's shard of `param` itself (a DTensor's local tensor, else the tensor).
    Not `to_local()`: for a Parameter of a DTensor, newer torch returns a fresh view there, which a write may
    reach only partly (an FP8 weight's scale) and which is not the object an optimizer later sees."""
    return param._local_tensor if isinstance(param, DTensor) else param


def local_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of `full` that this rank holds of `param` (a DTensor or a plain tensor)."""
    if not isinstance(param, DTensor):
        return full
    coord = param.device_mesh.get_coordinate()
    out = full
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            n = param.device_mesh.size(mesh_dim)
            chunks = torch.chunk(out, n, dim=placement.dim)  # FSDP2 / DTensor split like torch.chunk
            idx = coord[mesh_dim]
            if idx < len(chunks):
                out = chunks[idx]
            else:
                shape = list(out.shape)
                shape[placement.dim] = 0
                out = out.new_empty(shape)
    return out


def draw(rule: tuple[str, float], shape, generator: torch.Generator, device) -> torch.Tensor:
    kind, std = rule
    if kind == "ones":
        return torch.ones(shape, device=device)
    if kind == "zeros":
        return torch.zeros(shape, device=device)
    t = torch.empty(shape, device=device)
    if kind == "normal":
        return t.normal_(0.0, std, generator=generator)
    if kind == "trunc_normal":
        return nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, generator=generator)
    raise ValueError(f"unknown init kind {kind!r}")


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_weights(model: nn.Module, init_rule, seed: int, device: torch.device, write=None) -> None:
    """Initialize every parameter of `model` (materialized, possibly sharded) in place.

    `init_rule(name) -> (kind, std)`; `write(param, local_value)` stores a value into a parameter
    (the TE backend passes one that quantizes into FP8 weights).
    """
    for raw_name, p in model.named_parameters():
        name = clean_name(raw_name)
        gen = torch.Generator(device=device).manual_seed(param_seed(seed, name))
        full = draw(init_rule(name), tuple(p.shape), gen, device)
        value = local_shard(full, p)
        target = local_tensor(p)
        if write is not None:
            write(target, value)
        else:
            target.copy_(value)
