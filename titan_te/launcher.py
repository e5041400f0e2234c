"""The launcher behind ./run_train.sh: NGPU training processes per node, with train.py's contracts.

    NGPU=8 LOG_RANK=0 python -m titan_te.launcher [--config FILE] [--section.key=value ...]

What torchrun does not give and this does:
- the exit code is the workers' own (0 done, 2 config/data, 3 checkpoint, 4 out of memory, 75
  preempted), with no launcher traceback; a user mistake stays one line on stderr;
- SIGTERM / SIGINT are forwarded to every worker and nothing is killed while they finish the step and
  the checkpoint save (a worker counts a signal that reaches it twice within moments as one);
- workers die with the launcher: they run in its process group (a signal to the group reaches them)
  and get SIGTERM from the kernel if the launcher is killed (PR_SET_PDEATHSIG), so they save and stop.

Environment: NGPU (processes on this node; default the visible CUDA GPUs, else 1), LOG_RANK (global
ranks whose output is shown, default 0; the others' output appears only when they decide the exit
code), NNODES and NODE_RANK (default 1 and 0), MASTER_ADDR and MASTER_PORT (default 127.0.0.1 and
a free port on one node; on several, MASTER_ADDR is required and MASTER_PORT defaults to 29500).
"""
from __future__ import annotations

import collections
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from titan_te.errors import EXIT_CODES, ConfigError, say
from titan_te.head_address import check_head_address
from titan_te.preemption import STOP_SIGNALS

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "train_configs" / "debug.toml"
READY_FD, LAUNCHER_PID = "TITAN_TE_READY_FD", "TITAN_TE_LAUNCHER_PID"  # how a worker tells it is ready
GRACE_S = 30.0  # after one worker fails, how long the others may take to stop on their own
TERM_S = 60.0  # then, after SIGTERM, how long before they are killed
READ_REST_S = 5.0  # after the deciding worker exited, how long its last lines may take to reach the launcher
PR_SET_PDEATHSIG = 1
PROCS_PER_CPU = 4  # without a GPU per process, NGPU above this many per CPU core is refused as a slip


def _int_env(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


# a GPU driver's files: NVIDIA's, WSL2's GPU device, NVIDIA Jetson's integrated GPU, AMD's (ROCm)
GPU_DRIVER_FILES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg", "/dev/nvhost-ctrl-gpu", "/dev/kfd")


def _visible_gpus() -> int:
    if not any(os.path.exists(f) for f in GPU_DRIVER_FILES):
        return 0  # no GPU driver on this node: no need to import torch (most of the launcher's start-up) to count none
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Plan:
    """Who runs where, from the environment; every mistake is a ConfigError before anything starts."""

    def __init__(self, env=os.environ):
        visible = _visible_gpus()
        self.nproc = _int_env("NGPU", 0, 1) or max(visible, 1)
        if 0 < visible < self.nproc and env.get("TITAN_TE_SHARE_GPU", "").strip() != "1":
            raise ConfigError(f"NGPU={self.nproc}, but this node has {visible} visible GPU(s): one process per GPU "
                              f"(TITAN_TE_SHARE_GPU=1 runs several ranks on one GPU, a testing mode)")
        cores = os.cpu_count() or 1
        if self.nproc > max(visible, PROCS_PER_CPU * cores):
            raise ConfigError(f"NGPU={self.nproc} is more processes than this node can run: it has {visible} "
                              f"GPU(s) and {cores} CPU core(s), and ranks without a GPU of their own are "
                              f"bounded at {PROCS_PER_CPU} per core ({PROCS_PER_CPU * cores})")
        self.nnodes = _int_env("NNODES", 1, 1)
        self.node_rank = _int_env("NODE_RANK", 0, 0)
        if self.node_rank >= self.nnodes:
            raise ConfigError(f"NODE_RANK={self.node_rank} must be below NNODES={self.nnodes}")
        self.world = self.nproc * self.nnodes
        raw = env.get("LOG_RANK", "0").strip() or "0"
        try:
            self.log_ranks = {int(r) for r in raw.split(",") if r.strip()}
        except ValueError:
            raise ConfigError(f"LOG_RANK={raw!r}: give global ranks separated by commas, e.g. 0 or 0,8") from None
        bad = sorted(r for r in self.log_ranks if not 0 <= r < self.world)
        if bad:
            raise ConfigError(f"LOG_RANK={raw}: rank {bad[0]} does not exist; this run has {self.world} "
                              f"process(es), ranks 0..{self.world - 1}")
        addr = env.get("MASTER_ADDR", "").strip()
        if not addr and self.nnodes > 1:  # each node would look for the head on itself, for 300 s
            raise ConfigError(f"NNODES={self.nnodes} needs MASTER_ADDR: set it on every node to the address of the "
                              f"node with NODE_RANK=0, as the other nodes reach it (127.0.0.1 only if every node "
                              f"runs on this machine)")
        self.master_addr = addr or "127.0.0.1"
        if self.node_rank == 0:
            check_head_address(self.master_addr, local=False)
        port = _int_env("MASTER_PORT", 0, 1)
        if port and port > 65535:
            raise ConfigError(f"MASTER_PORT={port} is not a port (1..65535)")
        if self.nnodes == 1 and port and not _port_free(port):
            raise ConfigError(f"MASTER_PORT={port} is taken on this machine (another job?); choose another "
                              f"MASTER_PORT or leave it unset for a free one")
        self.master_port = port or (_free_port() if self.nnodes == 1 else 29500)

    def worker_env(self, local_rank: int) -> dict:
        rank = self.node_rank * self.nproc + local_rank
        return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(self.world),
                "LOCAL_WORLD_SIZE": str(self.nproc), "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
                "LOG_RANK": ",".join(map(str, sorted(self.log_ranks))), "PYTHONUNBUFFERED": "1"}


def _worker_preexec(parent: int):
    """In the child before exec: stop signals ignored until train.py's handlers are in place (a signal that
    came while Python starts up would kill it with a traceback; the launcher holds it back until the worker
    says it is ready), and SIGTERM from the kernel when the launcher dies."""
    def preexec():
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(128 + signal.SIGTERM)

    return preexec


class Worker:
    def __init__(self, plan: Plan, local_rank: int, argv: list[str]):
        self.rank = plan.node_rank * plan.nproc + local_rank
        self.shown = self.rank in plan.log_ranks
        self.tail: collections.deque = collections.deque(maxlen=20)
        self.reader: threading.Thread | None = None
        out = None if self.shown else subprocess.PIPE
        ready_r, ready_w = os.pipe()
        env = {**plan.worker_env(local_rank), READY_FD: str(ready_w), LAUNCHER_PID: str(os.getpid())}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv], env=env,
                                     stdout=out, stderr=subprocess.STDOUT if out else None, pass_fds=(ready_w,),
                                     preexec_fn=_worker_preexec(os.getpid()))
        os.close(ready_w)
        os.set_blocking(ready_r, False)
        self._ready_fd: int | None = ready_r
        self.pending: list[int] = []  # signals held back until the worker's handlers are in place
        self.code: int | None = None
        self.ended_at = 0.0
        self.killed = False  # stopped by the launcher after another worker failed

    def ready(self) -> bool:
        """Whether train.py has its signal handlers in place (it wrote to the pipe, or closed it by exiting)."""
        if self._ready_fd is None:
            return True
        try:
            os.read(self._ready_fd, 1)  # a byte, or b"" once the worker has exited
        except BlockingIOError:
            return False
        os.close(self._ready_fd)
        self._ready_fd = None
        return True

    def signal(self, signum: int) -> None:
        """Forward a stop signal now, or once the worker is ready for it."""
        if self.code is not None or self.proc.poll() is not None:
            return
        if not self.ready():
            self.pending.append(signum)
            return
        try:
            os.kill(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def deliver_pending(self) -> None:
        if self.pending and self.ready():
            for signum in self.pending[:1]:  # repeats of one request are one request
                self.signal(signum)
            self.pending.clear()

    def start_reader(self) -> None:
        if self.shown:
            return

        def read():
            for raw in self.proc.stdout:
                self.tail.append(raw.decode(errors="replace").rstrip("\n"))

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()

    def finish_reading(self) -> None:
        """Wait (READ_REST_S at most) for the lines the worker wrote before it exited: its exit can be seen before
        the reader has taken its last line from the pipe (a rank's one line was lost that way). A loader worker
        that outlives it keeps the pipe open: hence the bound."""
        if self.reader is not None:
            self.reader.join(READ_REST_S)

    def poll(self) -> bool:
        """True once the worker has exited (records its code, signals as 128 + N)."""
        if self.code is None and self.proc.poll() is not None:
            rc = self.proc.returncode
            self.code = 128 - rc if rc < 0 else rc
            self.ended_at = time.monotonic()
        return self.code is not None


# the signals that end a worker from outside, with what usually sends them
SIGNAL_CAUSES = {
    signal.SIGKILL: "the kernel's out-of-memory killer when the host runs out of memory, or a kill -9",
    signal.SIGSEGV: "a crash in native code: a driver or a library",
    signal.SIGBUS: "a crash in native code, or a file mapped into memory that shrank",
    signal.SIGABRT: "an abort in a library, e.g. a collective's watchdog when another rank stopped answering",
    signal.SIGTERM: "someone other than this launcher", signal.SIGINT: "someone other than this launcher"}


def exit_code(workers: list[Worker], expected: set[int] = frozenset()) -> Worker | None:
    """The worker whose exit code the launcher returns: the first to exit with a documented code (2, 3,
    4, 5, 75, or 128 + N after the launcher forwarded signal N), else the first ended by a signal nobody
    forwarded (killed by the kernel or a user: the others then fail for want of it), else the first to fail;
    None when all succeeded. Workers the launcher stopped do not count."""
    failed = sorted((w for w in workers if w.code and not w.killed), key=lambda w: w.ended_at)
    documented = [w for w in failed if every_rank_says(w.code, expected)]
    signalled = [w for w in failed if unsent_signal(w.code, expected)]
    return (documented or signalled or failed or [None])[0]


def every_rank_says(code: int, forwarded: set[int]) -> bool:
    """Whether an exit code's line is one every rank prints itself: a documented error, or 128 + N after the
    launcher forwarded signal N."""
    return code in EXIT_CODES or code in forwarded


def unsent_signal(code: int, forwarded: set[int]) -> bool:
    """Whether a worker was ended by a signal from outside (the kernel, a user), not one the launcher sent."""
    return not every_rank_says(code, forwarded) and code - 128 in SIGNAL_CAUSES


def ended_by(worker: Worker, world: int) -> str:
    """'rank 1 was ended by SIGKILL, which this launcher did not send (usually ...)'."""
    sig = signal.Signals(worker.code - 128)
    return (f"rank {worker.rank} was ended by {sig.name}, which this launcher did not send (usually "
            f"{SIGNAL_CAUSES[sig]})" + ("; the other ranks stopped without it" if world > 1 else ""))


def run(argv: list[str]) -> int:
    received: list[int] = []
    workers: list[Worker] = []

    def forward(signum, _frame):
        received.append(signum)
        for w in workers:
            w.signal(signum)

    for s in STOP_SIGNALS:  # first: a signal before the workers exist is one line, not a traceback
        signal.signal(s, forward)
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    plan = Plan()
    for local_rank in range(plan.nproc):
        if received:
            break
        workers.append(Worker(plan, local_rank, argv))
    if received and not workers:
        say(f"interrupted: {signal.Signals(received[0]).name} before the workers started; nothing was run")
        return 128 + received[0]
    if received:  # it came while they were being started: whoever is up stops too (a repeat is one request)
        for w in workers:
            w.signal(received[0])
    for w in workers:
        w.start_reader()
    first_failure = None
    termed = False
    while not all([w.poll() for w in workers]):  # every worker polled: when each ended decides who failed first
        time.sleep(0.1)
        for w in workers:
            w.deliver_pending()
        failed = [w for w in workers if w.code]
        if failed and first_failure is None and not received:  # after a signal, nothing is ever killed
            first_failure = time.monotonic()
        if first_failure is None:
            continue
        waited = time.monotonic() - first_failure
        alive = [w for w in workers if w.code is None]
        if waited > GRACE_S and not termed:
            termed = True
            for w in alive:
                w.killed = True
                w.proc.send_signal(signal.SIGTERM)
        elif waited > GRACE_S + TERM_S:
            for w in alive:
                w.proc.kill()
    forwarded = {128 + s for s in received}
    decider = exit_code(workers, forwarded)
    if decider is not None:
        decider.finish_reading()
        _report(decider, workers, forwarded, plan.world)
    return decider.code if decider is not None else 0


def _report(decider: Worker, workers: list[Worker], forwarded: set[int], world: int) -> None:
    """The console's last lines for a failed job: what the deciding rank printed last (its full log is in the
    run folder) unless it is on the console already (its own output, or a shown rank's line of the same
    documented error or forwarded signal, which every rank says), never after a SIGKILL, which leaves it no time
    for a word of its own; then the launcher's line when no rank's line explains the exit."""
    said = decider.shown or (every_rank_says(decider.code, forwarded)
                             and any(w.shown and w.code == decider.code for w in workers))
    if not said and decider.code != 128 + signal.SIGKILL:
        tag = f"[rank{decider.rank}]"
        for line in decider.tail:  # torch tags a traceback's lines "[rankN]:" itself: once is enough
            say(tag + (line[len(tag) + 1:] if line.startswith(tag + ":") else " " + line))
    if unsent_signal(decider.code, forwarded):
        say(f"launcher: {ended_by(decider, world)}")
    elif not every_rank_says(decider.code, forwarded):
        say(f"launcher: rank {decider.rank} failed with exit code {decider.code}")


def main(argv: list[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        say(e.line())
        return e.exit_code
    finally:
        # the exit code is decided: Python's teardown resets our handlers to the default, and a stop signal
        # then (the scheduler's repeat, a late Ctrl-C) would end a finished job as killed, with no line
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
