"""The users' own path on the GPU: `./run_train.sh --config llama3_1b_fp8` (the 1B FP8 preset with FP8
weights, fused_adam and async checkpoints, cut to 2 blocks and short sequences), killed and rerun.

(a) every scheduled background save lands, in both async modes, and retention holds;
(b) kill -9 of the job after a save, then the same command again: it resumes from the newest complete
    checkpoint and its losses equal an uninterrupted run's within 1e-3 relative;
(c) SIGTERM to the job: exit 75, a complete checkpoint of the current step, and a rerun resumes;
(d) TensorBoard's step axis continues across each resume: no second step 1, no gap, no step twice.
"""
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT
from helpers import entries

pytestmark = pytest.mark.gpu

STEPS, INTERVAL = 12, 3
SHAPE = ["--model.n_layers=2", "--training.seq_len=512", "--training.local_batch_size=2",
         "--training.deterministic=true", "--lr_scheduler.warmup_steps=3", f"--checkpoint.interval={INTERVAL}",
         "--checkpoint.keep_latest_k=2"]
SAVED = re.compile(r"checkpoint: saved step (\d+) to ")


def _args(tmp_path: Path, name: str, steps: int = STEPS, *extra: str) -> list[str]:
    return ["./run_train.sh", "--config", "llama3_1b_fp8", f"--job.dump_folder={tmp_path}", f"--job.name={name}",
            f"--training.steps={steps}", *SHAPE, *extra]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.setdefault("NGPU", "1")
    return env


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env())
    print(r.stdout[-3000:], r.stderr[-2000:])
    return r


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float = 240) -> str:
    deadline, seen = time.monotonic() + timeout, []
    for line in proc.stdout:
        seen.append(line)
        if re.search(pattern, line):
            return "".join(seen)
        assert time.monotonic() < deadline, "".join(seen[-30:])
    raise AssertionError(f"{pattern!r} never printed:\n{''.join(seen[-30:])}")


def _complete(folder: Path) -> list[int]:
    from titan_te.checkpoint import complete_steps

    return complete_steps(folder)


def _tb_losses(run: Path) -> dict[int, float]:
    """{step: loss} as TensorBoard shows it (purged steps of a crashed run are dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    events = acc.Scalars("loss_metrics/global_avg_loss")
    steps = [e.step for e in events]
    assert steps == sorted(set(steps)), f"a step was written twice: {steps}"
    return {e.step: e.value for e in events}


def _close(a: dict[int, float], b: dict[int, float], steps) -> float:
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in steps)
    print(f"steps {list(steps)}: worst relative loss difference {worst:.2e}")
    return worst


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run with async_mode = async (a)."""
    tmp = tmp_path_factory.mktemp("ref")
    r = _run(_args(tmp, "ref", STEPS, "--checkpoint.async_mode=async"))
    assert r.returncode == 0, r.stderr
    return tmp / "ref", r.stdout


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_every_scheduled_save_lands_and_retention_holds(mode, reference, tmp_path):
    if mode == "async":
        run, out = reference
    else:  # the preset's own mode
        r = _run(_args(tmp_path, "pinned"))
        assert r.returncode == 0, r.stderr
        run, out = tmp_path / "pinned", r.stdout
    saved = [int(s) for s in SAVED.findall(out)]
    assert saved == [3, 6, 9, 12], out[-3000:]
    assert out.count("(background)") == 3 and "failed" not in out
    ck = run / "checkpoint"
    assert _complete(ck) == [9, 12]  # keep_latest_k = 2
    assert entries(ck) == ["step-12", "step-9"]  # no .tmp left, nothing else
    assert all((ck / f"step-{s}/.metadata").is_file() for s in (9, 12))
    log = (run / "logs/rank0.log").read_text()
    assert all(f"saved step {s} " in log for s in saved)


def test_kill_9_of_the_job_then_the_same_command_resumes_with_the_same_losses(reference, tmp_path):
    ref_run, _ = reference
    args = _args(tmp_path, "run")
    proc = _start(args)
    _read_until(proc, r"checkpoint: saved step 6 ")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(2)
    ck = tmp_path / "run/checkpoint"
    newest = max(_complete(ck))
    assert newest >= 6
    r = _run(args)  # the same command
    assert r.returncode == 0, r.stderr
    assert f"resumed from {ck / f'step-{newest}'} (step {newest})" in r.stdout
    assert f"training from step {newest + 1} to {STEPS}" in r.stdout
    assert not list(ck.glob("*.tmp"))
    ref, got = _tb_losses(ref_run), _tb_losses(tmp_path / "run")
    assert sorted(got) == list(range(1, STEPS + 1))  # (d) one curve: no second step 1, no gap
    assert _close(ref, got, range(newest + 1, STEPS + 1)) < 1e-3  # (b)
    assert _close(ref, got, range(1, newest + 1)) < 1e-3  # the killed run's own steps


def test_sigterm_saves_the_current_step_exits_75_and_the_rerun_resumes(reference, tmp_path):
    ref_run, _ = reference
    args = _args(tmp_path, "term", 10_000, "--checkpoint.interval=1000")
    proc = _start(args)
    _read_until(proc, r"step\s+4 ")
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err
    assert err.count("\n") == 1 and err.startswith("preempted: stopped by a signal after step "), err
    step = int(err.split("after step ")[1].split(";")[0])
    ck = tmp_path / "term/checkpoint"
    assert _complete(ck) == [step] and not list(ck.glob("*.tmp"))
    r = _run(_args(tmp_path, "term", step + 3, "--checkpoint.interval=1000"))
    assert r.returncode == 0, r.stderr
    assert f"resumed from {ck / f'step-{step}'} (step {step})" in r.stdout
    got = _tb_losses(tmp_path / "term")
    assert sorted(got) == list(range(1, step + 4))  # (d)
    # the same data, weights and FP8 history as the uninterrupted run up to its length (the LR schedule
    # differs: this run's training.steps is another), so compare the steps before any save of the reference
    assert _close(_tb_losses(ref_run), got, range(1, 3)) < 1e-3
