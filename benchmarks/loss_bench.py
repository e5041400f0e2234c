"""Loss curves of the presets with and without a numerics-changing lever, side by side, through the user's own
command (`./run_train.sh`): is a faster setting also a setting that trains as well?

    python benchmarks/loss_bench.py --size 8b --runs fp8,fp8_attention --steps 300 --n_layers 8
    python benchmarks/loss_bench.py --size 1b --runs bf16,fp8,fp8_current --steps 300

Every run is the preset at its shapes (seq 8192, the flavor's widths and heads; --n_layers cuts only the depth,
which keeps every kernel's shapes) on the preset's data, checkpoints and TensorBoard off, the same seed. The
first run is the reference. The table shows each run's loss averaged over windows of --window steps (single
steps are noisy) and its relative gap to the reference in the same window; the last line, the mean gap over
the last quarter of the steps. A lever passes when that gap is within what FP8 itself costs against bf16 at
the same shapes (the `fp8` row against `bf16`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {"1b": "llama3_1b_fp8", "8b": "llama_fp8"}
# run name -> overrides of the preset
RUNS = {
    "bf16": ["--fp8.enable=false"],
    "fp8": [],
    "fp8_attention": ["--fp8.attention=true"],
    # FP8 attention's loss, by where delayed scaling may fail it: a scale one step behind a growing amax clips
    # (dP and dO grow fast early in training), a scale held down by the largest amax of 1024 steps loses
    # precision; headroom of 2 powers of two against the first, the latest amax only against the second (both
    # apply to every FP8 tensor, so the fp8 rows with them are the references)
    "fp8_attention_margin2": ["--fp8.attention=true", "--fp8.margin=2"],
    "fp8_margin2": ["--fp8.margin=2"],
    "fp8_attention_recent": ["--fp8.attention=true", "--fp8.amax_history_len=16",
                             "--fp8.amax_compute_algo=most_recent"],
    "fp8_recent": ["--fp8.amax_history_len=16", "--fp8.amax_compute_algo=most_recent"],
    "fp8_current": ["--fp8.recipe=current"],
    "fp8_flash": ["--model.attention_kernel=flash"],  # FlashAttention's kernels instead of cuDNN's
    "fp8_bf16_wgrad": ["--model.wgrad_dtype=bfloat16"],  # the weight gradients TE writes in place, in bf16
    "fp8_uncalibrated": ["--fp8.calibrate_first_step=false"],  # delayed scaling's first step as TE leaves it
    "fp8_head_all": ["--fp8.head=all"],
    "fp8_head_off": ["--fp8.head=off"],
    "fp8_head_dgrad": ["--fp8.head=dgrad"],
    "fp8_b2_every4": ["--training.local_batch_size=2", "--activation_checkpoint.mode=every_n",
                      "--activation_checkpoint.every_n=4"],
    # the 8B's fastest fit on one H200 (train_bench's 8b_fp8_b2_mlp4) against bf16 at the same batch: batch 2 is a
    # choice of the run, FP8 against bf16 at it is the check
    "bf16_b2": ["--fp8.enable=false", "--training.local_batch_size=2"],
    "fp8_b2_mlp4": ["--training.local_batch_size=2", "--activation_checkpoint.mode=mlp",
                    "--activation_checkpoint.every_n=4"],
}


def run(name: str, a) -> list[float] | None:
    """The run's loss per step, read back from its metrics.jsonl; None if it failed (its log names why)."""
    folder = Path(a.scratch or tempfile.mkdtemp(prefix="loss_bench_")) / name
    argv = ["./run_train.sh", "--config", a.config or PRESETS[a.size], f"--training.steps={a.steps}",
            "--checkpoint.enable=false", "--metrics.enable_tensorboard=false", "--metrics.log_freq=1",
            f"--job.dump_folder={folder}", f"--job.name={name}", f"--training.seed={a.seed}", *([f"--model.n_layers={a.n_layers}"] if a.n_layers else []),
            *RUNS[name], *a.overrides]
    log = Path(a.log_dir, f"{name}.log")
    print(f"{name}: {' '.join(argv[1:])} (log {log})", flush=True)
    with open(log, "w") as out:
        rc = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "NGPU": "1"},
                            timeout=a.timeout).returncode
    metrics = folder / name / "metrics.jsonl"
    if rc != 0 or not metrics.is_file():
        print(f"{name}: failed with exit {rc}; see {log}", file=sys.stderr)
        return None
    losses = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if "loss_metrics/global_avg_loss" in rec:
            losses[rec["step"]] = rec["loss_metrics/global_avg_loss"]
    return [losses[s] for s in sorted(losses)]


def table(curves: dict[str, list[float]], window: int) -> str:
    names = list(curves)
    ref = names[0]
    steps = min(len(c) for c in curves.values())
    rows = [f"loss averaged over {window} steps; gap: relative to {ref} in the same window", "",
            "| steps | " + " | ".join(names) + " | " + " | ".join(f"gap {n}" for n in names[1:]) + " |",
            "| --- | " + " | ".join("---:" for _ in names) + " | " + " | ".join("---:" for _ in names[1:]) + " |"]

    def mean(c, lo, hi):
        return sum(c[lo:hi]) / (hi - lo)

    for lo in range(0, steps - window + 1, window):
        means = {n: mean(c, lo, lo + window) for n, c in curves.items()}
        gaps = [f"{means[n] / means[ref] - 1:+.2%}" for n in names[1:]]
        rows.append(f"| {lo + 1}-{lo + window} | " + " | ".join(f"{means[n]:.4f}" for n in names) + " | "
                    + " | ".join(gaps) + " |")
    tail = max(1, steps // 4)
    last = {n: mean(c, steps - tail, steps) for n, c in curves.items()}
    rows += ["", f"mean over the last {tail} steps: " + ", ".join(
        f"{n} {last[n]:.4f}" + ("" if n == ref else f" ({last[n] / last[ref] - 1:+.2%})") for n in names)]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(PRESETS), default="1b")
    ap.add_argument("--config", default="", help="another config than the size's preset (a file or preset name)")
    ap.add_argument("--runs", default="bf16,fp8", help=f"comma-separated, the first the reference; of: {', '.join(RUNS)}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--window", type=int, default=25)
    ap.add_argument("--n_layers", type=int, default=0, help="cut the depth (0: the flavor's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", dest="overrides", action="append", default=[],
                    help="an extra --section.key=value for every run (repeatable)")
    ap.add_argument("--log_dir", default="", help="where each run's log goes (default: a temporary folder)")
    ap.add_argument("--scratch", default="", help="folder for the run folders (default: a temporary folder)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--out", default="", help="also write the table and the curves (JSON) next to this path")
    a = ap.parse_args()
    names = a.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown or len(names) < 2:
        print(f"loss_bench: --runs needs two or more of: {', '.join(RUNS)}"
              + (f" (unknown: {', '.join(unknown)})" if unknown else ""), file=sys.stderr)
        return 2
    if a.window < 1 or a.steps < a.window:
        print("loss_bench: --steps must be at least --window (>= 1)", file=sys.stderr)
        return 2
    a.log_dir = a.log_dir or tempfile.mkdtemp(prefix="loss_bench_logs_")
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    curves = {n: c for n in names if (c := run(n, a)) is not None}
    if len(curves) < 2 or names[0] not in curves:
        print("loss_bench: the reference or every other run failed; nothing to compare", file=sys.stderr)
        return 1
    text = table(curves, a.window)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
        Path(a.out).with_suffix(".json").write_text(json.dumps(curves) + "\n")
    return 0 if len(curves) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
