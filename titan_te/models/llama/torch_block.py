"""Llama's block on the `torch` layer backend: pure PyTorch (SDPA attention) with Transformer Engine's
parameter names and layouts.

Layout facts taken from TE's `TransformerLayer(fuse_qkv_params=True)`:
- `self_attention.layernorm_qkv.weight` is the fused QKV weight, interleaved per KV group:
  for each group g the rows are [q heads of g (n_heads/n_kv_heads of them), k_g, v_g], head_dim each.
- `layernorm_mlp.fc1_weight` stacks [gate; up]; TE's SwiGLU applies SiLU to the first half.
- RoPE is the non-interleaved (rotate-half) form over angles of shape [seq, 1, 1, head_dim].
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; angles: [seq, 1, 1, head_dim]."""
    ang = angles.transpose(0, 1)  # [1, seq, 1, hd]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    return x * cos + rotate_half(x) * sin


class LayerNormLinear(nn.Module):
    """RMSNorm then a bias-free linear layer (TE's LayerNormLinear names)."""

    def __init__(self, in_dim: int, out_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.empty(in_dim))
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight.to(x.dtype), self.eps), self.weight)


class SelfAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.layernorm_qkv = LayerNormLinear(args.dim, qkv_out, args.norm_eps)
        self.proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        per_group = self.n_heads // self.n_kv
        qkv = self.layernorm_qkv(x).view(b, s, self.n_kv, per_group + 2, self.hd)
        q, k, v = qkv.split([per_group, 1, 1], dim=3)
        q = apply_rope(q.reshape(b, s, self.n_heads, self.hd), angles)
        k = apply_rope(k.reshape(b, s, self.n_kv, self.hd), angles)
        v = v.reshape(b, s, self.n_kv, self.hd)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=mask is None, enable_gqa=per_group > 1)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.hd))


class LayerNormMLP(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.eps = args.norm_eps
        self.layer_norm_weight = nn.Parameter(torch.empty(args.dim))
        self.fc1_weight = nn.Parameter(torch.empty(2 * args.ffn_dim, args.dim))
        self.fc2_weight = nn.Parameter(torch.empty(args.dim, args.ffn_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight.to(x.dtype), self.eps), self.fc1_weight)
        gate, up = h.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.fc2_weight)


class TorchBlock(nn.Module):
    def __init__(self, args, layer_id: int, fp8=None, params_dtype: torch.dtype = torch.float32,
                 document_mask: bool = False):
        super().__init__()
        self.self_attention = SelfAttention(args)
        self.layernorm_mlp = LayerNormMLP(args)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attention(x, angles, mask)
        return x + self.layernorm_mlp(x)

