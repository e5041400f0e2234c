"""The benchmarks' timer: milliseconds of the GPU work a call queues, between two CUDA events."""
from __future__ import annotations

import statistics

import torch


def median_ms(fn, reps: int, warmup: int = 0) -> float:
    """Median milliseconds of fn() over `reps` calls, each between two CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
