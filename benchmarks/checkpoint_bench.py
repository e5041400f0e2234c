"""How long training is blocked per checkpoint save, for each checkpoint.async_mode.

    python benchmarks/checkpoint_bench.py [--flavor 1B] [--n_layers 0] [--folder /tmp/ckbench] [overrides]

Builds the real trainer (model, AdamW state, data loader), takes one step, then for each mode saves
the full training state `--repeats` times (every save must be complete on disk). "blocked" is what the training loop waits for: the save call itself
plus, for the pinned-memory mode, the wait for staging before the next optimizer step (a real
training step runs in between, as in the trainer). "on disk s" runs from the save call until the
checkpoint is complete on disk; for the async modes it includes the training step that overlapped it.
"checksums s" is what recording the files' CRC32s costs inside each save (it is part of "on disk s").
Prints a table; async modes must block for at most 10% of the synchronous save.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from titan_te import config as config_mod  # noqa: E402
from titan_te.checkpoint import CheckpointManager, complete_steps, integrity, step_dir  # noqa: E402
from titan_te.checkpoint.folder import folder_bytes  # noqa: E402
from titan_te.logging_setup import setup_logging  # noqa: E402
from titan_te.trainer import Trainer  # noqa: E402

MODES = ("disabled", "async", "async_with_pinned_mem")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="1B")
    ap.add_argument("--n_layers", type=int, default=0)
    ap.add_argument("--folder", default="/tmp/titan_te_ckbench")
    ap.add_argument("--repeats", type=int, default=2)
    a, overrides = ap.parse_known_args()
    setup_logging()
    folder = Path(a.folder)
    shutil.rmtree(folder, ignore_errors=True)
    cfg, _ = config_mod.load([f"--job.dump_folder={folder}", "--job.name=bench", f"--model.flavor={a.flavor}",
                                f"--model.n_layers={a.n_layers}", "--training.steps=100",
                                "--training.local_batch_size=1", "--training.seq_len=256",
                                "--metrics.enable_tensorboard=false", "--metrics.log_freq=1000", *overrides])
    tr = Trainer(cfg)
    tr._data_iter = iter(tr.dataloader)

    def step():
        tr.train_step(tr._next_microbatches()[0])
        if tr.device.type == "cuda":
            torch.cuda.synchronize()

    step()
    t0 = time.perf_counter()
    step()
    step_s = time.perf_counter() - t0
    state_gb = sum(p.numel() * p.element_size() * 3 for p in tr.model.parameters()) / 1e9  # weights + 2 moments
    rows = []
    for i, mode in enumerate(MODES):
        ck_cfg = replace(cfg.checkpoint, enable=True, async_mode=mode, keep_latest_k=0, folder=str(folder / mode))
        ck = CheckpointManager(ck_cfg, folder / mode, tr.checkpointer.parts, tr.env, tr._facts(), 10**9,
                               optimizer=tr.optimizer)  # its steps wait for a save's copy, as in training
        blocked, total = [], []
        for r in range(a.repeats):
            t0 = time.perf_counter()
            ck.save(100 * (i + 1) + r, sync=mode == "disabled")
            step()  # the next step overlaps the background work; its optimizer step waits for staging
            blocked.append(ck.last_blocked_s)
            ck.flush()
            total.append(time.perf_counter() - t0 - (step_s if mode == "disabled" else 0.0))
        first = step_dir(folder / mode, 100 * (i + 1))
        size_gb = folder_bytes(first) / 1e9
        t0 = time.perf_counter()  # what recording the checksums costs inside each save (files in the page cache)
        integrity.checksums(sorted(p for p in first.iterdir() if p.is_file()))
        crc_s = time.perf_counter() - t0
        saved = complete_steps(folder / mode)
        assert len(saved) == a.repeats, f"{mode}: only {saved} of {a.repeats} saves are complete"
        ck.close()
        shutil.rmtree(folder / mode, ignore_errors=True)
        rows.append((mode, min(blocked), min(total), size_gb, crc_s))
    sync = rows[0][1]
    print(f"\ncheckpoint blocking, {a.flavor} flavor ({sum(p.numel() for p in tr.model.parameters()) / 1e6:,.0f} M "
          f"parameters, {state_gb:.1f} GB weights+moments), device {tr.device}, train step {step_s:.2f}s")
    print(f"{'async_mode':<24}{'blocked s':>12}{'on disk s':>12}{'blocked / sync':>16}{'GB':>8}{'checksums s':>13}")
    for mode, b, t, gb, crc in rows:
        print(f"{mode:<24}{b:>12.3f}{t:>12.2f}{100 * b / sync:>15.1f}%{gb:>8.2f}{crc:>13.2f}")
    ok = all(b <= 0.10 * sync for m, b, _, _, _ in rows[1:])
    print(f"async modes block <= 10% of a synchronous save: {'yes' if ok else 'NO'}")
    tr.close()
    shutil.rmtree(folder, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
