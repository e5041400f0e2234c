"""Export a DCP checkpoint as a Hugging Face Llama folder (safetensors + config.json).

    python -m titan_te.export --checkpoint outputs/debug/checkpoint/step-200 --out hf_out [--dtype bfloat16]

Runs in one process without a process group. Prefers the optimizer's FP32 master weights where the
checkpoint holds them (FP8 / BF16 weights with masters), else the model weights.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_te import config as config_mod
from titan_te.hf_io import hf_config, save_hf_folder, to_hf
from titan_te.models.llama import FLAVORS


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


def model_args_for(ckpt: Path, state: dict):
    run_cfg = ckpt.parent.parent / "config.toml"
    if not run_cfg.is_file():
        raise SystemExit(f"export: {run_cfg} not found (the run folder's resolved config names the flavor)")
    cfg = config_mod.build(config_mod.load_toml(str(run_cfg)), [], str(run_cfg))
    args = FLAVORS[cfg.model.flavor]
    n_layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    return replace(args, vocab_size=state["tok_embeddings.weight"].shape[0], n_layers=n_layers,
                   max_seq_len=max(args.max_seq_len, cfg.training.seq_len))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_te.export", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a DCP folder: <run>/checkpoint/step-<N>")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    a = ap.parse_args(argv)
    ckpt = Path(a.checkpoint)
    if not (ckpt / ".metadata").is_file():
        print(f"export error: {ckpt} is not a complete DCP checkpoint (no .metadata)", file=sys.stderr)
        return 2
    state, from_masters = read_full_model(ckpt)
    args = model_args_for(ckpt, state)
    dtype = getattr(torch, a.dtype)
    hf = {k: v.to(dtype) for k, v in to_hf(state, args).items()}
    save_hf_folder(hf, hf_config(args, a.dtype), Path(a.out))
    print(f"exported {len(hf)} tensors ({sum(t.numel() for t in hf.values()) / 1e6:,.1f} M parameters, "
          f"{from_masters} from FP32 master weights) as {a.dtype} to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
