"""Test helpers: configs from dicts, real multi-process runs on gloo, and commands watched by strace."""
from __future__ import annotations

import gc
import os
import pickle
import shutil
import socket
import subprocess
import tempfile
import traceback
from pathlib import Path

import torch.multiprocessing as mp

from titan_te import config as config_mod


def make_cfg(tmp_path, world: int = 1, **sections) -> config_mod.Config:
    """A validated debug config writing into tmp_path; `sections` = {"training": {"steps": 5}, ...}."""
    data = {"job": {"dump_folder": str(tmp_path), "name": "t"},
            "training": {"steps": 5, "local_batch_size": 2, "seq_len": 32},
            "metrics": {"log_freq": 1, "enable_tensorboard": False},
            "parallelism": {"comm_timeout_s": 120}}  # a crashed rank fails the test fast, never hangs CI
    for sec, body in sections.items():
        data.setdefault(sec, {}).update(body)
    cfg = config_mod.build(data, [])
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        config_mod.validate(cfg, "<test>")
    finally:
        if old is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = old
    return cfg


def run_main(capsys, argv: list[str]) -> subprocess.CompletedProcess:
    """train.py's main in this process (a process of its own would import torch again): its exit code and
    what it printed."""
    from titan_te.main import main

    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, out_dir):
    gc.freeze()  # the fork server's imports: out of this rank's full collections (one at its shutdown)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
        payload = ("ok", result)
    except BaseException as e:  # report to the parent, which raises
        payload = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(payload))
    from titan_te.parallel.dist import shutdown

    shutdown(clean=payload[0] == "ok")


# Ranks start from a fork server that has imported these once (about 3 s of imports per process
# otherwise, a third of the suite's time). The server is a fresh interpreter that imports only them: no
# threads, CUDA or process group exist when it forks, so each rank starts as clean as a spawned one.
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch._dynamo", "titan_te.trainer", "helpers"]


def run_ranks(fn, world: int, *args):
    """Run fn(rank, world, *args) in `world` new processes joined by gloo; returns per-rank results."""
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(world, free_port(), fn, args, out), nprocs=world, join=True,
                           start_method="forkserver")
        outcomes = [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]
    failed = [(r, value) for r, (status, value) in enumerate(outcomes) if status != "ok"]
    if failed:
        # the rank that failed first is the one whose peers did not close on it
        failed.sort(key=lambda f: any(word in f[1] for word in CLOSED))
        raise AssertionError("\n".join(f"rank {r} failed: {value}" for r, value in failed))
    return [value for _, value in outcomes]


CLOSED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def entries(folder) -> list[str]:
    """The sorted names in a folder a run or tool writes into, without the `.lock` it holds there."""
    return sorted(p.name for p in Path(folder).iterdir() if p.name != ".lock")


STRACE = shutil.which("strace")
FILE_CALLS = "fsync,rename,renameat,renameat2,unlink,unlinkat,rmdir"


def traced(cmd: list[str], trace: Path, **run_kw) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `cmd` (and every process and thread it starts) under strace, recording its syncs, renames and deletions
    in order, each file descriptor shown with its path (`fsync(5</a/b>)`); returns the run and the trace's lines."""
    r = subprocess.run([STRACE, "-f", "--seccomp-bpf", "-qq", "-y", "-s", "4096", "-o", str(trace), "-e",
                        f"trace={FILE_CALLS}", *cmd], capture_output=True, text=True, **run_kw)
    return r, trace.read_text().splitlines() if trace.exists() else []


def planned_recomputation(cfg, world: int, ranks_per_gpu: int = 1):
    """What activation_checkpoint.mode = auto chooses for `cfg` on this process's GPU (a rank's share of it), by
    the planner: the test's side of the trainer's choice."""
    import torch

    from titan_te.data import TOKENIZERS
    from titan_te.plan import gpu_of, lightest_recomputation

    props = torch.cuda.get_device_properties(0)
    card = gpu_of(props.total_memory // ranks_per_gpu, (props.major, props.minor))
    return lightest_recomputation(cfg, world, card, TOKENIZERS.get(cfg.data.tokenizer)(cfg.data).vocab_size, True)[0]
