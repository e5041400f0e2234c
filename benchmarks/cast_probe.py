"""The dtype casts of one training step, largest first, with where each comes from: what a GPU trace shows only as
a copy kernel (train_bench's breakdown: "cast/transpose", queued by `aten::to > aten::_to_copy > aten::copy_`).

Runs a preset through the trainer for --warmup steps, then records one step under a torch dispatch mode: every
copy that changes dtype, of at least --min_numel elements, grouped by shape, dtypes and the innermost frames of this
project's code on the Python stack ("autograd" when there is none: the engine casting a gradient to its tensor's
dtype, e.g. TE's bf16 weight gradients to the FP32 nominal dtype of FP8 weights).

    python benchmarks/cast_probe.py --config llama3_1b_fp8 --training.seq_len=4096
    python benchmarks/cast_probe.py --config debug --model.backend=torch --training.device=cpu --min_numel 1
"""
from __future__ import annotations

import argparse
import math
import sys
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

COPIES = ("aten._to_copy.default", "aten.copy_.default")


def _where() -> str:
    """The innermost two frames of this project's code (not this file's) on the stack, or "autograd"."""
    ours = [f for f in traceback.extract_stack()
            if f.filename.startswith(str(ROOT)) and not f.filename.endswith("cast_probe.py")]
    return " < ".join(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno}" for f in reversed(ours[-2:])) or "autograd"


class CastRecorder(TorchDispatchMode):
    """Counts the dtype-changing copies of >= min_numel elements: (shape, from, to, where) -> count."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel, self.seen = min_numel, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name in COPIES:
            src, dst = (args[1], args[0]) if name == "aten.copy_.default" else (args[0], out)
            if (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.dtype != dst.dtype
                    and src.numel() >= self.min_numel):
                self.seen[(tuple(src.shape), src.dtype, dst.dtype, _where())] += 1
        return out


def table(seen: Counter) -> list[str]:
    """Markdown rows, the most bytes moved (read and written) first."""
    rows = []
    for (shape, src, dst, where), n in seen.items():
        moved = n * math.prod(shape) * (src.itemsize + dst.itemsize)
        rows.append((moved, f"| {n} | {list(shape)} | {str(src).removeprefix('torch.')} -> "
                            f"{str(dst).removeprefix('torch.')} | {moved / 1e6:,.1f} | {where} |"))
    rows.sort(key=lambda r: -r[0])
    head = ["| casts | shape | dtypes | MB moved | where |", "| ---: | --- | --- | ---: | --- |"]
    return head + [r for _, r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=2, help="steps before the recorded one")
    ap.add_argument("--min_numel", type=int, default=1 << 20, help="the smallest cast listed, in elements")
    a, train_argv = ap.parse_known_args()  # the rest goes to the trainer: --config FILE and overrides
    from titan_te import config as config_mod
    from titan_te.errors import ConfigError
    from titan_te.logging_setup import setup_logging
    from titan_te.trainer import Trainer

    argv = [*train_argv, f"--training.steps={a.warmup + 1}", "--checkpoint.enable=false",
            "--metrics.enable_tensorboard=false"]
    try:
        cfg, _ = config_mod.load(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    setup_logging()
    recorder = CastRecorder(a.min_numel)
    with Trainer(cfg) as tr:
        tr.train(until_step=a.warmup)
        with recorder:
            tr.train(until_step=a.warmup + 1)
    print(f"\ndtype casts of >= {a.min_numel:,} elements in step {a.warmup + 1}\n")
    print("\n".join(table(recorder.seen)) if recorder.seen else "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
