"""Parallelism registry: how the model is spread over the data-parallel ranks."""
from dataclasses import dataclass
from typing import Callable

from titan_te.registry import Registry


@dataclass
class ParallelSpec:
    name: str
    # apply(model, dist_env, parallelism_cfg, mp_policy, units, fp8) -> model, called on the meta model; units:
    # the model's FSDP wrap plan (ModelSpec.fsdp_units); fp8: the run's FP8Policy (keeps_gathered(block))
    apply: Callable
    casts_params: bool = False  # True when it applies the mixed-precision policy itself (FSDP2)
    multi_process: bool = True  # False: runs on one process only
    replicates: bool = False  # takes data_parallel_replicate_degree > 1 (a 2-D replicate x shard mesh)
    reduces_grads_itself: bool = False  # reduce-scatters param.grad in its own hooks (FSDP2)
    shards_params: bool = False  # each rank keeps 1/shard of every parameter, gathered before use (FSDP2)
    # param.grad is this process's alone, which nothing reduces: TE may write weight gradients in place
    # (model.fuse_wgrad_accumulation, titan_te/te/wgrad.py); FSDP2 and DDP reduce what autograd hands them
    local_grads: bool = False
    # no_sync(model) -> a context whose forward and backward add to the local gradients without reducing them;
    # every micro-batch of a step but the last runs in it. Needed where a reduction would re-reduce what an
    # earlier micro-batch already reduced into param.grad (DDP, which sums here); None: each backward reduces
    # only its own gradients (FSDP2 reduce-scatters them, then adds them to the sharded ones)
    no_sync: Callable | None = None
    # the entry that may run in its place on a world of one rank (parallelism.unsharded_one_rank): FSDP
    # there only copies parameters into and gradients out of its buffers
    one_rank: str | None = None


PARALLELISMS: Registry[ParallelSpec] = Registry("data parallelism")


def select(pcfg, world_size: int) -> ParallelSpec:
    """The parallelism that runs: the configured one, or its one-rank stand-in on a world of one rank."""
    spec = PARALLELISMS.get(pcfg.data_parallel)
    if world_size == 1 and spec.one_rank and pcfg.unsharded_one_rank:
        return PARALLELISMS.get(spec.one_rank)
    return spec

from titan_te.parallel import data_parallel  # noqa: E402,F401  (registers fsdp, hsdp, ddp, none)
