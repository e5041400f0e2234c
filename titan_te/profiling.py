"""Profiling: torch.profiler traces of chosen steps, CUDA memory snapshots on request and on OOM.

Traces go to `<run>/<profiling.traces_folder>/step-<N>/rank<R>.json` (open them in Perfetto or
chrome://tracing); memory snapshots to `<run>/<profiling.memory_snapshot_folder>/` as pickles for
https://pytorch.org/memory_viz.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import warnings
from pathlib import Path

import torch

from titan_te.run_folder import make_folder, why

logger = logging.getLogger("titan_te")


def traced_steps(skip_first: int, active: int):
    """torch.profiler's schedule that skips `skip_first` steps and traces the next `active`, once."""
    with warnings.catch_warnings():  # "won't be using warmup": the traced steps are the chosen ones, as set
        warnings.simplefilter("ignore")
        return torch.profiler.schedule(skip_first=skip_first, wait=0, warmup=0, active=active, repeat=1)


def step_profiler(activities, schedule, on_trace_ready, **kw):
    """torch.profiler.profile over one traced window (a `traced_steps` schedule). acc_events: a schedule of one
    cycle has nothing to clear, and torch 2.11 warns on every trace that events are cleared between cycles."""
    return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_trace_ready,
                                  acc_events=True, **kw)


class Profiler:
    def __init__(self, pcfg, run_folder: Path, device: torch.device, rank: int):
        self.cfg, self.device, self.rank = pcfg, device, rank
        self.trace_folder = run_folder / pcfg.traces_folder
        self.snapshot_folder = run_folder / pcfg.memory_snapshot_folder
        self._prof = None
        self._recording = False
        if pcfg.enable_profiling:
            make_folder(self.trace_folder, "profiling.traces_folder", "choose another --profiling.traces_folder")
        if pcfg.enable_memory_snapshot and device.type == "cuda":
            make_folder(self.snapshot_folder, "profiling.memory_snapshot_folder",
                        "choose another --profiling.memory_snapshot_folder")
            # Records every allocation from now on, so a snapshot (on request or at an OOM) shows
            # who holds the memory.
            torch.cuda.memory._record_memory_history(max_entries=pcfg.memory_history_entries)
            self._recording = True
        elif pcfg.enable_memory_snapshot:
            logger.warning("profiling.enable_memory_snapshot: CUDA memory snapshots need a GPU; none are written")

    @contextlib.contextmanager
    def loop(self, first_step: int):
        """Around a training loop starting at `first_step`: traces the steps profile_start ..
        profile_start + profile_active - 1 that it runs (torch.profiler's schedule; `step_end` advances it)."""
        last = self.cfg.profile_start + self.cfg.profile_active - 1
        if not self.cfg.enable_profiling or last < first_step:
            yield self
            return
        start = max(self.cfg.profile_start, first_step)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = traced_steps(skip_first=start - first_step, active=last - start + 1)
        self._prof = step_profiler(activities, schedule, lambda p: self._write(p, start, last), record_shapes=True)
        try:
            with self._prof:
                yield self
        finally:
            self._prof = None

    def _write(self, prof, first: int, last: int) -> None:
        path = self.trace_folder / f"step-{first}" / f"rank{self.rank}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
            logger.info(f"profiling: trace of steps {first}-{last} written to {path}")
        except OSError as e:  # the disk filled up since the start: a trace is not worth the run
            logger.error(f"profiling: the trace of steps {first}-{last} cannot be written to {path} ({why(e)}); "
                         f"training goes on")

    def step_end(self, step: int) -> None:
        if self._prof is not None:
            self._prof.step()
        if self._recording and step in self.cfg.memory_snapshot_steps:
            self.snapshot(f"step-{step}")

    def snapshot(self, name: str) -> Path | None:
        """Write the CUDA memory snapshot (when recording); returns its path."""
        if not self._recording:
            return None
        path = self.snapshot_folder / f"{name}-rank{self.rank}.pickle"
        try:
            self.snapshot_folder.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
        except OSError as e:
            logger.error(f"profiling: the memory snapshot cannot be written to {path} ({why(e)})")
            return None
        logger.info(f"profiling: memory snapshot written to {path} (view it at https://pytorch.org/memory_viz)")
        return path

    def close(self) -> None:
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False
