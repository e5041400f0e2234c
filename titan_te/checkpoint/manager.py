"""CheckpointManager: resume at start, one call per training step, saves that never lose a checkpoint.

- `resume()` picks the checkpoint (the newest complete one, or `checkpoint.load_step`), checks that it
  fits this run, loads every part not in `exclude_from_loading` and adopts its lineage. A resume that
  would make later saves replace newer checkpoints is refused unless `checkpoint.replace_newer`.
- `step_end(step, stop)` publishes a finished background save and starts the save that is due.
- its optimizer pre-hook (`before_optimizer_step`) waits until a background save has copied the
  weights the step is about to change; `close()` waits for the save in flight.
File-system actions run on rank 0 and their outcome is broadcast, so every rank takes the same path.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from titan_te.checkpoint import folder as fs
from titan_te.checkpoint import integrity, space
from titan_te.checkpoint.background import BackgroundSave, Stager, write
from titan_te.checkpoint.compat import fact_differences, flat_tensors, missing_keys, tensor_differences
from titan_te.checkpoint.errors import (causes, describe, environmental_cause, is_environmental,
                                       is_unreadable_data, write_failed)
from titan_te.checkpoint.parts import Part
from titan_te.errors import CheckpointError
from titan_te.parallel.dist import on_rank0
from titan_te.run_folder import FolderLock

logger = logging.getLogger("titan_te")


@dataclass
class SaveRecord:
    step: int
    stall_s: float  # how long training waited for this save
    total_s: float  # from the save call until the checkpoint was published


class CheckpointManager:
    def __init__(self, ckcfg, folder: Path, parts: dict[str, Part], env, facts: dict, total_steps: int,
                 run_folder: Path | None = None, optimizer=None, before_save=None, on_saved=None):
        """`optimizer`: its steps wait for a background save's copy of the weights (a pre-hook this manager
        registers); `before_save()` runs right before a save starts (the trainer logs the step first);
        `on_saved(record)` for every save published."""
        self.cfg, self.enabled = ckcfg, ckcfg.enable
        self.before_save, self.on_saved = before_save or (lambda: None), on_saved or (lambda record: None)
        self.run_folder = str(Path(run_folder).resolve()) if run_folder else ""
        self.folder = Path(folder)
        self.parts, self.env, self.facts = parts, env, facts
        self.rank, self.total_steps = env.rank, total_steps
        self.lineage = ""
        self.retention = fs.Retention(self.folder, ckcfg.keep_latest_k)
        self._inflight: tuple[int, BackgroundSave, float] | None = None
        self._completed: list[SaveRecord] = []
        self._last_saved = -1
        self.failures_in_a_row = 0
        self.last_blocked_s = 0.0
        self.pg = self.ctl_pg = self.stager = self._lock = self._hook = None
        self.resumed_from: fs.Manifest | None = None  # the manifest of the checkpoint this run resumed
        self.one_save_bytes = 0.0  # the size of one save, from check_space()
        if not self.enabled:
            return
        # Background writes talk on their own gloo group so they never queue behind NCCL work; the
        # main thread's control messages use a second one: two threads never share a group.
        self.pg = dist.new_group(backend="gloo")
        self.ctl_pg = dist.new_group(backend="gloo")
        if ckcfg.async_mode != "disabled":
            self.stager = Stager(env.device, pinned=ckcfg.async_mode == "async_with_pinned_mem")
        self._prepare_folder()
        if optimizer is not None:
            self._hook = optimizer.register_step_pre_hook(self.before_optimizer_step)

    def _on_rank0(self, fn):
        return on_rank0(fn, group=self.ctl_pg)

    def _prepare_folder(self) -> None:
        """Lock the folder (another run may name it too: one writer at a time), exit 3 at start rather than
        at the first save hours later if it cannot be written, and delete what interrupted saves left."""
        self._lock = FolderLock(self.folder, "checkpoint.folder", "point --checkpoint.folder at another place or "
                                "set --checkpoint.enable=false", holder=f"run folder {self.run_folder}",
                                error=CheckpointError)
        self._on_rank0(self._lock.acquire)
        try:
            removed = self._on_rank0(lambda: fs.remove_interrupted_saves(self.folder))
        except OSError as e:
            raise CheckpointError(f"checkpoint.folder {self.folder}: cannot remove what an interrupted save left "
                                  f"({describe(e)})") from None
        for name, size in removed:
            logger.warning(f"checkpoint: removed {self.folder / name} ({size / 1e9:.1f} GB) left by an "
                           f"interrupted save")

    def release(self) -> None:
        """Let another run write into the folder (the kernel also drops the lock when the process dies)."""
        if self._lock is not None:
            self._lock.release()

    # --- resuming ------------------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the chosen checkpoint and check that this run's saves fit their disk; returns the step
        training continues after (0: from scratch)."""
        step = self._resume()
        self.check_space(self.parts["train_state"].train_state.step if "train_state" in self.parts else step)
        return step

    def _say_what_is_not_loaded(self) -> None:
        """Checkpointing off over a folder of checkpoints (a rerun without --checkpoint.enable=true): one warning
        before the run starts again at step 1, not a silent restart."""
        steps = fs.complete_steps(self.folder) if self.rank == 0 else []  # (an unreadable folder: none)
        if steps:
            logger.warning(f"checkpoint.enable = false: this run does not resume from the checkpoints in "
                           f"{self.folder} (newest: step {steps[-1]}) and starts at step 1; set "
                           f"--checkpoint.enable=true to resume")

    def _resume(self) -> int:
        if not self.enabled:
            self._say_what_is_not_loaded()
            return 0
        plan = self._on_rank0(self._plan)
        for line in plan["warnings"]:
            logger.warning(line)
        if plan["error"]:
            raise CheckpointError(plan["error"])
        self.lineage = plan["lineage"]
        step = plan["load"]
        if step is None:
            return 0
        path = fs.step_dir(self.folder, step)
        if plan["finished"]:
            self.parts["train_state"].train_state.step = step
            logger.info(f"checkpoint: {path} is the final, model-only save of this run; nothing left to train")
            return step
        self._load(path, plan)
        self.retention.protected.add(step)
        if plan["set_aside"]:
            dest = self._on_rank0(lambda: str(fs.set_aside(
                self.folder, plan["set_aside"], f"checkpoint.replace_newer: this run resumed from step {step}")))
            logger.warning(f"checkpoint: moved {', '.join(f'step-{s}' for s in plan['set_aside'])} to {dest} "
                           f"(checkpoint.replace_newer = true); nothing was deleted")
        if self.rank == 0:
            logger.info(f"checkpoint: resumed from {path} (step {step})")
        return step if plan["restores_step"] else 0

    def check_space(self, start_step: int) -> None:
        """Say what one save of this run takes and what the folder has free; refuse (exit 3) before training
        when one save does not fit, warn when the saves kept (keep_latest_k, or all) do not."""
        if not self.enabled:
            return
        mine = torch.tensor([sum(p.size_bytes() for n, p in self._saved_parts()), 0], dtype=torch.float64)
        mine[1] = mine[0]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(mine[:1], group=self.ctl_pg)
            dist.all_reduce(mine[1:], op=dist.ReduceOp.MAX, group=self.ctl_pg)
        one, per_rank = float(mine[0]), float(mine[1])
        self.one_save_bytes = one
        free = self._on_rank0(lambda: shutil.disk_usage(self.folder).free)
        left = space.saves_left(start_step, self.total_steps, self.cfg.interval)
        kept = min(self.cfg.keep_latest_k, left) if self.cfg.keep_latest_k else left
        ranks = f", {space.human(per_rank)} on the largest of {self.env.world_size} ranks" if self.env.world_size > 1 else ""
        if self.rank == 0:
            logger.info(f"checkpoint: one save of this run is {space.human(one)}{ranks}; it keeps "
                        f"{'the newest ' + str(self.cfg.keep_latest_k) if self.cfg.keep_latest_k else 'all ' + str(left)}"
                        f" ({space.human(kept * one)}); {self.folder} has {space.human(free)} free")
        if one > free and left and not self.cfg.skip_space_check:
            raise CheckpointError(f"checkpoint.folder {self.folder} has {space.human(free)} free, one checkpoint of "
                                  f"this run needs {space.human(one)}; free space, point --checkpoint.folder at a "
                                  f"larger disk, or train on anyway with --checkpoint.skip_space_check=true (saves "
                                  f"then fail, --checkpoint.max_consecutive_failures of them in a row)")
        if kept * one > free and self.rank == 0:
            logger.warning(f"checkpoint: {kept} saves of {space.human(one)} do not fit the {space.human(free)} free in "
                           f"{self.folder}: later saves will fail (training goes on past "
                           f"{self.cfg.max_consecutive_failures} failures in a row, the final save must succeed); "
                           f"lower checkpoint.keep_latest_k or free space")

    def _plan(self) -> dict:
        """Rank 0: which checkpoint to load and whether that is safe for the newer ones."""
        found, others = fs.scan(self.folder)
        warnings = [f"checkpoint: ignoring {p}: not a complete titan_te checkpoint ({lacks})" for p, lacks in others]
        plan = {"load": None, "lineage": fs.new_lineage(), "error": None, "warnings": warnings,
                "set_aside": [], "finished": False, "restores_step": False}
        want = self.cfg.load_step
        if want > 0 and want not in found:
            plan["error"] = (f"checkpoint.load_step = {want}: no complete checkpoint {fs.step_dir(self.folder, want)}"
                             f" (complete steps: {', '.join(map(str, found)) or 'none'})")
            return plan
        step = fs.resume_step(found, want)
        if step is None:
            return plan
        m = found[step]
        refused = fs.too_new(m, fs.step_dir(self.folder, step)) or self._other_run(m)
        if refused:
            plan["error"] = refused
            return plan
        plan["load"] = step
        if m.model_only:
            full = [s for s, x in found.items() if not x.model_only]
            if self.total_steps <= m.step:
                plan.update(finished=True, lineage=m.lineage)
                return plan
            hint = (f"resume from the newest full one with --checkpoint.load_step={full[-1]} "
                    f"--checkpoint.replace_newer=true" if full else "no full checkpoint of this run exists")
            plan["error"] = (f"{fs.step_dir(self.folder, step)} holds only model weights "
                             f"(checkpoint.last_save_model_only), so training.steps = {self.total_steps} cannot "
                             f"continue from it; {hint}, or start a new run with another --job.name")
            return plan
        restores = "train_state" not in self.cfg.exclude_from_loading
        start = step if restores else 0
        newer = [s for s in found if s > start]
        if newer and not self.cfg.replace_newer:
            names = ", ".join(f"step-{s}" for s in newer)
            why = (f"it resumes from step-{step} with training.steps counting from {start}" if restores else
                   "checkpoint.exclude_from_loading has train_state, so this run counts its steps from 1 again")
            plan["error"] = (f"{self.folder} holds {names}, which later saves of this run would replace: {why}. "
                             f"To keep them use another --job.name or --checkpoint.folder (or drop the option "
                             f"that causes this); to train on anyway add --checkpoint.replace_newer=true, which "
                             f"moves them to {self.folder}/superseded-<time>/ (nothing is deleted)")
            return plan
        plan.update(set_aside=newer, restores_step=restores, lineage=m.lineage if restores else plan["lineage"])
        return plan

    def _other_run(self, m: fs.Manifest) -> str:
        """Why resuming `m` would take over another run's checkpoints ("" when it is this run's own): a
        checkpoint.folder outside the run folder, whose checkpoint another run folder wrote."""
        here = Path(self.run_folder)
        if not self.run_folder or not m.run_folder or self.cfg.resume_other_run or \
                self.folder.resolve().is_relative_to(here) or Path(m.run_folder) == here:
            return ""
        return (f"checkpoint.folder {self.folder} holds the checkpoints of another run (step-{m.step}, written by run "
                f"folder {m.run_folder}); resuming it here would continue that run and let this run's saves and "
                f"keep_latest_k replace and delete its checkpoints. Give this run a checkpoint.folder of its own, or "
                f"continue that run here on purpose with --checkpoint.resume_other_run=true")

    def _load(self, path: Path, plan: dict) -> None:
        exclude = set(self.cfg.exclude_from_loading)
        manifest = fs.Manifest.read(path)
        self.resumed_from = manifest
        recorded = manifest.files if manifest is not None and self.cfg.verify_checksums else {}
        with self._unreadable_data(path):  # the small .metadata first: a mismatch is told before the data is read
            integrity.verify(path, recorded, self.ctl_pg, only=integrity.METADATA)
            meta = dcp.FileSystemReader(str(path)).read_metadata()
        saved_parts = set(manifest.parts if manifest else ())
        wanted = {n: p for n, p in self.parts.items() if n not in exclude and n in saved_parts}
        same_world = manifest is not None and manifest.dp_world == self.env.dp_world
        if not same_world and "dataloader" in wanted and wanted["dataloader"].resharding == "per_rank":
            raise CheckpointError(
                f"checkpoint {path} was written by {manifest.dp_world} data-parallel ranks, this run has "
                f"{self.env.dp_world}: a streamed dataset's position (data.dataset = 'hf') cannot be resharded. "
                f"Resume on {manifest.dp_world} ranks, or with --checkpoint.exclude_from_loading=dataloader (model "
                f"and optimizer reshard exactly; the stream's order starts afresh)")
        if not same_world:
            dropped = sorted(n for n, p in wanted.items() if p.resharding == "per_rank")
            if dropped and self.rank == 0:
                logger.info(f"checkpoint: written by {manifest.dp_world} data-parallel ranks, resumed on "
                            f"{self.env.dp_world}: the model, optimizer and data position reshard; the per-rank "
                            f"{', '.join(dropped)} state starts from the seed")
            wanted = {n: p for n, p in wanted.items() if p.resharding != "per_rank"}
        target = {n: p.load_target() for n, p in wanted.items()}
        old_loader = "dataloader" in target and missing_keys(meta, "dataloader", target["dataloader"])
        if old_loader:  # a per-rank loader state of an older titan_te: the data order starts afresh
            logger.warning(f"checkpoint: {path} holds the data loader's position in an older layout; the data "
                           f"order starts afresh (model, optimizer and step counters resume)")
            wanted.pop("dataloader")
            target.pop("dataloader")
        problems = fact_differences(manifest.facts if manifest else {}, self._compared_facts(), set(wanted))
        problems += [f"the checkpoint lacks {', '.join(keys[:3])} (written by another titan_te version?)"
                     for name in target if name not in ("model", "optimizer")
                     for keys in [missing_keys(meta, name, target[name])] if keys]
        for name in ("model", "optimizer"):
            if name in target:
                problems += tensor_differences(meta, flat_tensors(name, target[name]), name,
                                               strict_unexpected=name == "model")
        if problems:
            raise CheckpointError(self._mismatch(path, problems, set(wanted)))
        with self._unreadable_data(path):
            integrity.verify(path, recorded, self.ctl_pg)
            dcp.load(target, checkpoint_id=str(path))
        # Applied only after everything was read, so a bad checkpoint leaves the run untouched.
        for name, part in wanted.items():
            part.load_state_dict(target[name])

    @contextlib.contextmanager
    def _unreadable_data(self, path: Path):
        """Damaged or missing data (what reading it raises: I/O, unpickling, a checksum) -> exit 3, naming the
        file and the newest older checkpoint; anything else raised on the way is a bug and keeps its traceback."""
        try:
            yield
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            if not is_unreadable_data(e):
                raise
            raise CheckpointError(self._unreadable(path, e)) from None

    def _compared_facts(self) -> dict:
        """The facts a checkpoint must match (the tokenizer's not, with checkpoint.allow_new_tokenizer)."""
        return {k: v for k, v in self.facts.items() if k != "tokenizer" or not self.cfg.allow_new_tokenizer}

    def _mismatch(self, path: Path, problems: list[str], parts: set[str]) -> str:
        ok_older = [s for s, m in fs.scan(self.folder)[0].items()
                    if s < int(path.name.split("-")[1]) and not fact_differences(m.facts, self._compared_facts(), parts)]
        opt = " --checkpoint.exclude_from_loading=optimizer starts the optimizer afresh;" \
            if any(p.startswith("optimizer") for p in problems) else ""
        if any(p.startswith("tokenizer.") for p in problems):
            opt += (" --checkpoint.allow_new_tokenizer=true continues with this run's tokenizer on purpose (the "
                    "trained embedding rows then stand for other tokens);")
        older = f" {fs.step_dir(self.folder, ok_older[-1])} matches this run (--checkpoint.load_step=" \
                f"{ok_older[-1]})." if ok_older else ""
        return (f"checkpoint {path} does not fit this run: {'; '.join(problems[:4])}. Change the run to match "
                f"the checkpoint, or start a new run with another --job.name;{opt}{older}").rstrip(";")

    def _unreadable(self, path: Path, err: BaseException) -> str:
        step = int(path.name.split("-")[1])
        older = [s for s, m in fs.scan(self.folder)[0].items()
                 if s < step and not fact_differences(m.facts, self._compared_facts(), {"model", "optimizer"})]
        hint = (f"the newest older checkpoint is {fs.step_dir(self.folder, older[-1])}; resume from it with "
                f"--checkpoint.load_step={older[-1]} --checkpoint.replace_newer=true") if older else \
            "no older checkpoint of this run exists"
        return f"checkpoint {path} is corrupt or unreadable ({describe(err)}); {hint}"

    # --- saving --------------------------------------------------------------------------------------
    def due(self, step: int, stop: bool = False) -> bool:
        """Whether step_end(step, stop) saves: every `interval` steps, the last step, a stop request."""
        return self.enabled and (step >= self.total_steps or stop or step % self.cfg.interval == 0)

    def step_end(self, step: int, stop: bool = False) -> list[SaveRecord]:
        """After each optimizer step: publish a finished background save, start the save that is due
        (every `interval` steps, the last step, or a stop request: those two synchronously). Returns the
        saves published since the last call."""
        if not self.enabled:
            return []
        self._finish(wait=False)
        last = step >= self.total_steps
        if self.due(step, stop):
            self.before_save()
            self.save(step, sync=last or stop or self.stager is None,
                      model_only=last and self.cfg.last_save_model_only)
        done, self._completed = self._completed, []
        return done

    def save(self, step: int, sync: bool = True, model_only: bool = False) -> None:
        self._finish(wait=True)  # one save in flight at a time
        if step == self._last_saved:
            return
        t0 = time.perf_counter()
        tmp = self.folder / f"step-{step}.tmp"
        try:
            self._on_rank0(lambda: _fresh_folder(tmp))
        except OSError as e:
            self._failed(step, tmp, e, final=step >= self.total_steps)
            return
        state = self._state(model_only)
        if sync:  # no background save is in flight: its gloo group is free
            try:
                files = write(state, tmp, self.pg, self.cfg.write_threads)
            except BaseException as e:  # DCP's CheckpointException derives from BaseException
                self.last_blocked_s = time.perf_counter() - t0
                self._failed(step, tmp, e, final=step >= self.total_steps)
                return
            self.last_blocked_s = time.perf_counter() - t0
            self._publish(step, tmp, model_only, t0, background=False, files=files)
        else:
            self._inflight = (step, BackgroundSave(self.stager, state, tmp, self.pg, self.cfg.write_threads), t0)
            self.last_blocked_s = time.perf_counter() - t0

    def _state(self, model_only: bool) -> dict:
        if model_only:
            return {"model": self.parts["model"].model_only_state()}
        # Replicated parts are the same everywhere: rank 0 writes them (TE's FP8 state even differs in
        # size between ranks), every rank loads them.
        return {n: p.state_dict() for n, p in self._saved_parts()}

    def _saved_parts(self):
        return [(n, p) for n, p in self.parts.items() if p.resharding != "replicated" or self.rank == 0]

    def before_optimizer_step(self, *_args) -> None:
        """Optimizer pre-hook: a background save must have copied the weights before they change."""
        if self._inflight is None:
            return
        t0 = time.perf_counter()
        self._inflight[1].staged.exception()  # waits; a failure is reported with the write's result
        self.last_blocked_s += time.perf_counter() - t0

    def _finish(self, wait: bool) -> None:
        """Publish the background save once it is written on every rank (or wait for it when `wait`)."""
        if self._inflight is None:
            return
        step, job, t0 = self._inflight
        if not wait:
            done = torch.tensor([1 if job.done() else 0])
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.ctl_pg)
            if not done.item():
                return
        self._inflight = None
        try:
            files = job.result()
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            self._failed(step, job.path, e, final=False)
            return
        self._publish(step, job.path, False, t0, background=True, files=files)

    def _publish(self, step: int, tmp: Path, model_only: bool, t0: float, background: bool, files: dict) -> None:
        manifest = fs.Manifest(step=step, lineage=self.lineage, parts=["model"] if model_only else list(self.parts),
                               dp_world=self.env.dp_world, facts=self.facts, model_only=model_only,
                               saved_at=time.time(), run_folder=self.run_folder, files=files)
        final = fs.step_dir(self.folder, step)

        def publish():
            manifest.write(tmp)
            fs.publish(tmp, final)
            return self.retention.prune(self.lineage, just_written=step), fs.folder_bytes(final)

        try:
            pruned, size = self._on_rank0(publish)
        except OSError as e:
            self._failed(step, tmp, e, final=step >= self.total_steps)
            return
        self._last_saved = step
        self.failures_in_a_row = 0
        record = SaveRecord(step, self.last_blocked_s, time.perf_counter() - t0)
        self._completed.append(record)
        self.on_saved(record)
        if self.rank == 0:
            how = " (background)" if background else ""
            logger.info(f"checkpoint: saved step {step} to {final} ({space.human(size)}) in "
                        f"{time.perf_counter() - t0:.2f}s, training "
                        f"waited {self.last_blocked_s:.2f}s{how}"
                        + (f"; removed old {', '.join(f'step-{s}' for s in pruned)}" if pruned else ""))

    def _failed(self, step: int, tmp: Path, err: BaseException, final: bool) -> None:
        """A save failed: a bug propagates; an environmental failure is survived a few times in a row."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if not is_environmental(err):
            raise err
        self.failures_in_a_row += 1
        good = fs.complete_steps(self.folder)
        keep = f"the newest good checkpoint is {fs.step_dir(self.folder, good[-1])}" if good else \
            "no earlier checkpoint exists"
        msg = f"checkpoint save at step {step} into {self.folder} failed ({self._why_failed(err)}); {keep}"
        limit = self.cfg.max_consecutive_failures
        if final or self.failures_in_a_row > limit:
            why = "the final save failed" if final else f"{self.failures_in_a_row} saves in a row failed"
            raise CheckpointError(f"{msg}; stopping: {why}") from None
        logger.error(f"{msg}; training continues ({self.failures_in_a_row} of at most {limit} failed saves "
                     f"in a row)")

    def _why_failed(self, err: BaseException) -> str:
        """describe(err), with the disk's state when only torch's zip writer saw the failed write."""
        if environmental_cause(err) is not None or not any(write_failed(e) for e in causes(err)):
            return describe(err)
        try:
            free = shutil.disk_usage(self.folder).free
        except OSError:
            return "the files could not be written: the disk is full or failing"
        if free < self.one_save_bytes or free < 2**20:
            return f"[Errno 28] No space left on device: {space.human(free)} free, a save needs {space.human(self.one_save_bytes)}"
        return f"the files could not be written ({space.human(free)} free now): an I/O error or a quota"

    def flush(self) -> list[SaveRecord]:
        """Wait for the save in flight; returns the saves published since the last call."""
        if self.enabled:
            self._finish(wait=True)
        done, self._completed = self._completed, []
        return done

    def close(self) -> None:
        try:
            if self.enabled:
                self._finish(wait=True)
            self.retention.join()
            if self.stager is not None:
                self.stager.close()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self.release()


def _fresh_folder(path: Path) -> None:
    """An empty folder at `path` (what an earlier, interrupted save of the same step left is removed)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
