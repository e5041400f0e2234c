"""Data-loader throughput: tokens/s per worker for memmap token shards and for raw jsonl text.

    python benchmarks/data_bench.py [--tokens 200000000] [--seq_len 8192] [--batch 4] [--workers 0,1,2]

memmap: the real StatefulDataLoader over `tokens` shards (uint32, the Llama 3 vocabulary), shuffled
windows, as the trainer reads them; tokens/s per worker process (0 workers = the main process).
jsonl: tokenizing raw .jsonl text with the `prepare` path (the byte tokenizer, and an hf BPE
tokenizer when one is given with --tokenizer_path), per worker process.
A GPU step of the 8B flavor consumes about 11 k tokens/s per H200; the memmap path must deliver at
least 5 M tokens/s per core so that it never stalls one.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from titan_te.data.loader import build_dataloader  # noqa: E402
from titan_te.data.prepare import TokenizerArgs, prepare  # noqa: E402
from titan_te.data.shards import ShardWriter, open_shards, read_manifest, write_manifest  # noqa: E402

TARGET = 5e6


def memmap_rate(folder: Path, seq_len: int, batch: int, workers: int, seconds: float) -> float:
    class Vocab:  # the Llama 3 vocabulary: uint32 shards
        vocab_size = 128256

    source = open_shards(folder, "train", Vocab(), read_manifest(folder))
    loader = build_dataloader(source, seq_len, batch, 0, 1, seed=0, shuffle=True, num_workers=workers,
                              pin_memory=False)
    it = iter(loader)
    for _ in range(max(2, workers * 2)):  # warm up the workers
        next(it)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b = next(it)
        n += b["input"].numel()
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200_000_000)
    ap.add_argument("--seq_len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--jsonl_mb", type=int, default=20)
    ap.add_argument("--tokenizer_path", default="", help="an hf tokenizer.json for the jsonl rows")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="titan_te_databench_"))
    try:
        w = ShardWriter(tmp / "shards", "train", 128256, "synthetic", 128000, 128001, shard_tokens=50_000_000)
        rng = np.random.default_rng(0)
        left = a.tokens
        while left:  # documents of 2-10 k tokens
            n = min(left, int(rng.integers(2000, 10000)))
            w.add(rng.integers(0, 128000, n, dtype=np.uint32))
            left -= n
        w.close()
        write_manifest(tmp / "shards", {"train": w.index}, {})
        rows = []
        for workers in [int(x) for x in a.workers.split(",")]:
            rate = memmap_rate(tmp / "shards", a.seq_len, a.batch, workers, a.seconds)
            per = rate / max(workers, 1)
            rows.append(("memmap shards", f"{workers} worker(s)", rate, per))
        words = ("the of and to in a is that for it as was with be by on not he this are or his from at which "
                 "Grüße мир 世界").split()
        lines = []
        size = 0
        while size < a.jsonl_mb * 2**20:
            text = " ".join(rng.choice(words, int(rng.integers(200, 2000))))
            line = json.dumps({"text": text}, ensure_ascii=False)
            lines.append(line)
            size += len(line.encode())
        (tmp / "raw.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        toks = [("byte", "")] + ([("hf", a.tokenizer_path)] if a.tokenizer_path else [])
        for name, path in toks:
            for workers in [max(int(x), 1) for x in a.workers.split(",")][-2:]:
                t0 = time.perf_counter()
                counts = prepare(str(tmp / "raw.jsonl"), tmp / f"out_{name}_{workers}", TokenizerArgs(name, path),
                                 workers=workers)
                rate = counts["train"]["tokens"] / (time.perf_counter() - t0)
                rows.append((f"jsonl, {name} tokenizer", f"{workers} worker(s)", rate, rate / workers))
        print(f"\nseq_len {a.seq_len}, batch {a.batch}, {a.tokens / 1e6:,.0f} M shard tokens, {a.jsonl_mb} MB jsonl")
        print(f"{'source':<26}{'workers':<14}{'M tokens/s':>12}{'M tokens/s/worker':>20}")
        for src, wk, rate, per in rows:
            print(f"{src:<26}{wk:<14}{rate / 1e6:>12.2f}{per / 1e6:>20.2f}")
        ok = all(per >= TARGET for src, _, _, per in rows if src.startswith("memmap"))
        print(f"memmap >= {TARGET / 1e6:.0f} M tokens/s per worker: {'yes' if ok else 'NO'}")
        return 0 if ok else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
