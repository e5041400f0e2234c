"""DCP checkpoints: sync or async saves, atomic visibility, retention, resume.

Layout: `<folder>/step-<N>/` (a DCP folder). A save is written to `step-<N>.tmp/` and renamed by
rank 0 once every rank's data and the metadata are on disk, so a folder named `step-<N>` is always
complete; a `.tmp` folder (an interrupted save, even after kill -9) is never loaded.

Saved parts: model, optimizer, lr_scheduler, train_state (step, tokens, data-parallel size),
dataloader and rng (one entry per rank), and TE's FP8 recipe state. TE's `_extra_state` differs in
size across ranks, so it is taken out of the sharded model state and saved once (from rank 0); the
amax reduction keeps the ranks' scales equal, so every rank can load that copy.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import re
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

logger = logging.getLogger("titan_te")
# DCP reports a failure on any rank as CheckpointException, which derives from BaseException.
SAVE_ERRORS = (Exception, CheckpointException)
STEP_DIR = re.compile(r"^step-(\d+)$")
EXTRA_STATE = "_extra_state"
TE_UNSAFE_PICKLE = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read; the message says what to do."""


def describe(err: BaseException) -> str:
    """One line for an error; DCP's CheckpointException is reduced to its first rank's cause."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, wrapped = sorted(err.failures.items())[0]
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {describe(cause)}"
    text = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# ----------------------------------------------------------------------------------------------
# Finding checkpoints
# ----------------------------------------------------------------------------------------------
def complete_steps(folder: Path) -> list[int]:
    """Steps of the complete checkpoints in `folder`, ascending."""
    if not folder.is_dir():
        return []
    steps = []
    for child in folder.iterdir():
        m = STEP_DIR.match(child.name)
        if m and (child / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


# ----------------------------------------------------------------------------------------------
# State of each part
# ----------------------------------------------------------------------------------------------
def _split_extra_state(sd: dict) -> tuple[dict, dict]:
    params = {k: v for k, v in sd.items() if not k.endswith(EXTRA_STATE)}
    extra = {k: v for k, v in sd.items() if k.endswith(EXTRA_STATE)}
    return params, extra


def model_state(model) -> tuple[dict, dict]:
    """(sharded parameter state, FP8 extra state) of the model."""
    return _split_extra_state(get_model_state_dict(model))


def load_model_state(model, params: dict, extra: dict | None) -> None:
    own = get_model_state_dict(model)
    missing = [k for k in own if not k.endswith(EXTRA_STATE) and k not in params]
    if missing:
        raise CheckpointError(f"checkpoint lacks model parameters {missing[:3]}... ({len(missing)} missing)")
    set_model_state_dict(model, params, options=StateDictOptions(strict=False))
    if extra:
        # TE serializes its delayed-scaling state (scales, amax history) as a pickle and refuses to load
        # one unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1. This copy was pickled by this framework into
        # the run's own checkpoint, like the rng and dataloader entries, so it is allowed for this call.
        with _env(TE_UNSAFE_PICKLE, "1"):
            model.load_state_dict({k: v for k, v in extra.items() if k in own}, strict=False)


@contextlib.contextmanager
def _env(key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _fresh_folder(path: Path) -> None:
    """An empty folder at `path` (what an earlier, interrupted save left there is removed)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------
# The manager
# ----------------------------------------------------------------------------------------------
class CheckpointManager:
    def __init__(self, ckcfg, run_folder: Path, model, optimizer, lr_scheduler, dataloader, train_state, env):
        self.cfg = ckcfg
        self.enabled = ckcfg.enable
        self.folder = Path(ckcfg.folder) if Path(ckcfg.folder).is_absolute() else run_folder / ckcfg.folder
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.dataloader, self.train_state, self.env = dataloader, train_state, env
        self.rank = env.rank
        self._pending: tuple[int, Path, Future] | None = None
        self._staging: Future | None = None
        self._deleter: threading.Thread | None = None
        self.last_blocked_s = 0.0  # how long the last save held training up (call + staging wait)
        self._save_started = 0.0
        self._completed: list[tuple[int, float, float]] = []  # (step, stall s, total s) of published saves
        self.pg = None
        self.ctl_pg = None
        self.stager = None
        if self.enabled and ckcfg.async_mode != "disabled":
            # Background saves talk on their own gloo group so they never queue behind NCCL work; the
            # main thread asks "is every rank's write done?" on a second one, since two threads must
            # never issue collectives on the same group at once.
            self.pg = dist.new_group(backend="gloo")
            self.ctl_pg = dist.new_group(backend="gloo")
        if self.enabled and ckcfg.async_mode != "disabled":
            # Both async modes stage (copy the state off the live tensors) in the background while the
            # next forward/backward runs; the optimizer step waits for it (wait_for_staging). The pinned
            # mode stages into reusable page-locked buffers with non-blocking device-to-host copies.
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pinned = ckcfg.async_mode == "async_with_pinned_mem" and torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                       use_async_staging=True, use_non_blocking_copy=pinned))
        if self.enabled:
            self._check_writable()

    # --- what is saved ---------------------------------------------------------------------------
    def _state_to_save(self, model_only: bool, export_dtype: torch.dtype | None) -> dict:
        params, extra = model_state(self.model)
        if model_only:
            if export_dtype is not None:
                params = {k: v.to(export_dtype) if torch.is_floating_point(v) else v for k, v in params.items()}
            return {"model": params}
        r = f"rank{self.rank}"
        state = {
            "model": params,
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "train_state": {**self.train_state.state_dict(), "dp_world": self.env.dp_world},
            "dataloader": {r: pickle.dumps(self.dataloader.state_dict())},
            "rng": {r: pickle.dumps(rng_state())},
        }
        if extra and self.rank == 0:
            state["fp8"] = pickle.dumps({k: v.cpu() if torch.is_tensor(v) else v for k, v in extra.items()})
        return state

    # --- saving ----------------------------------------------------------------------------------
    def should_save(self, step: int, last: bool) -> bool:
        return self.enabled and (last or step % self.cfg.interval == 0)

    def save(self, step: int, last: bool = False) -> None:
        """Save (or start saving) the state after `step`. Errors are reported, never fatal mid-run."""
        self.finish_pending(wait=True)  # one save in flight at a time
        t0 = self._save_started = time.perf_counter()
        tmp = self.folder / f"step-{step}.tmp"
        model_only = last and self.cfg.last_save_model_only
        published = False
        try:
            self._on_rank0(lambda: _fresh_folder(tmp))
            state = self._state_to_save(model_only, getattr(torch, self.cfg.export_dtype) if model_only else None)
            mode = "disabled" if last else self.cfg.async_mode
            if mode == "disabled":
                dcp.save(state, checkpoint_id=str(tmp))
                self._publish(step, tmp)
                published = True
            else:
                resp = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.pg,
                                      async_stager=self.stager)
                self._staging = resp.staging_completion
                self._pending = (step, tmp, resp.upload_completion)
        except SAVE_ERRORS as e:  # disk full, permissions, ...: keep training, keep the old checkpoints
            self._discard(tmp)
            self._report_failure(step, e, fatal=last)
        self.last_blocked_s = time.perf_counter() - t0
        if published and self.rank == 0:
            logger.info(f"checkpoint: saved step {step} to {step_dir(self.folder, step)} "
                        f"({self.last_blocked_s:.2f}s)")

    def _on_rank0(self, fn) -> None:
        """Run a file-system action on rank 0; every rank raises if it failed (no rank is left
        waiting in a collective for one that gave up)."""
        err = None
        if self.rank == 0:
            try:
                fn()
            except OSError as e:
                err = f"{type(e).__name__}: {e}"
        box = [err]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise OSError(box[0])

    def _check_writable(self) -> None:
        """Fail at startup, not at the first save hours later, when the folder cannot be written."""
        probe = self.folder / f".write-test-{os.getpid()}"

        def touch():
            self.folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()

        try:
            self._on_rank0(touch)
        except OSError as e:
            raise CheckpointError(f"checkpoint.folder {self.folder} cannot be written ({e}); point "
                                  f"--checkpoint.folder at a writable place or set --checkpoint.enable=false") \
                from None

    def wait_for_staging(self) -> float:
        """Before the optimizer changes the weights, the pinned-memory copy must be complete."""
        if self._staging is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            self._staging.result()
        finally:
            self._staging = None
        waited = time.perf_counter() - t0
        self.last_blocked_s += waited
        return waited

    def finish_pending(self, wait: bool = False) -> None:
        """Publish a finished background save (or wait for it when `wait`)."""
        if self._pending is None:
            return
        step, tmp, fut = self._pending
        if not wait:  # publish only when every rank's write is done: agree on it collectively
            done = torch.tensor([1 if fut.done() else 0])
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.ctl_pg)
            if not done.item():
                return
        self._pending = None
        self.wait_for_staging()
        try:
            fut.result()
        except SAVE_ERRORS as e:
            self._discard(tmp)
            self._report_failure(step, e, fatal=False)
            return
        dist.barrier(group=self.pg)  # every rank's data is on disk before rank 0 publishes
        self._publish(step, tmp)
        if self.rank == 0:
            logger.info(f"checkpoint: saved step {step} to {step_dir(self.folder, step)} (background)")

    def pop_completed(self) -> list[tuple[int, float, float]]:
        """(step, seconds training stalled, seconds until on disk) of saves published since the last call."""
        done, self._completed = self._completed, []
        return done

    def _publish(self, step: int, tmp: Path) -> None:
        self._completed.append((step, self.last_blocked_s, time.perf_counter() - self._save_started))
        if self.rank == 0:
            final = step_dir(self.folder, step)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._prune()
        dist.barrier(group=self.pg)

    def _discard(self, tmp: Path) -> None:
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _report_failure(self, step: int, err: Exception, fatal: bool) -> None:
        good = complete_steps(self.folder)
        keep = f"the newest good checkpoint is {step_dir(self.folder, good[-1])}" if good else \
            "no earlier checkpoint exists"
        msg = f"checkpoint save at step {step} into {self.folder} failed ({describe(err)}); {keep}"
        if fatal:
            raise CheckpointError(msg) from err
        logger.error(msg + "; training continues")

    def _prune(self) -> None:
        """Delete all but the newest keep_latest_k complete checkpoints, in the background."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        old = [step_dir(self.folder, s) for s in complete_steps(self.folder)[:-k]]
        if not old:
            return
        if self._deleter is not None:
            self._deleter.join()
        self._deleter = threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in old],
                                         daemon=True)
        self._deleter.start()

    def close(self) -> None:
        self.finish_pending(wait=True)
        if self._deleter is not None:
            self._deleter.join()
        if self.stager is not None:
            self.stager.close()

    # --- loading ---------------------------------------------------------------------------------
    def load(self) -> int:
        """Resume from the chosen complete checkpoint; returns its step (0 when none is loaded)."""
        if not self.enabled:
            return 0
        steps = complete_steps(self.folder)
        if self.cfg.load_step > 0:
            if self.cfg.load_step not in steps:
                avail = ", ".join(map(str, steps)) or "none"
                raise CheckpointError(f"checkpoint.load_step = {self.cfg.load_step}: no complete checkpoint "
                                      f"{step_dir(self.folder, self.cfg.load_step)} (complete steps: {avail})")
            step = self.cfg.load_step
        elif steps:
            step = steps[-1]
        else:
            return 0
        path = step_dir(self.folder, step)
        try:
            self._load_from(path)
        except CheckpointError:
            raise
        except SAVE_ERRORS as e:
            older = [s for s in steps if s < step]
            hint = (f"the newest older checkpoint is {step_dir(self.folder, older[-1])}; resume from it with "
                    f"--checkpoint.load_step={older[-1]}") if older else "no older checkpoint exists"
            raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({describe(e)}); {hint}") from None
        if self.rank == 0:
            logger.info(f"checkpoint: resumed from {path} (step {step})")
        return step

    def _load_from(self, path: Path) -> None:
        exclude = set(self.cfg.exclude_from_loading)
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        saved = {k.split(".", 1)[0] for k in meta.state_dict_metadata}
        model_only = saved <= {"model"}
        r = f"rank{self.rank}"
        params, extra = model_state(self.model)
        target: dict = {}
        if "model" not in exclude:
            target["model"] = params
        if not model_only:
            ts = {**self.train_state.state_dict(), "dp_world": 0}
            target["train_state"] = ts
            if "optimizer" not in exclude:
                target["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
            if "lr_scheduler" not in exclude:
                target["lr_scheduler"] = self.lr_scheduler.state_dict()
            if "fp8" in saved and extra:
                target["fp8"] = b""
        dcp.load(target, checkpoint_id=str(path))
        per_rank = {}
        if not model_only:
            saved_world = int(target["train_state"]["dp_world"])
            wanted = [p for p in ("dataloader", "rng") if p not in exclude]
            if wanted and saved_world != self.env.dp_world and "dataloader" in wanted:
                raise CheckpointError(
                    f"checkpoint {path} was written by {saved_world} data-parallel ranks, this run has "
                    f"{self.env.dp_world}: the data loader's position cannot be resharded. Resume with "
                    f"--checkpoint.exclude_from_loading=dataloader,rng (model and optimizer reshard exactly; "
                    f"the data order restarts)")
            if wanted and saved_world == self.env.dp_world:
                per_rank = {p: {r: b""} for p in wanted}
                dcp.load(per_rank, checkpoint_id=str(path))
        # Apply only after everything was read, so a bad checkpoint leaves the run untouched.
        if "model" in target:
            fp8 = pickle.loads(target["fp8"]) if target.get("fp8") else None
            load_model_state(self.model, target["model"], fp8)
        if "optimizer" in target:
            set_optimizer_state_dict(self.model, self.optimizer, target["optimizer"])
        if "lr_scheduler" in target:
            self.lr_scheduler.load_state_dict(target["lr_scheduler"])
        if "train_state" in target and "train_state" not in exclude:
            self.train_state.load_state_dict(target["train_state"])
        if "dataloader" in per_rank:
            self.dataloader.load_state_dict(pickle.loads(per_rank["dataloader"][r]))
        if "rng" in per_rank:
            set_rng_state(pickle.loads(per_rank["rng"][r]))
