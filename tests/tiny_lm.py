"""A second model family, registered the way a user would (`--job.custom_import=tiny_lm`): not a Llama.

Blocks mix tokens causally with a running mean, then apply an MLP; flavors of its own ("tiny"); a Hugging
Face adapter in tiny_lm_hf.py (registered again as tiny_lm_bare without one).
"""
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

import tiny_lm_hf
from titan_te.models import MODELS, ModelSpec


@dataclass(frozen=True)
class TinyArgs:
    dim: int = 32
    n_layers: int = 2
    vocab_size: int = 0

    def num_params(self) -> int:
        return 2 * self.vocab_size * self.dim + self.n_layers * (8 * self.dim * self.dim + 2 * self.dim)

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * (self.num_params() - self.vocab_size * self.dim)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.mix = nn.Linear(dim, dim, bias=True)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=True)

    def forward(self, h):
        steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype).view(1, -1, 1)
        h = h + self.mix(h.cumsum(1) / steps)  # causal: token t sees the mean of tokens <= t
        return h + self.down(torch.relu(self.up(h)))


class TinyLM(nn.Module):
    def __init__(self, args: TinyArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args.dim) for i in range(args.n_layers)})
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def init_rule(self, name: str):
        if name.endswith("bias"):
            return "zeros", 0.0
        return "normal", 0.02

    def init_buffers(self, device) -> None:
        pass

    def forward(self, tokens, doc_start=None):
        h = self.embed(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.head(h)


def resolve_args(args: "TinyArgs", vocab_size: int, seq_len: int, n_layers: int = 0) -> TinyArgs:
    args = replace(args, vocab_size=vocab_size)
    return replace(args, n_layers=n_layers) if n_layers else args


def build(args, backend, **_):
    return TinyLM(args)


FLAVORS = {"tiny": TinyArgs()}
if "tiny_lm" not in MODELS:
    MODELS.register("tiny_lm")(ModelSpec(name="tiny_lm", flavors=FLAVORS, build=build, resolve_args=resolve_args,
                                         hf=tiny_lm_hf))
    # the same family without a Hugging Face adapter
    MODELS.register("tiny_lm_bare")(ModelSpec(name="tiny_lm_bare", flavors=FLAVORS, build=build,
                                              resolve_args=resolve_args))
