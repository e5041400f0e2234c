"""./run_train.sh keeps train.py's contracts, for 1 and 2 processes: exit codes, one-line errors, signals,
workers that die with the launcher, one trainer per run folder, the run's own log file."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import STRACE, entries, traced

from conftest import ROOT

SMALL = ["--training.seq_len=32", "--training.local_batch_size=2", "--metrics.log_freq=1",
         "--metrics.enable_tensorboard=false"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                           "MASTER_ADDR", "NGPU", "LOG_RANK")}
    env.update(OMP_NUM_THREADS="1", **{k: str(v) for k, v in extra.items()})
    return env


def _run(args, timeout=240, **env):
    return subprocess.run(["./run_train.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=_env(**env))


def _start(args, **env):
    """The launcher in a session of its own, as a shell or Slurm would start it (its group = the job)."""
    return subprocess.Popen(["./run_train.sh", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(**env), start_new_session=True)


def _wait_for(proc, text, timeout=120):
    deadline = time.monotonic() + timeout
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return seen
        assert time.monotonic() < deadline, "".join(seen[-20:])
    raise AssertionError(f"{text!r} never printed:\n{''.join(seen[-20:])}")


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _steps(folder: Path) -> list[str]:
    return entries(folder) if folder.is_dir() else []


@pytest.mark.parametrize("ngpu", [1, 2])
def test_config_errors_are_one_line_and_exit_2(ngpu, tmp_path):
    for args, start in [(["--training.stpes=3"], "config error: unknown key training.stpes (did you mean "
                                                  "'--training.steps'?)"),
                        (["--config", "no_such_preset"], "config error: config file not found: no_such_preset"),
                        (["--config"], "config error: --config needs a file name")]:
        r = _run([f"--job.dump_folder={tmp_path}", *args], NGPU=ngpu)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith(start), (args, r.stderr)
        assert "Traceback" not in r.stdout + r.stderr
    assert "llama_fp8.toml" in r.stderr or "presets" in _run(["--config", "nope"]).stderr


def test_launcher_environment_mistakes_are_one_line(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        taken = s.getsockname()[1]
        cases = [({"NGPU": "abc"}, "config error: NGPU='abc' is not a whole number"),
                 ({"NGPU": "0"}, "config error: NGPU=0 must be >= 1"),
                 ({"NGPU": "100000"}, "config error: NGPU=100000 is more processes than this node can run"),
                 ({"LOG_RANK": "5"}, "config error: LOG_RANK=5: rank 5 does not exist; this run has 1 process"),
                 ({"MASTER_PORT": str(taken)}, f"config error: MASTER_PORT={taken} is taken"),
                 ({"MASTER_ADDR": "no.such.host.invalid"},
                  "config error: MASTER_ADDR=no.such.host.invalid does not resolve to an address"),
                 # TEST-NET-1, never an address of this machine: found when rank 0 cannot reach its own store
                 ({"MASTER_ADDR": "192.0.2.1", "NGPU": "2"},
                  "config error: MASTER_ADDR=192.0.2.1 is not an address of this machine")]
        for env, start in cases:  # a short rendezvous: rank 1 of the last case stops soon too
            r = _run([f"--job.dump_folder={tmp_path}", "--parallelism.rendezvous_timeout_s=5"], **env)
            assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith(start), (env, r.stderr)


def test_a_node_without_a_gpu_driver_counts_no_gpus_without_importing_torch():
    code = ("import sys; from titan_te.launcher import Plan, GPU_DRIVER_FILES; import os; "
            "assert not any(os.path.exists(f) for f in GPU_DRIVER_FILES), 'a GPU driver is here'; "
            "plan = Plan({}); print(plan.nproc, 'torch' in sys.modules)")
    r = subprocess.run(["python3", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 0 and r.stdout.split() == ["1", "False"], r.stderr


def test_a_training_process_grows_cuda_segments_in_place_unless_the_user_chose_the_allocator():
    """train.py (and every train_bench run, the peer's too) starts with PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True, as torchtitan's launcher does; a user's own setting is kept whole, and so is a
    user's TORCH_CPP_LOG_LEVEL. Checked in a fresh process: the defaults must be in place before torch starts."""
    code = ("import os, sys; from titan_te.main import set_environment_defaults; set_environment_defaults(); "
            "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'], os.environ['TORCH_CPP_LOG_LEVEL'], 'torch' in sys.modules)")
    env = {k: v for k, v in _env().items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "TORCH_CPP_LOG_LEVEL")}
    runs = [({}, ["expandable_segments:True", "ERROR", "False"]),
            ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512", "TORCH_CPP_LOG_LEVEL": "INFO"},
             ["max_split_size_mb:512", "INFO", "False"])]
    for extra, expected in runs:
        r = subprocess.run(["python3", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={**env, **extra})
        assert r.returncode == 0 and r.stdout.split() == expected, (extra, r.stdout, r.stderr)


def test_the_workers_exit_waits_for_threads_runs_exit_handlers_flushes_and_keeps_the_code(tmp_path):
    """train.py ends with titan_te.main.leave: it skips only Python's teardown of the modules."""
    code = f"""
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from titan_te.main import leave
pool = ThreadPoolExecutor(1); pool.submit(time.sleep, 0)  # an idle worker thread, ended by the exit
def late():
    time.sleep(0.5)
    open({str(tmp_path / "thread")!r}, "w").write("done")
threading.Thread(target=late).start()
atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").write("ran"))
sys.stdout.write("no newline, still shown")
leave(3)
"""
    r = subprocess.run(["python3", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 3 and r.stdout == "no newline, still shown", r.stderr
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"


def test_bare_preset_name_resolves_with_or_without_toml(tmp_path):
    for name in ("debug", "debug.toml"):
        r = _run(["--config", name, "--print-config"])
        assert r.returncode == 0 and 'name = "debug"' in r.stdout, r.stderr


def test_two_rank_async_run_lands_every_save_and_logs_to_the_run_folder(tmp_path):
    r = _run([f"--job.dump_folder={tmp_path}", "--training.steps=50", "--checkpoint.enable=true",
              "--checkpoint.interval=5", "--checkpoint.async_mode=async", *SMALL], NGPU=2, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ck = tmp_path / "debug/checkpoint"
    assert _steps(ck) == sorted(f"step-{s}" for s in range(5, 55, 5))
    for s in range(5, 55, 5):
        m = json.loads((ck / f"step-{s}/titan_te.json").read_text())
        assert m["step"] == s and m["dp_world"] == 2 and (ck / f"step-{s}/.metadata").is_file()
    assert r.stdout.count("(background)") == 9  # steps 5 .. 45 in the background, the last one in the foreground
    log = (tmp_path / "debug/logs/rank0.log").read_text()
    assert "step     50  loss" in log and "checkpoint: saved step 45" in log
    assert (tmp_path / "debug/logs/rank1.log").is_file()
    assert "[rank1]" not in r.stdout  # LOG_RANK=0 shows rank 0 only


@pytest.mark.skipif(STRACE is None, reason="needs strace to watch the run's file-system calls")
def test_a_save_is_on_the_disk_before_retention_deletes_the_older_one(tmp_path):
    """A machine that crashes (not only the process) right after a save must find that save whole: the real run,
    watched by strace, syncs the manifest and the save's folder, renames it, syncs the checkpoint folder, and
    only then deletes the older checkpoint (keep_latest_k = 1). Unsynced, a crash could leave the newest save
    with an empty manifest after the only older one was deleted."""
    args = [f"--job.dump_folder={tmp_path}", "--training.steps=6", "--checkpoint.enable=true",
            "--checkpoint.interval=2", "--checkpoint.keep_latest_k=1", "--checkpoint.async_mode=async", *SMALL]
    r, lines = traced(["./run_train.sh", *args], tmp_path / "strace.log", cwd=ROOT, timeout=240, env=_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ck = (tmp_path / "debug/checkpoint").resolve()
    assert _steps(ck) == ["step-6"]

    def first(after: int, test) -> int:
        return next((i for i, line in enumerate(lines) if i > after and test(line)), len(lines))

    for step, older in ((4, 2), (6, 4)):
        tmp, final = ck / f"step-{step}.tmp", ck / f"step-{step}"
        manifest = first(-1, lambda x: "fsync(" in x and f"<{tmp}/titan_te.json>" in x)
        folder = first(manifest, lambda x: "fsync(" in x and f"<{tmp}>" in x)
        renamed = first(folder, lambda x: "rename" in x and f'"{tmp}"' in x and f'"{final}"' in x)
        parent = first(renamed, lambda x: "fsync(" in x and f"<{ck}>" in x)
        deleted = first(-1, lambda x: "unlink" in x and (f"{ck}/step-{older}>" in x or f'"{ck}/step-{older}"' in x))
        assert parent < deleted < len(lines), (step, manifest, folder, renamed, parent, deleted)


@pytest.mark.parametrize("workers", [0, 2], ids=["no-loader-workers", "2-loader-workers"])
def test_sigterm_to_the_group_saves_the_current_step_and_exits_75(workers, tmp_path):
    """As Slurm preempts a job: SIGTERM to every process of the step, the data-loader workers too. torch's workers
    die of a SIGTERM their parent did not send, and the trainer raised "DataLoader worker ... is killed by signal:
    Terminated" in the middle of its step (a traceback, exit 1, no save) until the workers ignored stop signals."""
    args = [f"--job.dump_folder={tmp_path}", "--training.steps=100000", "--checkpoint.enable=true",
            "--checkpoint.interval=100000", f"--data.num_workers={workers}", *SMALL]
    proc = _start(args, NGPU=2)
    _wait_for(proc, "step      3")
    os.killpg(proc.pid, signal.SIGTERM)  # as Slurm does: the launcher and every worker get it
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert err.count("\n") == 1 and err.startswith("preempted: stopped by a signal after step "), err
    step = int(err.split("after step ")[1].split(";")[0])
    assert _steps(tmp_path / "debug/checkpoint") == [f"step-{step}"]
    again = _run([*args[:1], f"--training.steps={step + 2}", *args[2:]], NGPU=2)
    assert again.returncode == 0, again.stderr
    assert f"(step {step})" in again.stdout and f"training from step {step + 1}" in again.stdout


def test_workers_die_with_a_killed_launcher_and_a_live_run_folder_is_locked(tmp_path):
    args = [f"--job.dump_folder={tmp_path}", "--training.steps=100000", "--checkpoint.enable=true",
            "--checkpoint.interval=100000", *SMALL]
    # 1. kill -9 of the launcher alone: its workers get SIGTERM from the kernel, save and stop
    proc = _start(args, NGPU=2)
    _wait_for(proc, "step      2")
    workers = _children(proc.pid)
    assert len(workers) == 2
    # a second trainer on the same run folder is refused, naming the live one
    second = subprocess.run(["python3", "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env=_env())
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    holder = json.loads((tmp_path / "debug/.lock").read_text())
    assert second.stderr.startswith(f"config error: run folder {tmp_path / 'debug'} is in use by another trainer "
                                    f"(host {holder['host']}, PID {holder['pid']}")
    assert holder["pid"] in workers
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers)
    saved = _steps(tmp_path / "debug/checkpoint")
    assert len(saved) == 1, saved  # they saved before stopping
    # 2. kill -9 of the whole group: nothing survives; the stale lock is taken over by the next run
    proc = _start(args, NGPU=2)
    _wait_for(proc, "training from step")
    workers = _children(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1)
    assert not any(_alive(p) for p in workers)
    step = int(saved[0].split("-")[1])
    (tmp_path / "debug/checkpoint/step-999.tmp").mkdir()
    (tmp_path / "debug/checkpoint/step-999.tmp/__0_0.distcp").write_bytes(b"x" * 1000)
    again = _run([*args[:1], f"--training.steps={step + 1}", *args[2:]], NGPU=2)
    assert again.returncode == 0, again.stderr
    assert not (tmp_path / "debug/checkpoint/step-999.tmp").exists()
    assert "removed" in again.stdout and "step-999.tmp" in again.stdout
    log = (tmp_path / "debug/logs/rank0.log").read_text()
    assert log.count("training from step") == 3, log  # every run appended its lines, also the killed ones


OVERFLOWED = ("step 4 left weights or optimizer state that are not finite (its update overflowed): the training "
              "state is not finite any more, so nothing from step 4 on is saved; the newest checkpoint, step-2")


@pytest.mark.parametrize("at_step, into, stopped, fragment, kept, ranks", [
    # the update of step 5 wrote NaN: step 6's loss is NaN, seen before step 6 is saved
    (5, "weight", 6, "step 6 has loss nan and grad norm nan: the weights are not finite any more, so nothing from "
                     "step 6 on is saved; the newest checkpoint, step-4, is from before it", ["step-2", "step-4"], 2),
    # the update of step 4 wrote NaN: its own loss was finite, the weights it left are not
    (4, "weight", 4, OVERFLOWED, ["step-2"], 1),
    # the update of step 4 wrote NaN into the optimizer's state (a moment, or the FP32 master of an FP8 weight):
    # the weights are finite, and a save would carry the NaN into every step after
    (4, "state", 4, OVERFLOWED, ["step-2"], 1),
], ids=["nan-loss", "nan-weights", "nan-state"])
def test_a_diverged_run_stops_on_every_rank_with_exit_5_and_saves_nothing_after_it(at_step, into, stopped, fragment,
                                                                                    kept, ranks, tmp_path):
    """A NaN loss used to be logged and trained on: every later save (and the final one) held NaN weights,
    and keep_latest_k pruned the good checkpoints for them."""
    args = [*SMALL, f"--job.dump_folder={tmp_path}", "--job.custom_import=nan_opt", "--optimizer.name=nan_sgd",
            "--training.steps=10", "--checkpoint.enable=true", "--checkpoint.interval=2",
            "--checkpoint.keep_latest_k=2", "--metrics.enable_jsonl=true"]
    env = dict(NGPU=ranks, PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = _run([*args, f"--optimizer.nan_sgd.at_step={at_step}", f"--optimizer.nan_sgd.into={into}"], **env)
    assert r.returncode == 5, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"diverged: {fragment}"), r.stderr
    assert entries(tmp_path / "debug/checkpoint") == kept  # nothing partial, nothing of the NaN steps
    rows = [json.loads(line) for line in (tmp_path / "debug/metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss_metrics/global_avg_loss"] for row in rows if "loss_metrics/global_avg_loss" in row}
    assert max(losses) == stopped and all(v == v for s, v in losses.items() if s <= at_step)  # NaN != NaN
    for rank in range(ranks):
        assert f"diverged: {fragment}" in (tmp_path / f"debug/logs/rank{rank}.log").read_text()
    if ranks == 1:
        return
    r = _run([*args, "--optimizer.nan_sgd.at_step=0"], **env)  # the same command, its cause mended, resumes
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed from {tmp_path / 'debug/checkpoint' / kept[-1]}" in r.stdout and "step     10  loss" in r.stdout


def test_a_data_loader_worker_killed_by_the_kernel_is_one_line_and_the_next_run_resumes(tmp_path):
    """A SIGKILL of a loader worker (the out-of-memory killer's way) reached the user as torch's RuntimeError
    with a traceback from wherever the main thread was (inside the attention kernel, in the first try)."""
    args = [f"--job.dump_folder={tmp_path}", "--training.steps=100000", "--data.num_workers=2",
            "--checkpoint.enable=true", "--checkpoint.interval=2", *SMALL]
    proc = _start(args, NGPU=1)
    _wait_for(proc, "step      3")
    rank = _children(proc.pid)
    cmdline = Path(f"/proc/{rank[0]}/cmdline").read_bytes()
    loaders = [p for p in _children(rank[0]) if Path(f"/proc/{p}/cmdline").read_bytes() == cmdline]  # forked
    assert len(rank) == 1 and len(loaders) == 2, [(p, Path(f"/proc/{p}/cmdline").read_bytes()[:200])
                                                  for p in _children(rank[0])]
    os.kill(loaders[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 4 and len(lines) == 1, err
    assert lines[0].startswith(f"out of memory: data-loader worker (pid {loaders[0]}) was killed (SIGKILL: the "
                               f"kernel's out-of-memory killer, as a rule); lower data.num_workers"), err
    # a save the death interrupted stays a .tmp (never loaded; the next start removes it)
    saved = [s for s in _steps(tmp_path / "debug/checkpoint") if not s.endswith(".tmp")]
    newest = max(int(s.split("-")[1]) for s in saved)
    again = _run([*args[:1], f"--training.steps={newest + 1}", *args[2:]], NGPU=1)
    assert again.returncode == 0 and f"training from step {newest + 1}" in again.stdout, again.stderr[-2000:]
    assert not list((tmp_path / "debug/checkpoint").glob("*.tmp"))


# how a job is stopped: a signal, and whom it reaches (the launcher's group, as Slurm and a shell's Ctrl-C do, or
# the launcher alone); the exit codes a stopped job may end with (SIGKILL, preempted, interrupted at start-up by
# SIGTERM / SIGINT, or already finished)
STOPS = [(signal.SIGKILL, "group"), (signal.SIGKILL, "launcher"), (signal.SIGTERM, "group"),
         (signal.SIGTERM, "launcher"), (signal.SIGINT, "group")]
STOPPED_EXITS = {-signal.SIGKILL, 75, 128 + signal.SIGTERM, 128 + signal.SIGINT, 0}


def _losses(run_folder: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_folder / "debug/metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss_metrics/global_avg_loss"] for row in rows if "loss_metrics/global_avg_loss" in row}


def test_a_job_stopped_at_random_moments_on_1_or_2_ranks_ends_with_the_uninterrupted_losses(tmp_path):
    """The user's path after crashes and preemptions: the job is stopped at a random moment (start-up, a step, a
    background save, the final save) by a random signal, and the same command is rerun on 1 or 2 ranks, five
    times; then it runs to the end. Every step's loss equals the uninterrupted run's (within 1e-4: one rank sums
    the global batch in another order than two), every stop is one line or none, and nothing is a traceback.
    Seeded (TITAN_TE_STOP_SEED) to replay a schedule; the moments are wall-clock, so each run tries other windows."""
    import random

    args = [*SMALL, "--training.steps=40", "--training.global_batch_size=4", "--training.deterministic=true",
            "--checkpoint.enable=true", "--checkpoint.interval=3", "--checkpoint.async_mode=async",
            "--checkpoint.keep_latest_k=2", "--metrics.enable_jsonl=true"]
    ref = _run([f"--job.dump_folder={tmp_path / 'ref'}", *args], NGPU=2)
    assert ref.returncode == 0, ref.stderr[-2000:]
    rng = random.Random(int(os.environ.get("TITAN_TE_STOP_SEED", "0")))
    run = [f"--job.dump_folder={tmp_path / 'run'}", *args]
    schedule = []
    for _ in range(5):
        ngpu, (sig, whom), after = rng.choice([1, 2]), rng.choice(STOPS), rng.uniform(1.0, 9.0)
        workers = rng.choice([0, 2])  # loader workers get the group's signals too
        proc = _start([*run, f"--data.num_workers={workers}"], NGPU=ngpu)
        try:
            out, err = proc.communicate(timeout=after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, sig) if whom == "group" else os.kill(proc.pid, sig)
            try:
                out, err = proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                raise AssertionError(f"still running 180 s after {sig.name} to the {whom}: {schedule}, "
                                     f"{(ngpu, workers, after)}\n{out[-3000:]}\n{err[-2000:]}") from None
        schedule.append((ngpu, workers, sig.name, whom, round(after, 1), proc.returncode))
        assert proc.returncode in STOPPED_EXITS, (schedule, err[-2000:])
        assert "Traceback" not in out + err, (schedule, err[-3000:])
        assert len(err.strip().splitlines()) <= 1, (schedule, err)
    print("stops (ranks, loader workers, signal, to, after s, exit):", schedule)
    final = _run(run, NGPU=rng.choice([1, 2]))
    assert final.returncode == 0, (schedule, final.stderr[-2000:])
    want, got = _losses(tmp_path / "ref"), _losses(tmp_path / "run")
    assert sorted(got) == sorted(want) == list(range(1, 41)), schedule
    assert all(got[s] == pytest.approx(want[s], rel=1e-4) for s in want), (schedule, [(s, got[s], want[s])
                                                                                     for s in want])


def _nodes(args, port, **env):
    """Two nodes of one job on this machine (one launcher each, NGPU=1), as a Slurm step starts them."""
    return [_start(args, NNODES=2, NODE_RANK=rank, NGPU=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env)
            for rank in (0, 1)]


def test_two_nodes_stop_together_when_one_is_preempted_and_resume_on_the_uninterrupted_losses(tmp_path):
    """The many-GPU path across nodes: SIGTERM reaches only node 1 (its launcher); the stop vote is shared, so
    both nodes save the same step and exit 75; the same command on both nodes resumes there, and every step's
    loss equals a one-node run's of the same two ranks. Then node 1 dies outright (kill -9 of its launcher and
    workers, as a node failure): node 0 stops in one line, the newest complete checkpoint stays, and the rerun
    resumes from it."""
    from helpers import free_port

    steps = 40
    args = [f"--training.steps={steps}", "--checkpoint.enable=true", "--checkpoint.interval=5",
            "--checkpoint.async_mode=async", *SMALL]
    ref = _run([f"--job.dump_folder={tmp_path / 'ref'}", *args], NGPU=2)
    assert ref.returncode == 0, ref.stderr
    run = [f"--job.dump_folder={tmp_path / 'run'}", *args]

    # 1. preempted on one node
    nodes = _nodes(run, free_port())
    _wait_for(nodes[0], "step      3")
    nodes[1].send_signal(signal.SIGTERM)
    outs = [n.communicate(timeout=120) for n in nodes]
    for n, (out, err) in zip(nodes, outs):
        assert n.returncode == 75, err
    head_err = outs[0][1]
    assert head_err.count("\n") == 1 and head_err.startswith("preempted: stopped by a signal after step "), head_err
    stopped = int(head_err.split("after step ")[1].split(";")[0])
    assert f"step-{stopped}" in _steps(tmp_path / "run/debug/checkpoint")

    # 2. the same command on both nodes resumes there; node 1 dies outright a few steps later
    nodes = _nodes(run, free_port())
    seen = _wait_for(nodes[0], f"step {stopped + 3:>6}")
    assert any(f"training from step {stopped + 1}" in line for line in seen), "".join(seen)
    os.killpg(nodes[1].pid, signal.SIGKILL)
    out, err = nodes[0].communicate(timeout=180)
    nodes[1].communicate(timeout=30)
    lines = [line for line in err.splitlines() if line.strip()]
    assert nodes[0].returncode == 1 and "Traceback" not in err, err
    assert lines[0].startswith("lost a rank: another rank of this job went away during a collective (") and \
        lines[1:] == ["launcher: rank 0 failed with exit code 1"], err
    from titan_te.checkpoint.folder import complete_steps

    complete = complete_steps(tmp_path / "run/debug/checkpoint")  # not a save that the kill cut short (.tmp)
    assert complete and max(complete) >= stopped

    # 3. and the rerun goes to the end
    nodes = _nodes(run, free_port())
    outs = [n.communicate(timeout=240) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][1] + outs[1][1]
    assert f"training from step {max(complete) + 1}" in outs[0][0]
    got, want = _losses(tmp_path / "run"), _losses(tmp_path / "ref")
    assert sorted(got) == list(range(1, steps + 1))
    assert all(got[s] == pytest.approx(want[s], rel=1e-6, abs=1e-6) for s in want), (got, want)


def test_a_worker_killed_from_outside_is_named_and_the_others_say_they_lost_it(tmp_path):
    """The kernel's out-of-memory killer (here a kill -9) ends one worker: the launcher names it and the
    signal, exit 128 + 9; the rank that lost it in a collective says so in one line (its traceback goes to
    the run's log file) instead of the collective's traceback."""
    args = [f"--job.dump_folder={tmp_path}", "--training.steps=100000", *SMALL]
    proc = _start(args, NGPU=2)
    _wait_for(proc, "step      3")
    rank1 = [w for w in _children(proc.pid) if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{w}/environ").read_bytes()]
    os.kill(rank1[0], signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 2, err
    assert lines[0].startswith("lost a rank: another rank of this job went away during a collective ("), err
    assert lines[1] == ("launcher: rank 1 was ended by SIGKILL, which this launcher did not send (usually the "
                        "kernel's out-of-memory killer when the host runs out of memory, or a kill -9); the other "
                        "ranks stopped without it")
    log = (tmp_path / "debug/logs/rank0.log").read_text()
    assert "Traceback" in log and "Connection" in log  # the collective's traceback, for whoever looks


def test_a_bug_on_one_rank_keeps_its_traceback_on_the_console_and_the_others_only_lost_it(tmp_path):
    """A bug in one rank's code ends it with a traceback; the rank whose collective lost it exits after it,
    so the launcher shows the bug's traceback and names its rank, not the rank that only lost it."""
    args = [*SMALL, f"--job.dump_folder={tmp_path}", "--job.custom_import=nan_opt", "--optimizer.name=bug_sgd",
            "--optimizer.bug_sgd.at_step=3", "--training.steps=10"]
    r = _run(args, NGPU=2, PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("lost a rank: another rank of this job went away during a collective ("), r.stderr
    assert "[rank1] ZeroDivisionError: division by zero" in lines and "nan_opt.py" in r.stderr, r.stderr  # its end
    assert lines[-1] == "launcher: rank 1 failed with exit code 1", r.stderr
