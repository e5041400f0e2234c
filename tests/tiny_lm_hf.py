"""The Hugging Face adapter of tests/tiny_lm.py: what a model family provides to be exported and imported."""
from dataclasses import replace
from pathlib import Path

import torch

from titan_te.errors import ConfigError, ExportError
from titan_te.hf_files import read_hf_folder
from titan_te.init_weights import clean_name, local_shard, local_tensor

NAMES = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight"}


def _hf_name(name: str) -> str:
    if name in NAMES:
        return NAMES[name]
    return "model." + name  # layers.<i>.mix.weight -> model.layers.<i>.mix.weight


def export_args(args, state: dict, seq_len: int):
    if "embed.weight" not in state:
        raise ExportError("the checkpoint holds no tiny_lm weights")
    layers = {int(k.split(".")[1]) for k in state if k.startswith("layers.")}
    return replace(args, vocab_size=state["embed.weight"].shape[0], n_layers=len(layers))


def to_hf(state: dict, args) -> dict:
    return {_hf_name(k): v for k, v in state.items()}


def hf_config(args, dtype: str) -> dict:
    return {"model_type": "tiny_lm", "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
            "vocab_size": args.vocab_size, "torch_dtype": dtype}


@torch.no_grad()
def load_hf_weights(model, folder: str, write=None) -> None:
    """Each rank copies its own shard of every full tensor (parameters may be FSDP2 DTensors)."""
    hf = read_hf_folder(Path(folder))
    for name, p in model.named_parameters():
        name = clean_name(name)
        if _hf_name(name) not in hf:
            raise ConfigError(f"checkpoint.initial_load_path: {folder} has no {_hf_name(name)}")
        target = local_tensor(p)
        (write or (lambda t, v: t.copy_(v)))(target, local_shard(hf[_hf_name(name)].to(target.dtype), p))
