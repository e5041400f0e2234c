"""Many GPUs, proven on one: 2, 3 and 4 ranks share the H200 (TITAN_TE_SHARE_GPU=1: every rank on cuda:0,
gloo for CUDA tensors) and run the multi-GPU path for real: FSDP2 over TE FP8 weights, FP8 all-gather,
fused_adam (Triton) over real shards, amax reduction, DCP resharding, the launcher's signals.

Shapes: the 1B flavor cut to 2 blocks and seq 512 (1B's widths, so the FP8 GEMMs and the optimizer's FP8
path are the presets'); 3 ranks give uneven shards (2048 and 8192 rows do not divide by 3), which FSDP2 pads
for bf16 weights and refuses for TE's FP8 weights (they hand FSDP2 their shard unpadded): with FP8 weights
3 ranks are a one-line config error, with bf16 weights (FP8 compute) they train.
"""
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from helpers import make_cfg, planned_recomputation, run_ranks

pytestmark = pytest.mark.gpu

SHARE = "TITAN_TE_SHARE_GPU"
FP8_PRESET = {"model": {"flavor": "1B", "n_layers": 2, "backend": "te"},
              "training": {"seq_len": 512, "deterministic": True, "steps": 12},
              "fp8": {"enable": True, "params": True, "recipe": "delayed"},
              "optimizer": {"name": "fused_adam", "moment_dtype": "bfloat16", "lr": 3e-4},
              "lr_scheduler": {"warmup_steps": 3},
              "metrics": {"log_freq": 1, "enable_tensorboard": False}}


def _sections(**extra) -> dict:
    out = {k: dict(v) for k, v in FP8_PRESET.items()}
    for k, v in extra.items():
        out.setdefault(k, {}).update(v)
    return out


def _trainer(tmp, world, **extra):
    os.environ[SHARE] = "1"
    from titan_te.trainer import Trainer

    return Trainer(make_cfg(tmp, world=world, **_sections(**extra)))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _values(t) -> torch.Tensor:
    """A weight shard's values as float32 on the CPU (an FP8 shard dequantized with its scale)."""
    t = _local(t)
    return (t.dequantize() if hasattr(t, "dequantize") else t).float().detach().cpu().clone()


# --- world-size-invariant initialization --------------------------------------------------------------
def _init_shards(rank, world, tmp, **extra):
    tr = _trainer(tmp, world, **extra)
    shards = {n: _values(p) for n, p in tr.model.named_parameters()}
    shared = tr.env.shared_gpu
    tr.close()
    return shards, shared


def _full(per_rank: list[dict]) -> dict:
    """Full tensors from FSDP2's dim-0 shards (torch.chunk order; the last ranks' chunks may be short or empty)."""
    return {n: torch.cat([r[n] for r in per_rank]) for n in per_rank[0]}


def _init_shards_bf16(rank, world, tmp):
    return _init_shards(rank, world, tmp, fp8={"params": False})


@pytest.mark.parametrize("init, worlds", [(_init_shards, (2, 4)), (_init_shards_bf16, (3,))], ids=["fp8", "bf16"])
def test_full_weights_after_init_are_the_same_for_1_2_3_and_4_ranks(init, worlds, tmp_path):
    ref = _full([s for s, _ in run_ranks(init, 1, str(tmp_path / "w1"))])
    for world in worlds:
        got = run_ranks(init, world, str(tmp_path / f"w{world}"))
        assert all(shared for _, shared in got)
        full = _full([s for s, _ in got])
        assert full.keys() == ref.keys()
        for n in ref:
            assert torch.equal(full[n], ref[n]), f"{n} differs on {world} ranks"


# --- losses of N ranks x batch b track 1 rank x batch N*b ----------------------------------------------------
def _losses(rank, world, tmp, local_batch, global_batch, fp8_params=True, data_parallel="fsdp"):
    tr = _trainer(tmp, world, training={"local_batch_size": local_batch, "global_batch_size": global_batch},
                  fp8={"params": fp8_params}, parallelism={"data_parallel": data_parallel})
    losses = tr.train()
    tr.close()
    return losses


# The same global batch and the same full weights: the runs differ in how the weight gradient is summed.
# One rank sums all sequences inside one FP8 GEMM and rounds once to bf16; N ranks each round a partial sum to
# bf16, then reduce-scatter in fp32. Adam divides every gradient by its own running size, so those roundings
# reach the weights at full step size, and here the loss falls from 12.3 to 4 in 12 steps (lr 3e-4, 3 warm-up
# steps), where a small change in the weights is a visible change in the loss. Measured on the H200: 2 ranks
# within 1%, 4 ranks 1.26% (the issue saw 0.5% at seq 2048, where each rank sums 4x the tokens). 2% holds
# that rounding; a rank that reads the wrong sequences, a shard gathered in the wrong place or unreduced
# FP8 scales are each a larger change (a wrong gather is a loss of ~12 again).
TRACK = 0.02


# `2-ddp-accumulating`: DDP's 2 ranks x 2 micro-batches of 1 against 1 rank x 2 micro-batches of 2 (DDP reduced the
# gradient after every micro-batch and re-summed the earlier ones until f272aec; the CPU suite holds the exact
# comparison). The one-rank run takes as many micro-batches as each of the N ranks: delayed scaling updates its
# scales after every forward and backward, so FP8 runs of one and of two passes a step differ early in training
# as two FP8 runs, not as a bug (measured on an H100 before fp8.calibrate_first_step: 1 x 4 against 1 x 2 x 2
# micro-batches, gaps up to 21% in these 12 steps, with FP8 weights or bf16 ones; without FP8 3e-4).
@pytest.mark.parametrize("world, fp8_params, local, total, data_parallel",
                         [(2, True, 1, 2, "fsdp"), (3, False, 2, 6, "fsdp"), (4, True, 1, 4, "fsdp"),
                          (2, True, 1, 4, "ddp")], ids=["2", "3-bf16-weights", "4", "2-ddp-accumulating"])
def test_n_ranks_track_one_rank_with_the_same_global_batch(world, fp8_params, local, total, data_parallel, tmp_path):
    """N ranks x b x m micro-batches against 1 rank x N*b x m micro-batches: the same global batch."""
    micro = total // (world * local)
    one = run_ranks(_losses, 1, str(tmp_path / "one"), total // micro, total, fp8_params)[0]
    many = run_ranks(_losses, world, str(tmp_path / "many"), local, total, fp8_params, data_parallel)
    gaps = [abs(a - b) / a for a, b in zip(one, many[0])]
    worst = max(gaps)
    print(f"{world} ranks x {local} x {micro} micro-batches ({data_parallel}) against 1 x {total // micro} x {micro}: "
          f"relative loss gaps " + " ".join(f"{g:.1e}" for g in gaps))
    assert all(r == many[0] for r in many)  # every rank logs the same global loss
    assert one[-1] < one[0] and worst < TRACK


# --- FP8 all-gather moves FP8 bytes ----------------------------------------------------------------------
def _gathered_bytes(rank, world, tmp):
    import torch.distributed as dist

    counted = {"bytes": 0, "calls": 0}
    real = dist.all_gather_into_tensor

    def counting(output, input, *a, **kw):
        counted["bytes"] += output.numel() * output.element_size()
        counted["calls"] += 1
        return real(output, input, *a, **kw)

    tr = _trainer(tmp, world, training={"steps": 3, "local_batch_size": 1})
    dist.all_gather_into_tensor = counting
    try:
        tr.train(until_step=1)  # warm-up
        counted.update(bytes=0, calls=0)
        tr.train(until_step=2)
    finally:
        dist.all_gather_into_tensor = real
    fp8 = sum(p.numel() for p in tr.model.parameters() if hasattr(_local(p), "_data"))
    other = sum(p.numel() for p in tr.model.parameters() if not hasattr(_local(p), "_data"))
    tr.close()
    return counted, fp8, other


def test_fsdp_all_gathers_fp8_bytes_for_fp8_weights(tmp_path):
    """One step (forward, and backward with reshard_after_forward) gathers every weight twice: FP8 weights as
    1 byte an element (+ scales), the rest (embedding, norms, head) as bf16, 2 bytes."""
    counted, fp8, other = run_ranks(_gathered_bytes, 2, str(tmp_path))[0]
    per_gather = fp8 * 1 + other * 2
    bf16_would_be = (fp8 + other) * 2
    ratio = counted["bytes"] / per_gather
    print(f"all-gathered {counted['bytes'] / 1e6:,.1f} MB in {counted['calls']} calls for one step; FP8 size of one "
          f"gather of all weights {per_gather / 1e6:,.1f} MB ({fp8 / 1e6:,.1f} M FP8 + {other / 1e6:,.1f} M bf16 "
          f"elements), bf16 size {bf16_would_be / 1e6:,.1f} MB; ratio {ratio:.2f}")
    assert 1.5 <= ratio <= 2.2  # forward + backward gathers of FP8 bytes (and small scale tensors)
    assert counted["bytes"] < 2.2 * per_gather < 2 * bf16_would_be


# --- delayed-scaling amax is reduced over the data-parallel group ------------------------------------------
def _stats_after(rank, world, tmp):
    from titan_te.te.stats import fp8_stats

    tr = _trainer(tmp, world, training={"steps": 3, "local_batch_size": 1})
    tr.train()
    stats = fp8_stats(tr.model, tr.model_spec.fp8_stat_groups)
    tr.close()
    return stats


def test_fp8_scales_are_equal_on_every_rank_after_a_step(tmp_path):
    per_rank = run_ranks(_stats_after, 4, str(tmp_path))  # each rank saw other sequences
    assert per_rank[0] and all(r == per_rank[0] for r in per_rank), per_rank


# --- DCP reshard of FP8 weights + FP32 masters + bf16 moments: 1 -> 2 -> 4 -> 1 ------------------------------
def _state_shards(rank, world, tmp, train_until):
    """Train to `train_until` (saving there) or, with None, only resume; returns this rank's shards of the
    model (FP8 bytes + scales) and the optimizer state (FP32 masters, bf16 moments)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    tr = _trainer(tmp, world, training={"steps": 100, "local_batch_size": 4 // world},
                  checkpoint={"enable": True, "interval": 1000, "async_mode": "async_with_pinned_mem"})
    if train_until is not None:
        tr.train(until_step=train_until)
        tr.checkpointer.save(train_until)
        tr.checkpointer.flush()
    model = {n: _values(p) for n, p in tr.model.named_parameters()}
    osd = get_optimizer_state_dict(tr.model, tr.optimizer)["state"]
    opt = {f"{k}.{n}": _local(t).detach().cpu().clone().reshape(-1) for k, s in osd.items() for n, t in s.items()
           if torch.is_tensor(t) and t.dim() > 0}
    step = tr.state.step
    tr.close()
    return step, model, opt


def test_fp8_state_reshards_exactly_1_to_2_to_4_to_1(tmp_path):
    """FP8 weights compared as their full dequantized values (the same bytes and per-tensor scale give the
    same values), FP32 masters and bf16 moments bit for bit, after every hop of the chain."""
    folder = str(tmp_path)
    saved = run_ranks(_state_shards, 1, folder, 3)
    for world in (2, 4, 1):
        loaded = run_ranks(_state_shards, world, folder, None)
        assert loaded[0][0] == 3
        for part in (1, 2):
            a, b = _full([r[part] for r in saved]), _full([r[part] for r in loaded])
            assert a.keys() == b.keys() and a
            for n in a:
                assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), f"{n} after the hop to {world} ranks"
        saved = loaded


# --- elastic resume: an FP8 checkpoint continues on another rank count -----------------------------------
def _elastic(rank, world, tmp, until, alone=False):
    """alone: a world of one trains without FSDP (parallelism.unsharded_one_rank, as the FP8 presets on one GPU)."""
    tr = _trainer(tmp, world, training={"steps": 6, "global_batch_size": 4, "local_batch_size": 4 // world},
                  checkpoint={"enable": True, "interval": 3}, parallelism={"unsharded_one_rank": alone})
    start, losses = tr.state.step, tr.train(until_step=until)
    tr.close()
    return start, losses


@pytest.fixture(scope="module")
def saved_at_step_3(tmp_path_factory):
    """(uninterrupted run, run stopped after its step-3 save, that run's folder) for a rank count: made once and
    shared by the cases that save on the same ranks (each resumes a copy). `alone` changes only a world of one.
    Only the stopped runs' folders stay (a 1B-wide checkpoint is gigabytes), until the module ends."""
    made, folders = {}, []

    def get(world, alone):
        key = (world, alone and world == 1)
        if key not in made:
            tmp = tmp_path_factory.mktemp(f"saved_on_{world}{'_unsharded' if key[1] else ''}")
            folders.append(tmp)
            ref = run_ranks(_elastic, world, str(tmp / "ref"), None, key[1])[0]
            shutil.rmtree(tmp / "ref")
            first = run_ranks(_elastic, world, str(tmp / "run"), 3, key[1])[0]
            made[key] = ref, first, tmp / "run"
        return made[key]
    yield get
    for tmp in folders:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("saved, resumed, alone", [(2, 1, False), (2, 4, False), (2, 1, True), (1, 2, True)],
                         ids=["2-1", "2-4", "2-1_unsharded", "1_unsharded-2"])
def test_an_fp8_checkpoint_resumes_on_other_rank_counts_on_the_same_batches(saved, resumed, alone, saved_at_step_3,
                                                                               tmp_path):
    """Saved at step 3 on `saved` ranks, resumed on `resumed`: the data position is global, so steps 4-6 see the
    batches of the uninterrupted run, and the losses track it as N ranks track 1 (TRACK, above). `alone`: the
    one-rank side trains without FSDP, as the presets do on one GPU, so the user's path from one GPU to many
    and back (plain FP8 tensors on one side, DTensor shards on the other) is covered."""
    ref, first, folder = saved_at_step_3(saved, alone)
    shutil.copytree(folder, tmp_path / "run")
    second = run_ranks(_elastic, resumed, str(tmp_path / "run"), None, alone)[0]
    gaps = [abs(a - b) / a for a, b in zip(ref[1][3:], second[1])]
    print(f"{saved} -> {resumed} ranks{' (one without FSDP)' if alone else ''} after step 3: relative loss gaps "
          + " ".join(f"{g:.1e}" for g in gaps))
    assert (first[0], second[0]) == (0, 3) and first[1] == pytest.approx(ref[1][:3], rel=1e-5)
    assert len(second[1]) == 3 and max(gaps) < TRACK


# --- activation checkpointing of blocks with FP8 weights under FSDP --------------------------------------
def _recomputed(rank, world, tmp, mode, reshard=True):
    tr = _trainer(tmp, world, training={"steps": 6, "local_batch_size": 1},
                  activation_checkpoint={"mode": mode, "every_n": 1}, parallelism={"reshard_after_forward": reshard})
    kept = sum(tr.fp8.keeps_gathered(b) for b in tr.model.layers.values())
    losses = tr.train()
    tr.close()
    return losses, kept


def test_recomputed_fp8_blocks_keep_their_gathered_weights_and_the_losses(tmp_path):
    """A block that activation checkpointing recomputes needs its FP8 weights row-wise again in the backward,
    where FSDP gathers them column-wise only: the FP8 policy keeps such blocks gathered (the planner counts
    their memory), and the recomputed run gives the losses of the plain one. So does ZeRO-2
    (parallelism.reshard_after_forward = false), where every block stays gathered: a gathered FP8 weight kept
    from forward to backward once carried the transpose of the step before into the backward (losses 8-19%
    off from step 3 on). Recomputing only the MLP's first half (mode mlp, every block) needs FC1's weight
    row-wise again too."""
    plain, none_kept = run_ranks(_recomputed, 2, str(tmp_path / "plain"), "none")[0]
    full, all_kept = run_ranks(_recomputed, 2, str(tmp_path / "full"), "full")[0]
    mlp, mlp_kept = run_ranks(_recomputed, 2, str(tmp_path / "mlp"), "mlp")[0]
    zero2, _ = run_ranks(_recomputed, 2, str(tmp_path / "zero2"), "none", False)[0]
    for name, losses in (("activation checkpointing", full), ("MLP recomputation", mlp), ("ZeRO-2", zero2)):
        gaps = [abs(a - b) / a for a, b in zip(plain, losses)]
        print(f"{name} of FP8 blocks on 2 ranks: relative loss gaps " + " ".join(f"{g:.1e}" for g in gaps))
        assert max(gaps) < 1e-3, name
    assert (none_kept, all_kept, mlp_kept) == (0, 2, 2)


# --- the planner's memory estimate against the peak of shared ranks ----------------------------------------
def _peak_and_plan(rank, world, tmp, micro_batches=1):
    from titan_te.plan import make_plan

    tr = _trainer(tmp, world, model={"n_layers": 8}, training={"steps": 3, "seq_len": 4096, "local_batch_size": 2,
                                                               "global_batch_size": 2 * world * micro_batches},
                  profiling={"enable_memory_snapshot": True, "memory_snapshot_steps": [3]})  # what held the peak
    torch.cuda.reset_peak_memory_stats()
    tr.train()
    peak = torch.cuda.max_memory_allocated()  # this rank's process only: its own caching allocator
    est = make_plan(tr.cfg, world, 1, "H200", tr.tokenizer.vocab_size).peak["none"]
    tr.close()
    return peak, est


def test_the_planners_memory_estimate_is_within_10_percent_of_shared_ranks_peaks(tmp_path):
    """2 ranks, FP8 weights, 1B-wide blocks (8 of them), seq 4096 x 2 (the planner says 13.1 GiB a rank, of
    which its fixed allowance for workspaces is 2): each rank's peak of allocated memory (its own process and
    allocator, though the GPU is shared) against the planner's peak for that rank; and with 2 micro-batches a step,
    where each rank holds its shard of every gradient through the second micro-batch (the planner once left that
    out: 16 of the 8B's blocks with 4 micro-batches ran out of memory on an H100 where it had said fits)."""
    per_rank = run_ranks(_peak_and_plan, 2, str(tmp_path / "one"))
    per_rank_accumulating = run_ranks(_peak_and_plan, 2, str(tmp_path / "two"), 2)
    for micro, runs in ((1, per_rank), (2, per_rank_accumulating)):
        for rank, (peak, est) in enumerate(runs):
            print(f"{micro} micro-batch(es), rank {rank}: measured peak {peak / 2**30:.2f} GiB, planner "
                  f"{est / 2**30:.2f} GiB ({est / peak - 1:+.1%})")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_peak

    for micro, folder in ((1, "one"), (2, "two")):
        snapshot = tmp_path / folder / "t/memory_snapshot/step-3-rank0.pickle"
        found = memory_peak.peak(pickle.loads(snapshot.read_bytes()))
        print(f"{micro} micro-batch(es), rank 0, by its memory snapshot: peak {found['peak'] / 2**30:.2f} GiB, "
              f"{found['before'] / 2**30:.2f} of it from before the recording; then "
              + "; ".join(f"{size / 2**30:.2f} {where}" for size, where in found["rows"][:10]))
    assert all(abs(est / peak - 1) <= 0.10 for peak, est in per_rank + per_rank_accumulating)


# --- the launcher on shared ranks: kill -9 during an async save, SIGTERM -------------------------------------
SHAPE = ["--model.n_layers=2", "--training.seq_len=512", "--training.local_batch_size=1",
         "--training.deterministic=true", "--lr_scheduler.warmup_steps=3", "--metrics.log_freq=1",
         "--checkpoint.interval=3", "--checkpoint.async_mode=async_with_pinned_mem"]


def _env(ngpu: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, SHARE: "1", "NGPU": str(ngpu)}


def _args(tmp_path: Path, steps: int) -> list[str]:
    return ["./run_train.sh", "--config", "llama3_1b_fp8", f"--job.dump_folder={tmp_path}", f"--training.steps={steps}",
            *SHAPE]


LOSS = re.compile(r"step\s+(\d+)\s+loss\s+([0-9.]+)")


def test_two_shared_ranks_survive_kill_9_during_an_async_save_and_sigterm(tmp_path):
    ref = subprocess.run([*_args(tmp_path / "ref", 12), "--checkpoint.enable=false"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=_env(2))
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert f"{SHARE}=1: every rank on cuda:0 over gloo" in ref.stdout
    want = {int(s): float(v) for s, v in LOSS.findall(ref.stdout)}
    # kill -9 of the launcher while step 6's background save is in flight (its workers then get SIGTERM)
    proc = subprocess.Popen(_args(tmp_path / "run", 12), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(2), start_new_session=True)
    for line in proc.stdout:
        if re.search(r"step\s+7\s+loss", line):
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(2)
    again = subprocess.run(_args(tmp_path / "run", 12), cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env=_env(2))
    assert again.returncode == 0, again.stderr[-3000:]
    start = int(re.search(r"training from step (\d+)", again.stdout).group(1))
    assert start in (4, 7)  # from step-3, or step-6 if its background save landed before the kill
    got = {int(s): float(v) for s, v in LOSS.findall(again.stdout)}
    worst = max(abs(got[s] - want[s]) / want[s] for s in got)
    print(f"resumed at {start}; worst relative loss gap to the uninterrupted 2-rank run {worst:.2e}")
    assert worst < 1e-3
    shutil.rmtree(tmp_path / "run")  # 1B-wide checkpoints: one run's at a time on the device's disk
    # SIGTERM to the group: every rank saves (one checkpoint, written by both ranks), exit 75
    proc = subprocess.Popen(_args(tmp_path / "term", 1000), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(2), start_new_session=True)
    for line in proc.stdout:
        if re.search(r"step\s+4\s+loss", line):
            break
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75 and err.startswith("preempted: stopped by a signal after step"), err
    step = int(err.split("after step ")[1].split(";")[0])
    folder = next((tmp_path / "term").glob(f"*/checkpoint/step-{step}"))
    assert {p.name.split("_")[2] for p in folder.glob("__*_*.distcp")} == {"0", "1"}  # both ranks wrote shards


# --- HSDP 2 x 2 and DDP with FP8 --------------------------------------------------------------------------
@pytest.mark.parametrize("ngpu, parallel", [(4, ["--parallelism.data_parallel=hsdp",
                                                 "--parallelism.data_parallel_replicate_degree=2"]),
                                            (2, ["--parallelism.data_parallel=ddp"])], ids=["hsdp-2x2", "ddp-2"])
def test_hsdp_and_ddp_train_fp8_on_shared_ranks(ngpu, parallel, tmp_path):
    r = subprocess.run([*_args(tmp_path, 8), "--checkpoint.enable=false", *parallel], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=_env(ngpu))
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(v) for _, v in LOSS.findall(r.stdout)]
    print(parallel, losses)
    assert len(losses) == 8 and losses[-1] < losses[0]


def test_fp8_weights_on_shard_counts_that_do_not_divide_them_are_one_line(tmp_path):
    r = subprocess.run(_args(tmp_path, 2), cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(3))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    first = r.stderr.splitlines()[0]
    assert first.startswith("config error: ") and re.search(r"is an FP8 weight of [0-9,]+ rows, which 3 FSDP shards "
                                                            r"do not divide evenly", first), r.stderr[-3000:]


def test_more_ranks_than_gpus_without_the_sharing_mode_is_one_line(tmp_path):
    env = {k: v for k, v in _env(2).items() if k != SHARE}
    r = subprocess.run(_args(tmp_path, 2), cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert r.stderr.startswith(f"config error: NGPU=2, but this node has {torch.cuda.device_count()} visible GPU")


# --- activation_checkpoint.mode = auto on ranks sharing the GPU ------------------------------------------------
AUTO = {"model": {"n_layers": 4}, "training": {"steps": 2, "seq_len": 2048}, "activation_checkpoint": {"mode": "auto"}}


def _auto(rank, world, tmp, batch):
    tr = _trainer(tmp, world, **{**AUTO, "training": {**AUTO["training"], "local_batch_size": batch}})
    ac = tr.cfg.activation_checkpoint
    wrapped = sorted(int(k) for k, b in tr.model.layers.items() if b.recomputes_forward)
    losses = tr.train()
    tr.close()
    return ac.mode, ac.every_n, wrapped, losses


def test_mode_auto_takes_the_planners_choice_for_each_ranks_share_of_the_gpu(tmp_path):
    """2 ranks on one GPU, FSDP over FP8 weights: each rank plans for half the card, and both take the planner's
    choice for that share (the ranks must choose alike: FSDP's gathers follow the recomputed blocks) at the
    smallest batch for which it recomputes something, and train."""
    from titan_te.parallel.wrappers import recomputed

    def plan(batch):
        cfg = make_cfg(tmp_path / "plan", world=2,
                       **_sections(**{**AUTO, "training": {**AUTO["training"], "local_batch_size": batch}}))
        return planned_recomputation(cfg, 2, ranks_per_gpu=2)

    batch = next(b for b in range(8, 257, 8) if plan(b).mode != "none")
    choice = plan(batch)
    ranks = run_ranks(_auto, 2, str(tmp_path / "run"), batch)
    print(f"mode auto on 2 ranks sharing the GPU, batch {batch}: planner {choice.describe()} "
          f"({choice.peak / 2**30:.1f} GiB a rank); ranks chose " + ", ".join(f"{m} every_n {n}" for m, n, *_ in ranks))
    assert choice.fits
    chosen = [i for i in range(4) if recomputed(i, choice.mode, choice.every_n)]
    for mode, every_n, wrapped, losses in ranks:
        assert (mode, every_n, wrapped) == (choice.mode, choice.every_n, chosen)
        assert len(losses) == 2 and all(x == x and x < 20 for x in losses)
