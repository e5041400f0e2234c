"""A model family that is not Llama-shaped, in one file, registered the way a user would
(`--job.custom_import=gpt_lm`): GPT-2's block (LayerNorm with biases, GELU MLP, biases everywhere, learned
positions, no RoPE) on both layer backends.

- `torch`: the block below in plain PyTorch (runs on the CPU);
- `te`: Transformer Engine's TransformerLayer with GPT-2's settings, through titan_te.te.layers (FP8 compute
  and FP8 weights on a GPU; the FP8 policy decides which blocks, titan_te.te decides how).
The two backends name their parameters differently, so a checkpoint stays with the backend that wrote it.
"""
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_te.models import MODELS, ModelSpec


@dataclass(frozen=True)
class GPTArgs:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 2
    vocab_size: int = 0  # from the tokenizer
    max_seq_len: int = 256
    norm_eps: float = 1e-5

    @property
    def ffn_dim(self) -> int:
        return 4 * self.dim

    def num_params(self) -> int:
        block = 4 * self.dim * self.dim + 2 * self.dim * self.ffn_dim + 9 * self.dim + self.ffn_dim
        return self.n_layers * block + (2 * self.vocab_size + self.max_seq_len + 2) * self.dim

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * (self.num_params() - (self.vocab_size + self.max_seq_len) * self.dim) \
            + 12 * self.n_layers * self.dim * seq_len


FLAVORS = {"small": GPTArgs()}


class Attention(nn.Module):
    def __init__(self, a: GPTArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.ln = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.qkv = nn.Linear(a.dim, 3 * a.dim)
        self.out = nn.Linear(a.dim, a.dim)

    def forward(self, x, mask=None):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, s, 3, self.n_heads, d // self.n_heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, is_causal=mask is None)
        return self.out(o.transpose(1, 2).reshape(b, s, d))


class TorchBlock(nn.Module):
    def __init__(self, a: GPTArgs, layer_id: int, **_):
        super().__init__()
        self.attn = Attention(a)
        self.ln_mlp = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.fc = nn.Linear(a.dim, a.ffn_dim)
        self.proj = nn.Linear(a.ffn_dim, a.dim)

    def forward(self, x, mask=None):
        x = x + self.attn(x, mask)
        return x + self.proj(F.gelu(self.fc(self.ln_mlp(x)), approximate="tanh"))


def te_block(a: GPTArgs, layer_id: int, fp8=None, params_dtype=torch.float32, document_mask=False):
    from titan_te.te.layers import transformer_layer

    return transformer_layer(layer_id, a.n_layers, fp8=fp8, document_mask=document_mask, params_dtype=params_dtype,
                             hidden_size=a.dim, ffn_hidden_size=a.ffn_dim, num_attention_heads=a.n_heads,
                             layernorm_epsilon=a.norm_eps, bias=True, activation="gelu", normalization="LayerNorm",
                             fuse_qkv_params=True)


BLOCKS = {"torch": TorchBlock, "te": te_block}


class GPT(nn.Module):
    def __init__(self, a: GPTArgs, backend: str, document_mask=None, **block_options):
        super().__init__()
        self.args = a
        self.document_mask = document_mask
        self.wte = nn.Embedding(a.vocab_size, a.dim)
        self.wpe = nn.Embedding(a.max_seq_len, a.dim)
        block = BLOCKS[backend]
        self.layers = nn.ModuleDict({str(i): block(a, i, document_mask=document_mask is not None, **block_options)
                                     for i in range(a.n_layers)})
        self.ln_f = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.head = nn.Linear(a.dim, a.vocab_size, bias=False)

    def init_rule(self, name: str):
        last = name.rsplit(".", 1)[-1]
        if last in ("layer_norm_weight",) or (last == "weight" and (".ln" in name or name.startswith("ln"))):
            return "ones", 0.0
        if "bias" in last:
            return "zeros", 0.0
        return "normal", 0.02

    def init_buffers(self, device) -> None:
        pass

    def forward(self, tokens, doc_start=None):
        s = tokens.shape[1]
        h = self.wte(tokens) + self.wpe(torch.arange(s, device=tokens.device))
        if torch.is_autocast_enabled(h.device.type):
            h = h.to(torch.get_autocast_dtype(h.device.type))
        mask = None
        if self.document_mask is not None:
            starts = doc_start if doc_start is not None else torch.zeros_like(tokens, dtype=torch.bool)
            mask = self.document_mask(starts)
        for block in self.layers.values():
            h = block(h, mask=mask)
        return self.head(self.ln_f(h)).float()


def build(a: GPTArgs, backend: str, document_mask: bool = False, **block_options):
    from titan_te.layers import BACKENDS

    return GPT(a, backend, BACKENDS.get(backend).document_mask if document_mask else None, **block_options)


def resolve_args(a: GPTArgs, vocab_size: int, seq_len: int, n_layers: int = 0) -> GPTArgs:
    a = replace(a, vocab_size=vocab_size, max_seq_len=max(a.max_seq_len, seq_len))
    return replace(a, n_layers=n_layers) if n_layers else a


if "gpt_lm" not in MODELS:
    MODELS.register("gpt_lm")(ModelSpec(name="gpt_lm", flavors=FLAVORS, build=build, resolve_args=resolve_args,
                                        backends=tuple(BLOCKS),
                                        fp8_stat_groups={"layernorm_qkv": "qkv", "proj": "proj",
                                                         "layernorm_mlp": "mlp"}))
