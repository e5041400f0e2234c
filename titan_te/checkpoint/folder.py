"""The checkpoint folder on disk: step folders, their manifests, lineages and retention.

Layout: `<folder>/step-<N>/` is one DCP checkpoint. A save is written to `step-<N>.tmp/`; once every
rank's data and DCP's `.metadata` are on disk, rank 0 writes `titan_te.json` (the manifest) into it
and renames it to `step-<N>`. So a folder counts as a checkpoint only when it is named `step-<N>` and
holds both `.metadata` and a readable manifest; anything else (a `.tmp`, a copied or half-deleted
folder, another tool's DCP folder) is never loaded, never counted by retention and never deleted.

A checkpoint must survive a crash of the machine, not only of the process: DCP syncs its files; the manifest,
the folder's entries and the rename are synced before retention deletes anything older.

The manifest names the checkpoint's *lineage*: the id of the run that started from nothing, carried
on by every run that resumes from it. Retention only ever prunes folders of this run's lineage.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from titan_te.durable import sync

logger = logging.getLogger("titan_te")
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_DIR = re.compile(r"^step-(\d+)\.tmp$")
MANIFEST = "titan_te.json"
FORMAT = 1


@dataclass
class Manifest:
    """What a checkpoint holds and who wrote it (saved as JSON beside DCP's files)."""

    step: int
    lineage: str
    parts: list[str]  # the Stateful parts saved (model only for a model-only save)
    dp_world: int
    facts: dict = field(default_factory=dict)  # model / optimizer description, for mismatch messages
    model_only: bool = False
    format: int = FORMAT
    saved_at: float = 0.0
    run_folder: str = ""  # the run folder that wrote it (resuming another run's checkpoints is refused)
    files: dict = field(default_factory=dict)  # {file: [size, crc32]} of every file, verified before a load

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    def write(self, folder: Path) -> None:
        """Write the manifest into `folder` and sync it and the folder's entries to the disk."""
        path = Path(folder) / MANIFEST
        path.write_text(self.to_json())
        sync(path)
        sync(folder)

    @classmethod
    def read(cls, folder: Path) -> "Manifest | None":
        """The manifest of `folder`, or None when it has none or it is unreadable / not ours."""
        try:
            data = json.loads((folder / MANIFEST).read_text())
            m = cls(**{k: data[k] for k in ("step", "lineage", "parts", "dp_world")},
                    **{k: data[k] for k in ("facts", "model_only", "format", "saved_at", "run_folder", "files")
                       if k in data})  # absent in an older titan_te's manifest: the defaults
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return m if m._well_formed() else None

    def _well_formed(self) -> bool:
        """The types this package writes (a hand-edited or damaged manifest is not a manifest of ours)."""
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        return (is_int(self.step) and isinstance(self.lineage, str) and is_int(self.dp_world) and self.dp_world >= 1
                and isinstance(self.parts, list) and all(isinstance(p, str) for p in self.parts)
                and isinstance(self.model_only, bool) and is_int(self.format) and isinstance(self.run_folder, str)
                and isinstance(self.saved_at, (int, float)) and isinstance(self.facts, dict) and isinstance(self.files, dict)
                and all(isinstance(k, str) and isinstance(v, dict) for k, v in self.facts.items())
                and all(isinstance(k, str) and isinstance(v, list) and len(v) == 2 and all(is_int(x) for x in v)
                        for k, v in self.files.items()))  # checksums: {file: [size, checksum]}


def too_new(m: Manifest, path: Path) -> str:
    """Why this titan_te cannot read the checkpoint at `path` ("" when it can): a later titan_te's format."""
    if m.format <= FORMAT:
        return ""
    return (f"{path} was written by a later titan_te (checkpoint format {m.format}; this one reads format {FORMAT} "
            f"and older); resume or export it with that version")


def new_lineage() -> str:
    return uuid.uuid4().hex[:12]


def step_dir(folder: Path, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # an unreadable folder: not a checkpoint we can use
        return False


def scan(folder: Path) -> tuple[dict[int, Manifest], list[tuple[Path, str]]]:
    """({step: manifest} of the complete checkpoints, [(step folder, what it lacks)] of the step folders that are
    not complete checkpoints of ours: a save in progress is a .tmp folder, so these are damaged or not ours)."""
    found: dict[int, Manifest] = {}
    others: list[tuple[Path, str]] = []
    try:
        children = list(Path(folder).iterdir()) if Path(folder).is_dir() else []
    except OSError:
        return found, others
    for child in children:
        m = STEP_DIR.match(child.name)
        if not m:
            continue
        if not _is_file(child / ".metadata"):
            others.append((child, "no DCP .metadata file"))
            continue
        manifest = Manifest.read(child)
        if manifest is not None and manifest.step == int(m.group(1)):
            found[manifest.step] = manifest
        else:  # a DCP folder we did not write, or with a damaged manifest
            others.append((child, f"no readable {MANIFEST}" if manifest is None else
                           f"its {MANIFEST} is of step {manifest.step}"))
    return dict(sorted(found.items())), sorted(others)


def checkpoint_folder(ck, run_folder: Path) -> Path:
    """Where the [checkpoint] section `ck` saves: checkpoint.folder, relative to the run folder unless absolute."""
    return Path(ck.folder) if Path(ck.folder).is_absolute() else Path(run_folder) / ck.folder


def resume_step(found: dict, load_step: int = 0) -> int | None:
    """The step a resume loads from the complete checkpoints `found`: `load_step` (> 0), else the newest."""
    if load_step > 0:
        return load_step if load_step in found else None
    return max(found) if found else None


def resume_manifest(folder: Path, load_step: int = 0) -> Manifest | None:
    """The manifest of the checkpoint a resume would load."""
    found, _ = scan(folder)
    step = resume_step(found, load_step)
    return None if step is None else found[step]


def saved_global_batch(folder: Path, load_step: int = 0) -> int | None:
    """Sequences per step of the run whose checkpoint a resume would load (its facts' data.global_batch), or
    None: no checkpoint, or one of a titan_te that did not record it."""
    m = resume_manifest(folder, load_step)
    value = (m.facts.get("data") or {}).get("global_batch") if m is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 2**31 else None


def complete_steps(folder: Path) -> list[int]:
    """Steps of the complete checkpoints in `folder`, ascending."""
    return list(scan(folder)[0])


def folder_bytes(path: Path) -> int:
    total = 0
    for p in Path(path).rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:
            pass
    return total


def remove_interrupted_saves(folder: Path) -> list[tuple[str, int]]:
    """Delete the `step-<N>.tmp` folders an interrupted save left (at 8B each is ~70 GB); returns
    (name, bytes) of each. Only called while this run holds the run-folder lock."""
    removed = []
    if not Path(folder).is_dir():
        return removed
    for child in sorted(Path(folder).iterdir()):
        if TMP_DIR.match(child.name) and child.is_dir():
            size = folder_bytes(child)
            shutil.rmtree(child)
            removed.append((child.name, size))
    return removed


def set_aside(folder: Path, steps: list[int], why: str) -> Path:
    """Move the given checkpoints into `<folder>/superseded-<time>/` (nothing is deleted)."""
    dest = Path(folder) / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "README.txt").write_text(f"Checkpoints moved here by titan_te: {why}\n")
    for s in steps:
        step_dir(folder, s).rename(dest / f"step-{s}")
    return dest


def publish(tmp: Path, final: Path) -> None:
    """Make `tmp` visible as `final`, durably (the parent's entries are synced). A folder already there is
    moved aside, never deleted."""
    if final.exists():
        aside = final.with_name(f"{final.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        final.rename(aside)
        logger.warning(f"checkpoint: {final} already existed; moved it to {aside}")
    tmp.rename(final)
    sync(final.parent)


class Retention:
    """Keeps the newest `keep` checkpoints of one lineage; deletes the older ones in the background.
    The checkpoint just written and the ones in `protected` (the one the run resumed from) stay."""

    def __init__(self, folder: Path, keep: int):
        self.folder, self.keep = Path(folder), keep
        self.protected: set[int] = set()
        self._deleter: threading.Thread | None = None

    def prune(self, lineage: str, just_written: int) -> list[int]:
        if self.keep <= 0:
            return []
        mine = [s for s, m in scan(self.folder)[0].items() if m.lineage == lineage]
        doomed = [s for s in mine[:-self.keep] if s != just_written and s not in self.protected]
        if not doomed:
            return []
        self.join()
        paths = [step_dir(self.folder, s) for s in doomed]
        self._deleter = threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths],
                                         name="checkpoint-retention", daemon=True)
        self._deleter.start()
        return doomed

    def join(self) -> None:
        if self._deleter is not None:
            self._deleter.join()
            self._deleter = None
