"""Registry entries: fsdp (FSDP2 per block, then the root), hsdp (replicate x shard), ddp, none.

Gradient scaling: the loss of every micro-batch is already divided by the *global* number of valid
tokens, so the data-parallel reduction must SUM gradients. FSDP2 and DDP both average by default;
each entry below switches that off.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from titan_te.errors import ConfigError
from titan_te.parallel import PARALLELISMS, ParallelSpec


def check_even_shards(model: nn.Module, shards: int, fp8=None) -> None:
    """A weight that gathers itself (TE's FP8 weights: a tensor subclass with `fsdp_pre_all_gather`) hands
    FSDP2 its unpadded shard, and FSDP2 accepts only the padded size: on the ranks whose shard is short it
    raises and the others wait on the collective. Such weights, the FP8 policy's and any already of that
    kind, need rows that divide by the shard count."""
    named = dict(fp8.fp8_weights(model)) if fp8 is not None else {}
    named.update((n, p) for n, p in model.named_parameters() if hasattr(p, "fsdp_pre_all_gather"))
    for name, p in named.items():
        if p.dim() and p.shape[0] % shards:
            raise ConfigError(f"{name} is an FP8 weight of {p.shape[0]:,} rows, which {shards} FSDP shards do not "
                              f"divide evenly (Transformer Engine's FP8 weights cannot be padded); use a shard "
                              f"count that divides it (parallelism.data_parallel_shard_degree), or --fp8.params=false")


def _fully_shard(model: nn.Module, mesh, pcfg, mp: MixedPrecisionPolicy, units: list, fp8) -> nn.Module:
    check_even_shards(model, mesh.size(-1), fp8)  # the last mesh dimension is dp_shard
    for i, block in enumerate(units):
        # The last unit is needed again right at the start of backward: keep it gathered.
        reshard = pcfg.reshard_after_forward and i < len(units) - 1
        reshard = reshard and not (fp8 is not None and fp8.keeps_gathered(block))
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        if fp8 is not None and not reshard:
            fp8.gathered_until_backward(block)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=pcfg.reshard_after_forward)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: no PREMUL_SUM (gloo lacks it)
    return model


def apply_fsdp(model, env, pcfg, mp, units, fp8=None):
    return _fully_shard(model, env.mesh["dp_shard"], pcfg, mp, units, fp8)


def apply_hsdp(model, env, pcfg, mp, units, fp8=None):
    return _fully_shard(model, env.mesh, pcfg, mp, units, fp8)


def _sum_allreduce_hook(group, bucket):
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _no_buffer_sync_per_forward() -> dict:
    """DDP's keyword that stops it broadcasting rank 0's buffers before every forward (ours, the rotary angles,
    are the same on every rank): `forward_sync_buffers` where torch has it (2.13 on, where `broadcast_buffers`
    prints a deprecation warning on every run), else `broadcast_buffers`."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def apply_ddp(model, env, pcfg, mp, units, fp8=None):
    model.to_empty(device=env.device)  # DDP needs real tensors to broadcast; init overwrites them
    ddp = DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                                  **_no_buffer_sync_per_forward())
    ddp.register_comm_hook(dist.group.WORLD, _sum_allreduce_hook)
    return ddp


def apply_none(model, env, pcfg, mp, units, fp8=None):
    return model


PARALLELISMS.register("fsdp")(ParallelSpec("fsdp", apply_fsdp, casts_params=True, reduces_grads_itself=True,
                                           shards_params=True, one_rank="none"))
PARALLELISMS.register("hsdp")(ParallelSpec("hsdp", apply_hsdp, casts_params=True, reduces_grads_itself=True,
                                           shards_params=True, replicates=True, one_rank="none"))
PARALLELISMS.register("ddp")(ParallelSpec("ddp", apply_ddp, no_sync=DistributedDataParallel.no_sync))
PARALLELISMS.register("none")(ParallelSpec("none", apply_none, multi_process=False, local_grads=True))


def mixed_precision(device_type: str, param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    if device_type != "cuda":  # CPU kernels: stay in fp32 for speed and exactness
        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=getattr(torch, reduce_dtype))
