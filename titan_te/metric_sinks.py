"""Where logged values go: TensorBoard event files and a JSON Lines file, each a `Sink`.

A sink takes `write(values, step)` and `close()`. A disk that stops taking its writes (full, gone)
ends that sink with one warning, never the run: the console and the other sinks keep every step. A
resumed run continues the same step axis: what a crashed run logged after its checkpoint is dropped.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Protocol

from titan_te.errors import ConfigError, quiet_thread_failures
from titan_te.run_folder import make_folder, why

logger = logging.getLogger("titan_te")
# TensorBoard's writer thread raises on a full disk; the next write or flush in the training thread raises
# too, and the sink ends with one warning
quiet_thread_failures(lambda thread, err: isinstance(err, OSError) and type(thread).__name__ == "_AsyncWriterThread")


class Sink(Protocol):
    name: str
    alive: bool

    def hint(self) -> str: ...  # how to look at what it wrote (the run's last line)

    def write(self, values: dict, step: int) -> None: ...

    def close(self) -> None: ...


class _Guarded:
    """write / close through `_write` / `_close`; the first OSError ends the sink with one warning."""

    name = ""
    where: Path

    def __init__(self):
        self.alive = True

    def write(self, values: dict, step: int) -> None:
        if self.alive:
            try:
                self._write(values, step)
            except OSError as e:
                self._give_up(e)

    def close(self) -> None:
        if self.alive:
            self.alive = False
            try:
                self._close()
            except OSError:
                pass

    def _give_up(self, e: OSError) -> None:
        logger.warning(f"{self.name} cannot be written to {self.where} any more ({why(e)}); the console and the run's "
                       f"log keep every step")
        self.close()

    def _write(self, values: dict, step: int) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


FIX = "free space there, choose another --job.dump_folder or set --metrics.{} = false"


class TensorBoardSink(_Guarded):
    name = "TensorBoard events"

    def __init__(self, folder: Path, start_step: int):
        super().__init__()
        from torch.utils.tensorboard import SummaryWriter

        self.where = folder
        make_folder(folder, "the TensorBoard folder", FIX.format("enable_tensorboard"))
        # TensorBoard drops the events at or past purge_step that a crashed run had written
        try:
            self.writer = SummaryWriter(log_dir=str(folder), purge_step=start_step + 1 if start_step else None)
        except OSError as e:
            raise ConfigError(f"TensorBoard events cannot be written in {folder} ({why(e)}); "
                              f"{FIX.format('enable_tensorboard')}") from None

    def hint(self) -> str:
        return f"TensorBoard: tensorboard --logdir {self.where}"

    def _write(self, values: dict, step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def _close(self) -> None:
        self.writer.close()


class JsonlSink(_Guarded):
    """`<run>/metrics.jsonl`: one JSON object per write, `{"step": N, "time": unix seconds, tag: value, ...}`,
    each line on disk as soon as it is written."""

    name = "The metrics file"

    def __init__(self, path: Path, start_step: int):
        super().__init__()
        self.where = path
        make_folder(path.parent, "the run folder", FIX.format("enable_jsonl"))
        try:
            if start_step and path.is_file():  # keep what the checkpoint's steps logged, nothing after
                kept = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
                        if _step_of(line) is not None and _step_of(line) <= start_step]
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
                os.replace(tmp, path)
            self.file = open(path, "a" if start_step else "w", encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"the metrics file {path} cannot be written ({why(e)}); {FIX.format('enable_jsonl')}") \
                from None

    def hint(self) -> str:
        return f"metrics: {self.where}"

    def _write(self, values: dict, step: int) -> None:
        self.file.write(json.dumps({"step": step, "time": round(time.time(), 3), **values}) + "\n")
        self.file.flush()

    def _close(self) -> None:
        self.file.close()


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def sinks_for(mcfg, run_folder: Path, rank: int, start_step: int) -> list[Sink]:
    """The sinks this rank writes: rank 0, or every rank with metrics.rank_0_only = false."""
    if rank != 0 and mcfg.rank_0_only:
        return []
    own = "" if mcfg.rank_0_only else f"rank_{rank}"
    out: list[Sink] = []
    if mcfg.enable_tensorboard:
        out.append(TensorBoardSink(run_folder / "tb" / own, start_step))
    if mcfg.enable_jsonl:
        out.append(JsonlSink(run_folder / f"metrics{'_' + own if own else ''}.jsonl", start_step))
    return out
