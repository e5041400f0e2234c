"""DCP checkpoints on real gloo ranks and real folders: exact resume, resharding, failures."""
import errno
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed.tensor import DTensor

from conftest import ROOT
from helpers import make_cfg, run_ranks

STEPS, HALF = 20, 10


def _cfg(tmp, world, mode="disabled", **extra):
    sections = {"training": {"steps": STEPS, "local_batch_size": 2, "global_batch_size": 4, "seq_len": 32,
                             "deterministic": True},
                "checkpoint": {"enable": True, "interval": 5, "async_mode": mode},
                "lr_scheduler": {"warmup_steps": 3}}
    for k, v in extra.items():
        sections.setdefault(k, {}).update(v)
    return make_cfg(tmp, world=world, **sections)


def _run(rank, world, tmp, mode, until, extra):
    from titan_te.trainer import Trainer

    tr = Trainer(_cfg(tmp, world, mode, **extra))
    start = tr.state.step
    losses = tr.train(until_step=until)
    tr.close()
    return start, losses


def _full_state(rank, world, tmp, extra):
    """Model and optimizer state after resuming, as full tensors."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from titan_te.trainer import Trainer

    tr = Trainer(_cfg(tmp, world, **extra))
    model = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in tr.model.state_dict().items()}
    osd = get_optimizer_state_dict(tr.model, tr.optimizer)["state"]
    opt = {f"{k}.{n}": (t.full_tensor() if isinstance(t, DTensor) else t).clone()
           for k, s in osd.items() for n, t in s.items() if torch.is_tensor(t)}
    step = tr.state.step
    tr.close()
    return step, model, opt


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted 20-step losses for 1 and 2 ranks (no checkpoint is ever loaded)."""
    out = {}
    for world in (1, 2):
        tmp = str(tmp_path_factory.mktemp(f"ref{world}"))
        out[world] = run_ranks(_run, world, tmp, "disabled", None, {})[0][1]
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_resume_is_bit_exact(world, mode, tmp_path, reference):
    first = run_ranks(_run, world, str(tmp_path), mode, HALF, {})
    assert (tmp_path / "t/checkpoint/step-10/.metadata").is_file()
    assert not list((tmp_path / "t/checkpoint").glob("*.tmp"))
    second = run_ranks(_run, world, str(tmp_path), mode, None, {})
    assert second[0][0] == HALF  # resumed at step 10
    assert first[0][1] + second[0][1] == reference[world]  # bit for bit
    assert reference[1] == pytest.approx(reference[2], abs=1e-5)


OPTIMIZERS = {"adamw": {"name": "adamw"}, "fused_adam": {"name": "fused_adam"},
              "fused_adam_bf16_moments": {"name": "fused_adam", "moment_dtype": "bfloat16"}}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("saved_world, loaded_world", [(2, 1), (1, 2)])
def test_reshard_model_and_optimizer_exactly(saved_world, loaded_world, optimizer, tmp_path):
    opt = {"optimizer": OPTIMIZERS[optimizer]}
    run_ranks(_run, saved_world, str(tmp_path), "disabled", 5, opt)
    ref = run_ranks(_full_state, saved_world, str(tmp_path), opt)[0]
    excl = {"checkpoint": {"exclude_from_loading": ["dataloader", "rng"]}, **opt}
    got = run_ranks(_full_state, loaded_world, str(tmp_path), excl)[0]
    assert ref[0] == got[0] == 5
    for part in (1, 2):
        assert ref[part].keys() == got[part].keys() and ref[part]
        for k in ref[part]:
            assert ref[part][k].dtype == got[part][k].dtype, k
            assert torch.equal(ref[part][k], got[part][k]), k
    moments = {t.dtype for k, t in got[2].items() if k.endswith("exp_avg")}
    assert moments == {getattr(torch, OPTIMIZERS[optimizer].get("moment_dtype", "float32"))}


def test_reshard_without_excluding_dataloader_names_the_option(tmp_path):
    run_ranks(_run, 2, str(tmp_path), "disabled", 5, {})
    with pytest.raises(AssertionError) as e:
        run_ranks(_run, 1, str(tmp_path), "disabled", None, {})
    assert "--checkpoint.exclude_from_loading=dataloader" in str(e.value)


def test_retention_keeps_latest_k_and_ignores_partial_saves(tmp_path):
    run_ranks(_run, 1, str(tmp_path), "async", None, {"checkpoint": {"keep_latest_k": 2}})
    ck = tmp_path / "t/checkpoint"
    assert sorted(p.name for p in ck.iterdir()) == ["step-15", "step-20"]
    # an interrupted save (a .tmp folder, or a folder without metadata) is never loaded
    shutil.copytree(ck / "step-20", ck / "step-25.tmp")
    (ck / "step-30").mkdir()
    from titan_te.checkpoint import complete_steps

    assert complete_steps(ck) == [15, 20]


def test_corrupt_checkpoint_error_names_folder_and_newest_good_one(tmp_path):
    run_ranks(_run, 1, str(tmp_path), "disabled", HALF, {})
    newest = tmp_path / "t/checkpoint/step-10"
    for f in newest.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])  # truncated
    with pytest.raises(AssertionError) as e:
        run_ranks(_run, 1, str(tmp_path), "disabled", None, {})
    msg = str(e.value)
    assert "CheckpointError" in msg and str(newest) in msg and "step-5" in msg
    assert "--checkpoint.load_step=5" in msg


def test_disk_full_keeps_training_and_previous_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    from titan_te.trainer import Trainer

    tr = Trainer(_cfg(str(tmp_path), 1))
    tr.train(until_step=5)  # step-5 saved
    real = fs.FileSystemWriter.write_data

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs.FileSystemWriter, "write_data", full)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.checkpointer.save(7)
    assert {k: v for k, v in tr.model.state_dict().items()}.keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    monkeypatch.setattr(fs.FileSystemWriter, "write_data", real)
    losses = tr.train(until_step=8)  # training goes on
    assert len(losses) == 8
    tr.close()
    ck = tmp_path / "t/checkpoint"
    assert sorted(p.name for p in ck.iterdir()) == ["step-5"]
    from titan_te.checkpoint import CheckpointError

    monkeypatch.setattr(fs.FileSystemWriter, "write_data", full)  # the final save fails too: that is fatal
    with pytest.raises(CheckpointError, match="No space left on device.*newest good checkpoint is .*step-5"):
        tr.checkpointer.save(8, last=True)


def test_unwritable_folder_mid_run_keeps_training_and_at_startup_is_one_clear_error(tmp_path, monkeypatch, caplog):
    import logging
    from pathlib import Path

    from titan_te.trainer import Trainer

    tr = Trainer(_cfg(str(tmp_path), 1))
    tr.train(until_step=5)  # step-5 saved
    real_mkdir = Path.mkdir

    def denied(self, *a, **kw):
        if self.name.endswith(".tmp"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", denied)
    caplog.set_level(logging.INFO, logger="titan_te")
    tr.checkpointer.save(7)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("save at step 7" in m and "Permission denied" in m and "newest good checkpoint is" in m and
               "step-5" in m for m in msgs), msgs
    assert not any("saved step 7" in m for m in msgs)  # a failed save is never reported as saved
    monkeypatch.setattr(Path, "mkdir", real_mkdir)
    assert len(tr.train(until_step=8)) == 8
    tr.close()
    assert sorted(p.name for p in (tmp_path / "t/checkpoint").iterdir()) == ["step-5"]

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), f"--job.dump_folder={tmp_path}", "--training.steps=2",
                        "--checkpoint.enable", f"--checkpoint.folder={blocker / 'ck'}"],
                       capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")})
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"checkpoint error: checkpoint.folder {blocker / 'ck'} cannot be written")
    assert "training from step" not in r.stdout  # refused before the first step


def test_sigterm_saves_and_exits_with_documented_code_then_resumes(tmp_path):
    from titan_te.preemption import EXIT_PREEMPTED

    args = [sys.executable, str(ROOT / "train.py"), f"--job.dump_folder={tmp_path}", "--training.steps=400",
            "--checkpoint.enable", "--checkpoint.interval=1000", "--metrics.log_freq=1",
            "--training.seq_len=32", "--training.local_batch_size=2"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "step      3" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "preempted: stopped by a signal after step" in err
    saved = [p.name for p in (tmp_path / "debug/checkpoint").iterdir()]
    assert len(saved) == 1 and saved[0].startswith("step-")
    step = int(saved[0].split("-")[1])
    again = subprocess.run(args[:3] + [f"--training.steps={step + 2}"] + args[4:], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {tmp_path / 'debug/checkpoint' / saved[0]} (step {step})" in again.stdout
    assert f"training from step {step + 1}" in again.stdout
