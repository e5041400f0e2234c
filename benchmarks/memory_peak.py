"""What held the memory at a run's peak, from a CUDA memory snapshot (`--profiling.enable_memory_snapshot=true`
writes them under the run folder; torch's `torch.cuda.memory._dump_snapshot` format).

    python benchmarks/memory_peak.py RUN/memory_snapshot/step-3-rank0.pickle [--top 15]

The snapshot's trace (allocations and frees since recording began) is replayed to find the moment the most
memory was allocated; the allocations alive then are summed by where they were made: the innermost frame in
titan_te (else the innermost frame at all). What was allocated before recording began (weights, optimizer state)
is one row: what the snapshot's segments hold at its end, less what the trace allocated and did not free. Sizes
are the allocator's (rounded up to its blocks), as torch.cuda.max_memory_allocated counts them. For the planner's
estimates (`python -m titan_te.plan`), whose terms the rows can be set against.
"""
from __future__ import annotations

import argparse
import pickle
import sys
from collections import defaultdict

GiB = 2**30
OURS = "titan_te"


def _where(frames: list[dict]) -> str:
    """The innermost frame of ours that made an allocation, else the innermost frame."""
    for f in frames:
        if OURS in f.get("filename", ""):
            return f"{f['filename'].split(OURS, 1)[-1].lstrip('/')}:{f['line']} {f['name']}"
    return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "(no stack)"


def peak(snapshot: dict, device: int = 0) -> dict:
    """{"peak": bytes, "before": bytes at the peak that were allocated before the trace began, "rows": [(bytes,
    where)] of the trace's allocations alive at the peak}."""
    events = snapshot["device_traces"][device]
    held_at_end = sum(b["size"] for seg in snapshot["segments"] if seg.get("device", device) == device
                      for b in seg["blocks"] if b["state"] == "active_allocated")
    # alive when recording began: what the segments hold at the end, less the trace's allocations, plus its frees
    before = held_at_end - sum(e["size"] for e in events if e["action"] == "alloc") + sum(
        e["size"] for e in events if e["action"] == "free_completed")
    # the peak's moment first, then a replay up to it for what was alive (no copy of the live set at each new top)
    current = top = before
    top_at = -1
    for i, e in enumerate(events):
        if e["action"] in ("alloc", "free_completed"):
            current += e["size"] if e["action"] == "alloc" else -e["size"]
            if current > top:
                top, top_at = current, i
    live: dict[int, tuple[int, str]] = {}
    top_before = before
    for e in events[:top_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
        elif e["action"] == "free_completed":
            if e["addr"] in live:
                live.pop(e["addr"])
            else:  # made before recording began
                top_before -= e["size"]
    rows = defaultdict(int)
    for size, where in live.values():
        rows[where] += size
    return {"peak": top, "before": top_before,
            "rows": sorted(((b, w) for w, b in rows.items()), reverse=True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--device", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        with open(a.snapshot, "rb") as f:
            snap = pickle.load(f)
        found = peak(snap, a.device)
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, IndexError, TypeError) as e:
        print(f"memory_peak: {a.snapshot}: not a CUDA memory snapshot with a trace for device {a.device} "
              f"({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    print(f"peak {found['peak'] / GiB:.2f} GiB allocated; {found['before'] / GiB:.2f} GiB of it from before recording")
    print("| GiB | allocated at |\n| ---: | --- |")
    for size, where in found["rows"][:a.top]:
        print(f"| {size / GiB:.3f} | {where} |")
    rest = sum(size for size, _ in found["rows"][a.top:])
    if rest:
        print(f"| {rest / GiB:.3f} | {len(found['rows']) - a.top} more places |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
