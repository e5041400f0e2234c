"""DCP checkpoints on real gloo ranks and real folders: exact resume, resharding, failures."""
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor

from conftest import ROOT
from helpers import entries, make_cfg, run_ranks

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
    step, parallel = tr.state.step, tr.parallel
    tr.close()
    return step, model, opt, parallel


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


def _reshard(saved_world, loaded_world, opt, tmp_path, one_rank=None):
    """Save after 5 steps on saved_world ranks, load on loaded_world: the same full model and optimizer
    state. one_rank: extra sections of the side that runs on one rank."""
    def extra(world):
        return {**opt, **one_rank} if one_rank and world == 1 else opt

    saved_extra, loaded_extra = extra(saved_world), extra(loaded_world)
    run_ranks(_run, saved_world, str(tmp_path), "disabled", 5, saved_extra)
    ref = run_ranks(_full_state, saved_world, str(tmp_path), saved_extra)[0]
    got = run_ranks(_full_state, loaded_world, str(tmp_path), loaded_extra)[0]
    assert ref[0] == got[0] == 5
    layouts = {saved_world: ref[3], loaded_world: got[3]}
    assert layouts == {1: "none" if one_rank else "fsdp", 2: "fsdp"}
    for part in (1, 2):
        assert ref[part].keys() == got[part].keys() and ref[part]
        for k in ref[part]:
            assert ref[part][k].dtype == got[part][k].dtype, k
            assert torch.equal(ref[part][k], got[part][k]), k
    return got


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("saved_world, loaded_world", [(2, 1), (1, 2)])
def test_reshard_model_and_optimizer_exactly(saved_world, loaded_world, optimizer, tmp_path):
    got = _reshard(saved_world, loaded_world, {"optimizer": OPTIMIZERS[optimizer]}, tmp_path)
    moments = {t.dtype for k, t in got[2].items() if k.endswith("exp_avg")}
    assert moments == {getattr(torch, OPTIMIZERS[optimizer].get("moment_dtype", "float32"))}


@pytest.mark.parametrize("saved_world, loaded_world", [(2, 1), (1, 2)])
def test_unsharded_one_rank_and_fsdp_load_each_others_checkpoints(saved_world, loaded_world, tmp_path):
    """The FP8 presets train one GPU without FSDP (parallelism.unsharded_one_rank) and many with it: a
    checkpoint of either layout loads exactly into the other."""
    _reshard(saved_world, loaded_world, {"optimizer": OPTIMIZERS["fused_adam_bf16_moments"]}, tmp_path,
             one_rank={"parallelism": {"unsharded_one_rank": True, "comm_timeout_s": 120}})


@pytest.mark.parametrize("saved_world, loaded_world", [(2, 1), (1, 2), (2, 4)])
def test_elastic_resume_trains_on_the_batches_of_the_uninterrupted_run(saved_world, loaded_world, tmp_path, reference):
    """The data position is global (windows consumed by all ranks together): a checkpoint of N ranks resumes
    on M and the run goes on with exactly the global batches it would have seen (same losses; the global
    batch of 4 is 2 x 2 x 1, 1 x 2 x 2 or 4 x 1 x 1 ranks x micro-batch x accumulation)."""
    def extra(world):
        return {"training": {"local_batch_size": 1}} if world == 4 else {}

    first = run_ranks(_run, saved_world, str(tmp_path), "disabled", HALF, extra(saved_world))
    second = run_ranks(_run, loaded_world, str(tmp_path), "disabled", None, extra(loaded_world))
    assert second[0][0] == HALF
    assert first[0][1] + second[0][1] == pytest.approx(reference[1], abs=1e-5)


@pytest.mark.parametrize("loaded_world", [1, 4])
def test_the_default_global_batch_is_the_runs_own_on_other_rank_counts(loaded_world, tmp_path, reference):
    """training.global_batch_size = -1 (local x ranks, the presets' setting) is fixed when the run starts: a
    run of 2 ranks x 2 resumed on 1 rank went on with 2 sequences a step instead of 4, and said nothing. Now
    it keeps 4 by gradient accumulation (the losses of the uninterrupted run), and where the new rank count
    cannot make it up (4 ranks x 2 = 8) one line says how to keep it or change it."""
    default = {"training": {"global_batch_size": -1}}
    first = run_ranks(_run, 2, str(tmp_path), "disabled", HALF, default)
    if loaded_world == 4:
        with pytest.raises(AssertionError, match=re.escape(
                "the checkpoint trained with 4 sequences per step (training.global_batch_size = -1: local_batch_size "
                "x data-parallel ranks when the run started); 4 rank(s) x local_batch_size 2 = 8 cannot make that "
                "up by gradient accumulation. Keep its batch with --training.global_batch_size=4 "
                "--training.local_batch_size=1, or train on with 8 per step: --training.global_batch_size=8")):
            run_ranks(_run, 4, str(tmp_path), "disabled", None, default)
        return
    second = run_ranks(_run, 1, str(tmp_path), "disabled", None, default)
    assert second[0][0] == HALF
    assert first[0][1] + second[0][1] == pytest.approx(reference[1], abs=1e-5)


def test_loader_workers_change_freely_on_resume(tmp_path, reference):
    first = run_ranks(_run, 1, str(tmp_path), "disabled", HALF, {})
    second = run_ranks(_run, 1, str(tmp_path), "disabled", None, {"data": {"num_workers": 2}})
    assert first[0][1] + second[0][1] == reference[1]  # bit for bit


def test_retention_keeps_latest_k_and_ignores_partial_saves(tmp_path):
    run_ranks(_run, 1, str(tmp_path), "async", None, {"checkpoint": {"keep_latest_k": 2}})
    ck = tmp_path / "t/checkpoint"
    assert entries(ck) == ["step-15", "step-20"]
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

    from titan_te.errors import CheckpointError
    from titan_te.trainer import Trainer

    tr = Trainer(_cfg(str(tmp_path), 1))
    tr.train(until_step=5)  # step-5 saved
    real = fs.FileSystemWriter.write_data

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs.FileSystemWriter, "write_data", full)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.checkpointer.save(7)
    after = tr.model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)  # untouched
    monkeypatch.setattr(fs.FileSystemWriter, "write_data", real)
    losses = tr.train(until_step=8)  # training goes on
    assert len(losses) == 8
    ck = tmp_path / "t/checkpoint"
    assert entries(ck) == ["step-5"]
    monkeypatch.setattr(fs.FileSystemWriter, "write_data", full)  # the final save fails too: that is fatal
    with pytest.raises(CheckpointError, match="No space left on device.*newest good checkpoint is .*step-5.*"
                                              "the final save failed"):
        tr.checkpointer.save(STEPS)
    tr.close()
    assert entries(ck) == ["step-5"]  # the failed save left nothing behind


def _always_full(monkeypatch, after_step: int):
    """Every DCP write from `after_step` on fails with ENOSPC (a disk that filled up)."""
    import torch.distributed.checkpoint.filesystem as fs

    real = fs.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if int(str(self.path).rsplit("step-", 1)[1].split(".")[0]) > after_step:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, plan, planner)

    monkeypatch.setattr(fs.FileSystemWriter, "write_data", write_data)


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_environmental_save_failures_stop_the_run_after_the_limit(mode, tmp_path, monkeypatch, caplog):
    import logging

    from titan_te.errors import CheckpointError
    from titan_te.trainer import Trainer

    _always_full(monkeypatch, after_step=4)
    caplog.set_level(logging.INFO, logger="titan_te")
    with Trainer(_cfg(str(tmp_path), 1, mode, checkpoint={"interval": 2, "max_consecutive_failures": 2})) as tr:
        with pytest.raises(CheckpointError) as e:
            tr.train()
        stopped_at = tr.state.step
    assert CheckpointError.exit_code == 3
    msg = str(e.value)
    assert "No space left on device" in msg and "3 saves in a row failed" in msg, msg
    assert f"newest good checkpoint is {tmp_path / 't/checkpoint/step-4'}" in msg
    # steps 6 and 8 failed and were survived, step 10's failure (found at step 10 or, in the background, at 11) stops
    # (a background failure is found at the next step's poll, or at the latest when the next save waits for it)
    assert stopped_at == 10 if mode == "disabled" else 10 <= stopped_at <= 12
    survived = [r.getMessage() for r in caplog.records if "training continues" in r.getMessage()]
    assert len(survived) == 2 and "(1 of at most 2" in survived[0] and "(2 of at most 2" in survived[1]
    assert complete_steps_of(tmp_path) == [2, 4]


def complete_steps_of(tmp_path):
    from titan_te.checkpoint import complete_steps

    return complete_steps(tmp_path / "t/checkpoint")


def _saves(rank, world, tmp, mode):
    """A run with a save every 2 steps, all kept."""
    from titan_te.trainer import Trainer

    with Trainer(_cfg(tmp, world, mode, training={"steps": 9}, checkpoint={"interval": 2, "keep_latest_k": 0})) as tr:
        tr.train()


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_every_background_save_of_a_process_lands(mode, tmp_path):
    """pytorch#183413: torch 2.11's DefaultStager fails every async save after the first. Ours stages
    with its own reusable copier: all four background saves and the final one are complete."""
    from titan_te.checkpoint import Manifest

    run_ranks(_saves, 2, str(tmp_path), mode)
    ck = tmp_path / "t/checkpoint"
    assert entries(ck) == ["step-2", "step-4", "step-6", "step-8", "step-9"]
    lineages = set()
    for step in (2, 4, 6, 8, 9):
        assert (ck / f"step-{step}/.metadata").is_file()
        m = Manifest.read(ck / f"step-{step}")
        assert m.step == step and m.dp_world == 2 and "optimizer" in m.parts
        lineages.add(m.lineage)
    assert len(lineages) == 1
    log = (tmp_path / "t/logs/rank0.log").read_text()
    assert [f"saved step {s} " in log for s in (2, 4, 6, 8)] == [True] * 4 and log.count("(background)") == 4
    assert "failed" not in log


def test_the_stager_can_be_reused_and_copies_what_it_was_given():
    from titan_te.checkpoint.background import Stager

    for pinned in (False, True):
        stager = Stager(torch.device("cpu"), pinned=pinned)
        w = torch.zeros(6)
        for i in range(4):
            w.fill_(i)
            staged = stager.stage({"model": {"w": w, "nested": [w * 2, 3]}, "step": i})
            w.fill_(-1)  # training goes on after staging: the copy keeps the staged values
            assert torch.equal(staged["model"]["w"], torch.full((6,), float(i)))
            assert torch.equal(staged["model"]["nested"][0], torch.full((6,), 2.0 * i))
            assert staged["model"]["nested"][1] == 3 and staged["step"] == i
        stager.close()


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_bug_while_building_the_save_stops_the_run_with_its_traceback(mode, tmp_path, monkeypatch):
    from titan_te.checkpoint.parts import LRSchedulerPart
    from titan_te.trainer import Trainer

    def broken(self):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")

    monkeypatch.setattr(LRSchedulerPart, "state_dict", broken)
    with pytest.raises(TypeError, match="unsupported operand"):
        with Trainer(_cfg(str(tmp_path), 1, mode)) as tr:  # the start-up size check builds the state once
            tr.train()
    assert complete_steps_of(tmp_path) == []  # raised before training: never a run without its checkpoints
    log = (tmp_path / "t/logs/rank0.log").read_text()
    assert "Traceback" in log and "TypeError: unsupported operand" in log  # the run's log says how it ended


def test_a_bug_in_the_background_copy_stops_the_run(tmp_path, monkeypatch):
    from titan_te.checkpoint.background import Stager
    from titan_te.trainer import Trainer

    def broken(self, t, path):
        raise TypeError(f"cannot stage {path}")

    monkeypatch.setattr(Stager, "_copy", broken)
    with pytest.raises(TypeError, match="cannot stage"):
        with Trainer(_cfg(str(tmp_path), 1, "async_with_pinned_mem")) as tr:
            tr.train()
    assert 5 <= tr.state.step <= 6  # found at the next step's poll or when the optimizer waited for the copy
    assert complete_steps_of(tmp_path) == []


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
    assert entries(tmp_path / "t/checkpoint") == ["step-5"]

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), f"--job.dump_folder={tmp_path}", "--training.steps=2",
                        "--checkpoint.enable", f"--checkpoint.folder={blocker / 'ck'}"],
                       capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")})
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"checkpoint error: checkpoint.folder {blocker / 'ck'} cannot be created or written")
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
    saved = entries(tmp_path / "debug/checkpoint")
    assert len(saved) == 1 and saved[0].startswith("step-")
    step = int(saved[0].split("-")[1])
    again = subprocess.run(args[:3] + [f"--training.steps={step + 2}"] + args[4:], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {tmp_path / 'debug/checkpoint' / saved[0]} (step {step})" in again.stdout
    assert f"training from step {step + 1}" in again.stdout


def _go(tmp_path, steps, **extra):
    """One rank trains to `steps` (interval 5 unless overridden); returns (step it started after, losses)."""
    extra.setdefault("training", {})["steps"] = steps
    return run_ranks(_run, 1, str(tmp_path), "disabled", None, extra)[0]


def _refused(tmp_path, steps, **extra) -> str:
    with pytest.raises(AssertionError) as e:
        _go(tmp_path, steps, **extra)
    assert "CheckpointError" in str(e.value)
    return str(e.value).split("CheckpointError: ", 1)[1].split("\n")[0]


def test_retention_counts_only_this_lineage_and_keeps_the_resumed_from_checkpoint(tmp_path):
    _go(tmp_path, 4, checkpoint={"interval": 2, "keep_latest_k": 0})
    ck = tmp_path / "t/checkpoint"
    # a checkpoint of another run (another lineage) and a leftover DCP folder we did not write
    shutil.copytree(ck / "step-2", ck / "step-3")
    manifest = json.loads((ck / "step-3/titan_te.json").read_text())
    (ck / "step-3/titan_te.json").write_text(json.dumps({**manifest, "step": 3, "lineage": "another-run"}))
    (ck / "step-999").mkdir()
    (ck / "step-999/.metadata").write_bytes(b"garbage")
    start, _ = _go(tmp_path, 8, checkpoint={"interval": 2, "keep_latest_k": 1})
    assert start == 4
    # step-2 and step-6 are pruned; step-4 (resumed from), step-8 (just written), step-3 and step-999 stay
    assert entries(ck) == ["step-3", "step-4", "step-8", "step-999"]
    log = (tmp_path / "t/logs/rank0.log").read_text()
    assert f"ignoring {ck / 'step-999'}: not a complete titan_te checkpoint" in log


def test_loading_an_older_step_is_refused_unless_replace_newer_then_newer_ones_are_moved_aside(tmp_path):
    _go(tmp_path, 10)
    ck = tmp_path / "t/checkpoint"
    msg = _refused(tmp_path, 12, checkpoint={"load_step": 5})
    assert f"{ck} holds step-10, which later saves of this run would replace" in msg
    assert "--checkpoint.replace_newer=true" in msg and "nothing is deleted" in msg
    assert entries(ck) == ["step-10", "step-5"]  # untouched
    start, losses = _go(tmp_path, 12, checkpoint={"load_step": 5, "replace_newer": True})
    assert start == 5 and len(losses) == 7
    aside = [ck / n for n in entries(ck) if n.startswith("superseded-")]
    assert len(aside) == 1 and (aside[0] / "step-10/.metadata").is_file()
    assert [n for n in entries(ck) if n.startswith("step-")] == ["step-10", "step-12", "step-5"]


def test_a_resume_that_restarts_the_step_counter_never_overwrites_checkpoints(tmp_path):
    _go(tmp_path, 10)
    ck = tmp_path / "t/checkpoint"
    before = {n: (ck / n / ".metadata").stat().st_mtime_ns for n in entries(ck)}
    msg = _refused(tmp_path, 10, checkpoint={"exclude_from_loading": ["train_state"]})
    assert "exclude_from_loading has train_state, so this run counts its steps from 1 again" in msg
    assert "step-5, step-10" in msg
    assert {n: (ck / n / ".metadata").stat().st_mtime_ns for n in entries(ck)} == before


def test_a_resume_past_training_steps_says_there_is_nothing_to_train_and_keeps_the_checkpoint(tmp_path, capsys):
    from helpers import run_main

    argv = [f"--job.dump_folder={tmp_path}", "--training.seq_len=16", "--training.local_batch_size=2",
            "--checkpoint.enable=true", "--checkpoint.interval=2"]
    assert run_main(capsys, [*argv, "--training.steps=4"]).returncode == 0
    ck = tmp_path / "debug/checkpoint"
    before = {p.name: p.stat().st_mtime_ns for p in ck.glob("step-*")}
    r = run_main(capsys, [*argv, "--training.steps=2"])
    assert r.returncode == 0, r.stderr
    assert "nothing to train: the run is at step 4 and training.steps = 2; raise training.steps to train on" in r.stdout
    assert "training from step" not in r.stdout and "done: step 4 of 2" in r.stdout
    assert {p.name: p.stat().st_mtime_ns for p in ck.glob("step-*")} == before and "step-4" in before


def test_a_rerun_without_checkpointing_says_it_starts_over_and_a_load_step_without_it_is_refused(tmp_path, capsys):
    """A rerun that drops --checkpoint.enable=true trained from step 1 without a word; --checkpoint.load_step
    without it was ignored."""
    from helpers import run_main

    argv = [f"--job.dump_folder={tmp_path}", "--training.seq_len=16", "--training.local_batch_size=2",
            "--training.steps=2"]
    assert run_main(capsys, [*argv, "--checkpoint.enable=true"]).returncode == 0
    ck = tmp_path / "debug/checkpoint"
    before = {p.name: p.stat().st_mtime_ns for p in ck.glob("step-*")}
    r = run_main(capsys, argv)
    assert r.returncode == 0, r.stderr
    assert (f"checkpoint.enable = false: this run does not resume from the checkpoints in {ck} (newest: step 2) "
            "and starts at step 1; set --checkpoint.enable=true to resume") in r.stdout
    assert "training from step 1 to 2" in r.stdout
    assert {p.name: p.stat().st_mtime_ns for p in ck.glob("step-*")} == before == {"step-2": before["step-2"]}
    r = run_main(capsys, [*argv, "--checkpoint.load_step=2"])
    assert r.returncode == 2 and r.stderr == ("config error: checkpoint.load_step = 2 resumes a checkpoint, which "
                                              "needs checkpoint.enable = true; set --checkpoint.enable=true, or leave "
                                              "load_step out (in <defaults> or the command line)\n"), r.stderr


def test_a_model_only_final_save_finishes_the_run_or_names_the_full_checkpoint(tmp_path):
    _go(tmp_path, 10, checkpoint={"last_save_model_only": True})
    ck = tmp_path / "t/checkpoint"
    from titan_te.checkpoint import Manifest

    assert Manifest.read(ck / "step-10").model_only and Manifest.read(ck / "step-10").parts == ["model"]
    assert _go(tmp_path, 10, checkpoint={"last_save_model_only": True}) == (10, [])  # nothing left to train
    msg = _refused(tmp_path, 15)
    assert f"{ck / 'step-10'} holds only model weights" in msg
    assert "--checkpoint.load_step=5 --checkpoint.replace_newer=true" in msg
    start, losses = _go(tmp_path, 15, checkpoint={"load_step": 5, "replace_newer": True})
    assert start == 5 and len(losses) == 10


def test_a_checkpoint_of_another_shape_names_what_differs_and_no_older_step_with_the_same_problem(tmp_path):
    _go(tmp_path, 10)
    ck = tmp_path / "t/checkpoint"
    msg = _refused(tmp_path, 12, model={"n_layers": 2})
    assert f"checkpoint {ck / 'step-10'} does not fit this run" in msg
    assert "model.n_layers is 4 in the checkpoint, 2 in this run" in msg
    assert "corrupt" not in msg and "load_step" not in msg  # step-5 has 4 layers too: not suggested
    msg = _refused(tmp_path, 12, optimizer={"name": "fused_adam", "moment_dtype": "bfloat16"})
    assert "optimizer.moment_dtype is 'float32' in the checkpoint, 'bfloat16' in this run" in msg
    assert "--checkpoint.exclude_from_loading=optimizer" in msg
    # the tensors are compared too, not only the manifest's facts: with facts that claim 2 layers, the
    # checkpoint's extra blocks are still found (nothing is silently cut down)
    manifest = json.loads((ck / "step-10/titan_te.json").read_text())
    manifest["facts"]["model"]["n_layers"] = 2
    (ck / "step-10/titan_te.json").write_text(json.dumps(manifest))
    msg = _refused(tmp_path, 12, model={"n_layers": 2})
    assert "the checkpoint holds model tensors this run does not have: layers.2.*, layers.3.*" in msg, msg
    assert entries(ck) == ["step-10", "step-5"]


def test_summaries_name_the_data_and_split_this_process_from_the_run(tmp_path):
    _go(tmp_path, 4)
    _go(tmp_path, 6, validation={"enable": True, "freq": 100})
    log = (tmp_path / "t/logs/rank0.log").read_text()
    assert re.search(r"data: dataset embedded \(embedded:stdlib\), tokenizer byte \(vocab [\d,]+\): 1 shard\(s\), "
                     r"[\d,]+ tokens; validation: off", log)
    assert "validation: held-out 1.0% of the training tokens (1 shard(s), " in log
    done = [line for line in log.splitlines() if "done: " in line]
    assert "done: step 4 of 4, 512 tokens in the whole run; this process: 4 steps, 512 tokens" in done[0]
    assert "done: step 6 of 6, 768 tokens in the whole run; this process: 2 steps, 256 tokens" in done[1]


def _old_layout_then_resume(rank, world, tmp):
    """Save with the per-rank loader state of titan_te before the global data position, then resume."""
    from titan_te.checkpoint.parts import DataLoaderPart
    from titan_te.trainer import Trainer

    tr = Trainer(_cfg(tmp, world, training={"steps": 4}))
    tr.checkpointer.parts["dataloader"] = DataLoaderPart(tr.dataloader, rank, None)  # the old, per-rank layout
    tr.train()
    tr.close()
    tr = Trainer(_cfg(tmp, world, training={"steps": 6}))
    start, losses = tr.state.step, tr.train()
    tr.close()
    return start, losses


def test_a_checkpoint_with_the_old_per_rank_loader_state_resumes_with_a_new_data_order(tmp_path, caplog):
    start, losses = run_ranks(_old_layout_then_resume, 1, str(tmp_path))[0]
    assert start == 4 and len(losses) == 2
    log = (tmp_path / "t/logs/rank0.log").read_text()
    assert "holds the data loader's position in an older layout; the data order starts afresh" in log


def test_a_changed_sequence_length_restarts_the_data_order_with_a_warning(tmp_path):
    run_ranks(_run, 1, str(tmp_path), "disabled", 5, {})
    start, losses = run_ranks(_run, 1, str(tmp_path), "disabled", 7, {"training": {"seq_len": 64}})[0]
    assert start == 5 and len(losses) == 2
    log = (tmp_path / "t/logs/rank0.log").read_text()
    assert "the order of the data changed since the checkpoint (windows" in log and "seq_len 32 -> 64" in log
    assert "training goes on from the start of epoch 1 in the new order" in log


def test_the_checkpoint_facts_are_the_chosen_optimizers(tmp_path):
    """sgd's checkpoint records no Adam options (they were recorded for every optimizer), but its own: whether
    its state has a momentum buffer ([optimizer.sgd] momentum)."""
    import json

    run_ranks(_run, 1, str(tmp_path), "disabled", 5, {"optimizer": {"name": "sgd"}})
    facts = json.loads((tmp_path / "t/checkpoint/step-5/titan_te.json").read_text())["facts"]
    assert facts["optimizer"] == {"name": "sgd", "sgd.momentum_buffer": False}
    run_ranks(_run, 1, str(tmp_path / "adam"), "disabled", 5, {"optimizer": {"name": "fused_adam"}})
    facts = json.loads((tmp_path / "adam/t/checkpoint/step-5/titan_te.json").read_text())["facts"]
    assert facts["optimizer"] == {"name": "fused_adam", "moment_dtype": "float32", "master_weights": True}


def _on_or_off(rank, world, tmp, enable, optimizer):
    from titan_te.trainer import Trainer

    cfg = make_cfg(tmp, world=world, training={"steps": 4, "deterministic": True}, optimizer={"name": optimizer},
                   checkpoint={"enable": enable, "interval": 4})
    with Trainer(cfg) as tr:
        losses = tr.train()
        steps = {int(g.get("step", -1)) for g in tr.optimizer.param_groups} - {-1}
        steps |= {int(s["step"]) for s in tr.optimizer.state.values() if "step" in s}
        estimated = tr.checkpointer.one_save_bytes if enable else 0
    return losses, steps, estimated


@pytest.mark.parametrize("optimizer", ["adamw", "fused_adam"])
def test_checkpoints_on_change_no_loss_and_no_optimizer_step(optimizer, tmp_path):
    """The start-up space check once sized the optimizer's state through torch's get_optimizer_state_dict, which
    creates a fresh optimizer's state by running a step (lr 0, zero gradients): every run with checkpoints then
    trained with Adam's step count one ahead (the shared-GPU kill -9 test saw a 13% loss gap). The estimate
    made before the first step is also what a save then puts on disk."""
    for world in (1, 2):
        off = run_ranks(_on_or_off, world, str(tmp_path / f"off{world}"), False, optimizer)[0]
        on = run_ranks(_on_or_off, world, str(tmp_path / f"on{world}"), True, optimizer)[0]
        assert on[0] == off[0] and on[1] == off[1] == {4}
        folder = tmp_path / f"on{world}/t/checkpoint/step-4"
        on_disk = sum(f.stat().st_size for f in folder.iterdir())
        assert on[2] == pytest.approx(on_disk, rel=0.05), (on[2], on_disk)


@pytest.mark.parametrize("saved, loaded", [
    ((2, "fsdp"), (4, "hsdp")), ((4, "hsdp"), (2, "ddp")), ((2, "ddp"), (1, "fsdp"))],
    ids=["fsdp2-hsdp2x2", "hsdp2x2-ddp2", "ddp2-fsdp1"])
def test_a_checkpoint_resumes_under_another_data_parallel_kind(saved, loaded, tmp_path, reference):
    """A user who moves a job from one node to two may switch FSDP to HSDP (or to DDP for a small model):
    the checkpoint of one kind resumes under the other on the batches of the uninterrupted run."""
    def extra(world, kind):
        par = {"data_parallel": kind, "data_parallel_replicate_degree": 2 if kind == "hsdp" else 1}
        return {"parallelism": par, **({"training": {"local_batch_size": 1}} if world == 4 else {})}

    first = run_ranks(_run, saved[0], str(tmp_path), "disabled", HALF, extra(*saved))
    second = run_ranks(_run, loaded[0], str(tmp_path), "disabled", None, extra(*loaded))
    assert second[0][0] == HALF
    assert first[0][1] + second[0][1] == pytest.approx(reference[1], abs=1e-5)


def _random_layout(pick, world: int) -> dict:
    """One random data-parallel layout of `world` ranks for the global batch of 4 (as micro-batches of 1 or 2)."""
    kind = pick.choice(["fsdp", "hsdp", "ddp"] if world > 1 else ["fsdp", "ddp", "none"])
    replicas = pick.choice([d for d in (1, 2, 4) if world % d == 0]) if kind == "hsdp" else 1
    return {"parallelism": {"data_parallel": kind, "data_parallel_replicate_degree": replicas,
                            "reshard_after_forward": pick.choice([True, False])},
            "training": {"local_batch_size": pick.choice([b for b in (1, 2) if 4 % (b * world) == 0])},
            "activation_checkpoint": {"mode": pick.choice(["none", "full", "every_n"])},
            "data": {"num_workers": pick.choice([0, 1])}}


def test_random_layouts_before_and_after_a_resume_train_on_the_uninterrupted_losses(tmp_path, reference):
    """A random search over what a user may change between a run and its resume: the rank count, the
    data-parallel kind and its degrees, micro-batch size (so gradient accumulation), resharding, activation
    checkpointing and loader workers. Every resumed run gives the one-rank run's losses (this search found that
    DDP with gradient accumulation on several ranks trained on a wrong gradient)."""
    import random

    pick = random.Random(20261206)
    for case in range(3):
        saved, loaded = pick.choice([1, 2, 4]), pick.choice([1, 2, 4])
        before, after = _random_layout(pick, saved), _random_layout(pick, loaded)
        folder = str(tmp_path / str(case))
        first = run_ranks(_run, saved, folder, "disabled", HALF, before)
        second = run_ranks(_run, loaded, folder, "disabled", None, after)
        assert second[0][0] == HALF
        assert first[0][1] + second[0][1] == pytest.approx(reference[1], abs=1e-5), (saved, before, loaded, after)
        print(f"{saved} -> {loaded} ranks: {before} -> {after}")
