"""Export a DCP checkpoint as a Hugging Face Llama folder (safetensors + config.json).

    python -m titan_te.export --checkpoint outputs/debug/checkpoint/step-200 --out hf_out [--dtype float32]

Runs in one process without a process group. Prefers the optimizer's FP32 master weights where the
checkpoint holds them (FP8 / BF16 weights with masters), else the model weights.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_te import config as config_mod
from titan_te.checkpoint.folder import Manifest, complete_steps, step_dir
from titan_te.data import TOKENIZERS
from titan_te.errors import ExportError, UserError
from titan_te.hf_io import save_hf_folder
from titan_te.models import MODELS
from titan_te.registry import RegistryError

DEFAULT_DTYPE = config_mod.Checkpoint.export_dtype  # one default for both ways of exporting


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


def run_config(ckpt: Path) -> tuple[config_mod.Config, Path]:
    """The resolved config of the run that wrote `ckpt` (its manifest names the run folder)."""
    manifest = Manifest.read(ckpt)
    candidates = ([Path(manifest.run_folder) / "config.toml"] if manifest and manifest.run_folder else []) + \
        [ckpt.parent.parent / "config.toml"]
    for path in candidates:
        if path.is_file():
            return config_mod.build(config_mod.load_toml(str(path)), [], str(path)), path
    raise ExportError(f"no config.toml of the run that wrote {ckpt} (looked at {', '.join(map(str, candidates))}); "
                      f"it names the model flavor")


def model_spec(cfg: config_mod.Config):
    """The run's ModelSpec (importing its job.custom_import first); it must offer an HF adapter."""
    try:
        if cfg.job.custom_import:
            importlib.import_module(cfg.job.custom_import)
        spec = MODELS.get(cfg.model.name)
    except (ImportError, RegistryError) as e:
        raise ExportError(f"model {cfg.model.name!r} of the run is not available here ({e})") from None
    if spec.hf is None:
        raise ExportError(f"model {spec.name} has no Hugging Face adapter (ModelSpec.hf), so it cannot be exported")
    return spec


def model_args_for(cfg: config_mod.Config, state: dict, spec, adapter):
    """The flavor's args, sized by the model's HF adapter from the checkpoint's tensors (blocks, vocabulary)."""
    if cfg.model.flavor not in spec.flavors:
        raise ExportError(f"model.flavor {cfg.model.flavor!r} of the run is not a flavor of {cfg.model.name}")
    return adapter.export_args(spec.flavors[cfg.model.flavor], state, cfg.training.seq_len)


def _not_a_checkpoint(path: Path) -> str:
    for folder in (path, path / "checkpoint"):
        steps = complete_steps(folder)
        if steps:
            return f"{path} is not a checkpoint; the newest complete one under it is {step_dir(folder, steps[-1])}"
    return f"{path} is not a complete DCP checkpoint (no .metadata)"


def export(ckpt: Path, out: Path, dtype_name: str) -> str:
    if not (ckpt / ".metadata").is_file():
        raise ExportError(_not_a_checkpoint(ckpt))
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a folder")
    try:
        state, from_masters = read_full_model(ckpt)
    except Exception as e:  # noqa: BLE001 -- damaged DCP files: whatever unpickling / reading raises, one line
        raise ExportError(f"{ckpt} is corrupt or unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200]})") \
            from None
    cfg, _ = run_config(ckpt)
    spec = model_spec(cfg)
    hf_io = importlib.import_module(spec.hf)
    args = model_args_for(cfg, state, spec, hf_io)
    tokenizer = TOKENIZERS.get(cfg.data.tokenizer)(cfg.data)
    dtype = getattr(torch, dtype_name)
    hf = {k: v.to(dtype) for k, v in hf_io.to_hf(state, args).items()}
    config = {**hf_io.hf_config(args, dtype_name), "bos_token_id": int(tokenizer.bos_id), "eos_token_id": int(tokenizer.eos_id)}
    save_hf_folder(hf, config, out)
    return (f"exported {len(hf)} tensors ({sum(t.numel() for t in hf.values()) / 1e6:,.1f} M parameters, "
            f"{from_masters} from FP32 master weights) as {dtype_name} to {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_te.export", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a DCP folder: <run>/checkpoint/step-<N>")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--dtype", default=DEFAULT_DTYPE, choices=["float32", "bfloat16", "float16"],
                    help="dtype of the exported weights (default: %(default)s, as checkpoint.export_dtype)")
    a = ap.parse_args(argv)
    try:
        print(export(Path(a.checkpoint), Path(a.out), a.dtype))
    except UserError as e:  # the run's config.toml may raise ConfigError: still the export's input
        print(f"{ExportError.prefix}: {e.msg}", file=sys.stderr)
        return ExportError.exit_code
    except OSError as e:
        print(f"export error: {e.filename or a.out}: {e.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
