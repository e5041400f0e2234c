"""The torchtitan-style peer for train_bench.py: what a torchtitan user runs on the same GPU.

- a Llama 3 built from nn.Linear projections (wq, wk, wv, wo, w1, w2, w3) and SDPA attention;
- torchao float8 training, tensorwise scaling, every Linear but the output head (or bf16 throughout);
- torch.compile of each block;
- FSDP2 per block and at the root, bf16 compute and fp32 gradient reduction;
- fused torch AdamW; FP32 weights and moments, or bf16 for both (`bf16_state`, to fit 8B on one GPU);
- cross-entropy over FP32 logits; gradient clipping at 1.0; host reads of the loss on log steps only.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan_te.models.llama import rope_angles


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = a.n_heads, a.n_kv_heads, a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = _rotate(self.wq(x).view(b, s, self.n_heads, self.hd), cos, sin)
        k = _rotate(self.wk(x).view(b, s, self.n_kv, self.hd), cos, sin)
        v = self.wv(x).view(b, s, self.n_kv, self.hd)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             enable_gqa=self.n_heads != self.n_kv)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class PeerLlama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({str(i): Block(a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        ang = rope_angles(self.args, tokens.shape[1], device=tokens.device).transpose(0, 1)  # [1, s, 1, hd]
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        for block in self.layers.values():
            h = block(h, cos, sin)
        return self.output(self.norm(h))


def build_peer(args, float8: bool, bf16_state: bool, device: torch.device):
    """The peer model (converted, compiled, sharded, initialized) and its optimizer."""
    with torch.device("meta"):
        model = PeerLlama(args)
    if bf16_state:
        model = model.to(torch.bfloat16)
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=lambda m, fqn: fqn != "output")
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        fully_shard(block, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 if "tok_embeddings" in name else 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return model, opt


def peer_step(model, opt, tokens: torch.Tensor, labels: torch.Tensor, accum: int = 1) -> torch.Tensor:
    """One step as torchtitan takes it, over `accum` micro-batches of `tokens` (gradient accumulation: each
    micro-batch's loss divided by `accum`); returns the mean loss as a device tensor."""
    total = torch.zeros((), device=tokens.device)
    for _ in range(accum):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / accum
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total
