"""Process-group and device-mesh setup (NCCL on CUDA, gloo on CPU and for ranks that share a GPU)."""
from __future__ import annotations

import gc
import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from titan_te.errors import ConfigError, UserError
from titan_te.parallel import rendezvous
from titan_te.parallel.dims import ParallelDims


@dataclass
class DistEnv:
    rank: int
    world_size: int
    device: torch.device
    dims: ParallelDims  # every parallel dimension; the mesh is built from all of them
    mesh: DeviceMesh
    shared_gpu: bool = False  # TITAN_TE_SHARE_GPU: every rank on cuda:0 over gloo (a testing mode)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """The slice of the global batch this rank reads (and the key of its per-rank checkpoint state)."""
        return self.dims.dp_rank(self.rank)

    @property
    def dp_world(self) -> int:
        return self.dims.dp_world


SHARE_GPU = "TITAN_TE_SHARE_GPU"


def shared_gpu() -> bool:
    """TITAN_TE_SHARE_GPU=1: a testing mode in which every local rank uses cuda:0 and the process group is
    gloo (NCCL refuses two ranks on one device), so that many-GPU code paths run on one GPU. Slow."""
    raw = os.environ.get(SHARE_GPU, "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(f"{SHARE_GPU}={raw!r} in the environment: set 1 (ranks share cuda:0, a testing mode) or "
                          f"0 / unset")
    return raw == "1"


def init_distributed(device_type: str, dims: ParallelDims, timeout_s: int = 1800,
                     rendezvous_timeout_s: int = 300) -> DistEnv:
    """Meet the other ranks (rendezvous.join: a short, stated wait), join the process group and build the
    mesh of every parallel dimension."""
    store, rank, world = rendezvous.join(rendezvous_timeout_s)
    local_rank = int(os.environ.get("LOCAL_RANK", "").strip() or 0)  # a whole number: rendezvous.join checked it
    share = shared_gpu() and device_type == "cuda"
    if device_type == "cuda":
        if not share and local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={local_rank}, but this node has {torch.cuda.device_count()} visible GPU(s): "
                              f"start at most one process per GPU ({SHARE_GPU}=1 runs several ranks on one GPU, a "
                              f"testing mode)")
        device = torch.device("cuda", 0 if share else local_rank)
        torch.cuda.set_device(device)
        # gloo too: async checkpoint saves use a CPU group; with shared GPUs gloo carries the CUDA tensors
        backend = "gloo" if share else "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    return DistEnv(rank=rank, world_size=world, device=device, dims=dims, mesh=dims.build_mesh(device_type),
                   shared_gpu=share)


# what the backends say when the other end of a collective went away (gloo's TCP pairs, NCCL, the TCPStore)
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "remote process exited",
             "Connection was likely closed", "NCCL communicator was aborted on rank")


def lost_rank(err: BaseException) -> str | None:
    """The line for a collective that failed because another rank went away (killed, crashed, its node lost);
    None for any other error. That rank, or its node's launcher, says why; this one only lost it."""
    if not isinstance(err, RuntimeError):
        return None
    text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(err).split()))  # without gloo's "[.../pair.cc:537]"
    said = [p for p in PEER_GONE if p in text]
    if not said:
        return None
    end = text.find(". ", text.index(said[0]))  # to the end of the backend's sentence that says it
    return (f"another rank of this job went away during a collective ({text[:end if end > 0 else 160]}); the "
            f"launcher of its node says which and why (killed, out of memory, a failed node). Rerunning the "
            f"command resumes from the newest complete checkpoint")


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
