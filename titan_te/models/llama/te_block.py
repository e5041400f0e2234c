"""Llama's block on the `te` layer backend: TE's TransformerLayer as a Llama 3 block (RMSNorm, SwiGLU, GQA,
no biases, one fused QKV weight, which TE needs for FP8 weights)."""
from __future__ import annotations

import torch

from titan_te.te.layers import transformer_layer


def te_block(args, layer_id: int, fp8=None, params_dtype: torch.dtype = torch.float32, document_mask: bool = False):
    return transformer_layer(layer_id, args.n_layers, fp8=fp8, document_mask=document_mask,
                             params_dtype=params_dtype, hidden_size=args.dim, ffn_hidden_size=args.ffn_dim,
                             num_attention_heads=args.n_heads, num_gqa_groups=args.n_kv_heads,
                             layernorm_epsilon=args.norm_eps, fuse_qkv_params=True, bias=False,
                             activation="swiglu", normalization="RMSNorm")
