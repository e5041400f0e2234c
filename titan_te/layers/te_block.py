"""Transformer Engine Llama block: `te.TransformerLayer` configured as a Llama-3 block.

Subclassing (instead of wrapping) keeps TE's parameter names at the top of the block, so
`layers.<i>.self_attention.layernorm_qkv.weight` is the same name as in the torch backend.
"""
from __future__ import annotations

import torch

from titan_te.layers import BACKENDS, BackendSpec


def te_unavailable_reason() -> str:
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising at import time
        return f"transformer_engine.pytorch cannot be imported ({type(e).__name__}: {e})"
    return ""


def te_block(args, layer_id: int):
    import transformer_engine.pytorch as te

    class TEBlock(te.TransformerLayer):
        def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x, rotary_pos_emb=angles)

    block = TEBlock(
        hidden_size=args.dim,
        ffn_hidden_size=args.ffn_dim,
        num_attention_heads=args.n_heads,
        num_gqa_groups=args.n_kv_heads,
        layernorm_epsilon=args.norm_eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layer_number=layer_id + 1,
        self_attn_mask_type="causal",
        fuse_qkv_params=True,
        bias=False,
        activation="swiglu",
        normalization="RMSNorm",
        attn_input_format="bshd",
        params_dtype=torch.bfloat16,
        device="meta",
    )
    block.layer_id = layer_id
    return block


def te_materialize(model, device) -> None:
    """Allocate meta parameters: TE modules through reset_parameters(), the rest through to_empty."""
    for module in model.modules():
        if hasattr(module, "reset_parameters") and type(module).__module__.startswith("transformer_engine"):
            module.reset_parameters()
    model.to_empty(device=device, recurse=True)


BACKENDS.register("te")(BackendSpec(name="te", block=te_block, available=te_unavailable_reason,
                                    materialize=te_materialize))
