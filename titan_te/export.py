"""Export a DCP checkpoint as a Hugging Face Llama folder (safetensors + config.json).

    python -m titan_te.export --checkpoint outputs/debug/checkpoint/step-200 --out hf_out [--dtype float32]

Runs in one process without a process group. Prefers the optimizer's FP32 master weights where the
checkpoint holds them (FP8 / BF16 weights with masters), else the model weights.
"""
from __future__ import annotations

from titan_te.preemption import SIGNALS

if __name__ == "__main__":
    SIGNALS.install_early()  # before the imports below: a Ctrl-C while they load is one line too

import importlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_te import config as config_mod
from titan_te.checkpoint import integrity
from titan_te.checkpoint.errors import describe, is_unreadable_data
from titan_te.checkpoint.folder import MANIFEST, Manifest, complete_steps, step_dir, too_new
from titan_te.data import TOKENIZERS
from titan_te.durable import sync, sync_folder
from titan_te.errors import ExportError
from titan_te.hf_files import save_hf_folder
from titan_te.models import MODELS
from titan_te.paths import check_path
from titan_te.registry import RegistryError
from titan_te.run_folder import why
from titan_te.tool_cli import OneLineParser, run_tool, stderr_is_clean

DEFAULT_DTYPE = config_mod.Checkpoint.export_dtype  # one default for both ways of exporting
MARKER = "titan_te_export.json"  # marks a folder as an export of ours: a later export may replace it


def read_full_model(ckpt: Path) -> tuple[dict, int]:
    """Full FP32 model tensors from a DCP folder; returns (state, how many came from FP32 masters)."""
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    wanted = {}
    for key, m in meta.items():
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata) and not key.endswith("_extra_state"):
            name = key[len("model."):]
            master = f"optimizer.state.{name}.master_param"
            src = master if isinstance(meta.get(master), TensorStorageMetadata) else key
            wanted[name] = (src, meta[src])
    target = {src: torch.empty(m.size, dtype=m.properties.dtype) for src, m in wanted.values()}
    dcp.load(_nest(target), checkpoint_id=str(ckpt), no_dist=True)  # fills the tensors of `target` in place
    out = {name: target[src].float() for name, (src, _) in wanted.items()}
    return out, sum(src.startswith("optimizer.") for src, _ in wanted.values())


def _nest(flat: dict) -> dict:
    """{'model.a.b': t} -> {'model': {'a.b': t}}, {'optimizer.state.x.master_param': t} -> nested."""
    out: dict = {}
    for key, t in flat.items():
        if key.startswith("model."):
            out.setdefault("model", {})[key[len("model."):]] = t
        else:
            fqn, state_name = key[len("optimizer.state."):].rsplit(".", 1)
            out.setdefault("optimizer", {}).setdefault("state", {}).setdefault(fqn, {})[state_name] = t
    return out


@dataclass
class RunFacts:
    """What export needs to rebuild the model of a checkpoint: from its manifest (written by the run that
    saved it), or from the run folder's config.toml for checkpoints of an older titan_te."""

    model: str
    flavor: str
    seq_len: int
    custom_import: str
    bos_id: int
    eos_id: int


RUN_FACT_TYPES = (str, str, int, str, int, int)  # RunFacts' fields, in order


def run_facts(ckpt: Path) -> RunFacts:
    manifest = Manifest.read(ckpt)
    facts = manifest.facts if manifest else {}
    if "export" in facts and "model" in facts:
        m, e = facts["model"], facts["export"]
        values = (m.get("name"), m.get("flavor"), e.get("seq_len"), e.get("custom_import"), e.get("bos_id"),
                  e.get("eos_id"))
        if not all(isinstance(v, t) and not isinstance(v, bool) for v, t in zip(values, RUN_FACT_TYPES)):
            raise ExportError(f"{ckpt / MANIFEST} is damaged: its facts do not name the model (model.name, "
                              f"model.flavor, export.seq_len, custom_import, bos_id, eos_id: {values})")
        return RunFacts(*values)
    cfg = _older_run_config(ckpt, manifest)
    tokenizer = TOKENIZERS.get(cfg.data.tokenizer)(cfg.data)
    return RunFacts(cfg.model.name, cfg.model.flavor, cfg.training.seq_len, cfg.job.custom_import,
                    int(tokenizer.bos_id), int(tokenizer.eos_id))


def _older_run_config(ckpt: Path, manifest: Manifest | None) -> config_mod.Config:
    """The resolved config of the run that wrote `ckpt` (its manifest names the run folder)."""
    candidates = ([Path(manifest.run_folder) / "config.toml"] if manifest and manifest.run_folder else []) + \
        [ckpt.parent.parent / "config.toml"]
    for path in candidates:
        if path.is_file():
            return config_mod.build(config_mod.load_toml(str(path)), [], str(path))
    raise ExportError(f"no config.toml of the run that wrote {ckpt} (looked at {', '.join(map(str, candidates))}); "
                      f"it names the model flavor")


def model_spec(facts: RunFacts):
    """The run's ModelSpec (importing its job.custom_import first); it must offer an HF adapter."""
    try:
        if facts.custom_import:
            importlib.import_module(facts.custom_import)
        spec = MODELS.get(facts.model)
    except (ImportError, RegistryError) as e:
        raise ExportError(f"model {facts.model!r} of the run is not available here ({e})") from None
    if spec.hf is None:
        raise ExportError(f"model {spec.name} has no Hugging Face adapter (ModelSpec.hf), so it cannot be exported")
    if facts.flavor not in spec.flavors:
        raise ExportError(f"model.flavor {facts.flavor!r} of the run is not a flavor of {facts.model}")
    return spec


def _not_a_checkpoint(path: Path) -> str:
    for folder in (path, path / "checkpoint"):
        steps = complete_steps(folder)
        if steps:
            return f"{path} is not a checkpoint; the newest complete one under it is {step_dir(folder, steps[-1])}"
    return f"{path} is not a complete DCP checkpoint (no .metadata)"


def _check_out(out: Path) -> bool:
    """May `out` be written? Returns whether it holds an earlier export (replaced whole)."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a folder")
    try:
        present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    except OSError as e:
        raise ExportError(f"--out {out} cannot be read ({why(e)})") from None
    if not present:
        return False
    if MARKER not in present:
        shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
        raise ExportError(f"--out {out} is not empty and not an earlier export of titan_te (it holds {shown}); "
                          f"export into a new or empty folder")
    return True


def export(ckpt: Path, out: Path, dtype_name: str) -> str:
    """Write the checkpoint's model as a Hugging Face Llama folder. Everything is read and converted
    first; the folder is written beside `out` and put in place whole (an earlier export there is
    replaced whole), so a failure or a stop leaves `out` as it was."""
    if not (ckpt / ".metadata").is_file():
        raise ExportError(_not_a_checkpoint(ckpt))
    manifest = Manifest.read(ckpt)
    if manifest is None:
        raise ExportError(f"{ckpt} is not a complete titan_te checkpoint (no readable {MANIFEST}: an interrupted "
                          f"save, or another tool's DCP folder)")
    if newer := too_new(manifest, ckpt):
        raise ExportError(newer)
    replacing = _check_out(out)
    try:
        integrity.verify(ckpt, manifest.files, None)
        state, from_masters = read_full_model(ckpt)
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        if not is_unreadable_data(e):
            raise  # a bug keeps its traceback
        raise ExportError(f"{ckpt} is corrupt or unreadable ({describe(e)})") from None
    facts = run_facts(ckpt)
    spec = model_spec(facts)
    adapter = spec.hf
    args = adapter.export_args(spec.flavors[facts.flavor], state, facts.seq_len)
    dtype = getattr(torch, dtype_name)
    hf = {k: v.to(dtype) for k, v in adapter.to_hf(state, args).items()}
    config = {**adapter.hf_config(args, dtype_name), "bos_token_id": facts.bos_id, "eos_token_id": facts.eos_id}
    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        shutil.rmtree(staging, ignore_errors=True)
        save_hf_folder(hf, config, staging)
        (staging / MARKER).write_text(json.dumps({"checkpoint": str(ckpt.resolve()), "dtype": dtype_name}) + "\n")
        _publish(staging, out, replacing)
    except (OSError, SafetensorError) as e:
        raise ExportError(f"--out {out} cannot be written ({describe(e)}); nothing was written there") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return (f"exported {len(hf)} tensors ({sum(t.numel() for t in hf.values()) / 1e6:,.1f} M parameters, "
            f"{from_masters} from FP32 master weights) as {dtype_name} to {out}")


def _publish(staging: Path, out: Path, replacing: bool) -> None:
    """Move the export in, synced to the disk (its files, then the move) before an earlier export there is
    deleted, so that a crash of the machine cannot lose both."""
    sync_folder(staging)
    old = out.parent / f".{out.name}.export-old-{os.getpid()}"
    if replacing:
        out.rename(old)
    elif out.is_dir():
        out.rmdir()  # empty (checked): the new folder takes its place
    staging.rename(out)
    sync(out.parent)
    if replacing:
        shutil.rmtree(old, ignore_errors=True)


def main(argv=None, exits_after: bool = False) -> int:
    return run_tool(ExportError.prefix, lambda: _main(sys.argv[1:] if argv is None else argv), exits_after)


def _main(argv) -> int:
    ap = OneLineParser(prog="python -m titan_te.export", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a DCP folder: <run>/checkpoint/step-<N>")
    ap.add_argument("--out", required=True, help="output folder (new, empty, or an earlier export: replaced whole)")
    ap.add_argument("--dtype", default=DEFAULT_DTYPE, choices=["float32", "bfloat16", "float16"],
                    help="dtype of the exported weights (default: %(default)s, as checkpoint.export_dtype)")
    a = ap.parse_args(argv)
    for key in ("checkpoint", "out"):
        check_path(f"--{key}", getattr(a, key), "", required=True)
    stderr_is_clean()
    SIGNALS.doing(f"exporting to {a.out}")
    print(export(Path(a.checkpoint), Path(a.out), a.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main(exits_after=True))
