"""Process-group and device-mesh setup (NCCL on CUDA, gloo on CPU)."""
from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from titan_te.errors import ConfigError, UserError


@dataclass
class DistEnv:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh  # 2-D: ("dp_replicate", "dp_shard")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.rank  # only data parallelism: every rank holds its own slice of the batch

    @property
    def dp_world(self) -> int:
        return self.world_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_type: str, replicate: int, shard: int, timeout_s: int = 1800) -> DistEnv:
    """Join (or, without torchrun, create) the process group and build the data-parallel mesh."""
    alone = "RANK" not in os.environ  # a plain `python train.py`: a group of one
    if alone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"  # gloo too: async checkpoint saves use a CPU group
    else:
        device = torch.device("cpu")
        backend = "gloo"
    for attempt in range(3 if alone else 1):
        if dist.is_initialized():
            break
        try:
            dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
        except dist.DistNetworkError as e:  # the port was taken (by another job, or since we picked it)
            if alone and attempt < 2:
                os.environ["MASTER_PORT"] = str(_free_port())
                continue
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise ConfigError(f"cannot start the process group at {where} ({str(e).splitlines()[0][:200]}); "
                              f"another job may hold the port: pick one with MASTER_PORT or torchrun "
                              f"--master_port") from None
    mesh = init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    return DistEnv(rank=rank, world_size=world, device=device, mesh=mesh)


def shutdown(clean: bool = True) -> None:
    """Leave the process group. After a clean run every rank first waits for the others, so no rank
    tears down its connections while a peer still uses them (gloo aborts the peer then)."""
    if not dist.is_initialized():
        return
    if clean and dist.get_world_size() > 1:
        try:
            dist.barrier()
        except RuntimeError:  # DistBackendError & co: a peer already gone, nothing left to wait for
            pass
    dist.destroy_process_group()
    # A Trainer that failed half-built sits in reference cycles that hold the checkpoint's gloo groups.
    # Collected now, their C++ threads stop while Python is fully alive; left to the interpreter's final
    # collection they abort the process: "terminate called without an active exception" (SIGABRT, seen
    # after a 1-rank resume refused with exit 3; pytorch/pytorch#179291 describes the mechanism).
    gc.collect()


class RankZeroFailed(RuntimeError):
    """Raised on the other ranks when an action of rank 0 failed with a bug (rank 0 raises the original)."""


def on_rank0(fn, group=None):
    """Run `fn` on rank 0 only and broadcast its result, so every rank takes the same path.

    When `fn` raises, every rank raises: a UserError as the same class and message (each rank exits
    with its code), an OSError with its errno (so callers can tell a full disk from a bug), anything
    else as the original on rank 0 and RankZeroFailed elsewhere. No rank is left waiting for another."""
    box: list = [None]
    err = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except UserError as e:
            err, box[0] = e, ("user", (type(e), e.msg))
        except OSError as e:
            err, box[0] = e, ("os", (e.errno, e.strerror or str(e), e.filename))
        except BaseException as e:  # noqa: BLE001 -- broadcast first, then re-raised below
            err, box[0] = e, ("bug", f"{type(e).__name__}: {e}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0, group=group)
    kind, value = box[0]
    if kind == "ok":
        return value
    if err is not None:
        raise err
    if kind == "user":
        raise value[0](value[1])
    if kind == "os":
        raise OSError(*value) if value[2] else OSError(value[0], value[1])
    raise RankZeroFailed(f"rank 0 failed: {value}")
