"""Transformer Engine Llama block: `te.TransformerLayer` configured as a Llama-3 block.

Subclassing (instead of wrapping) keeps TE's parameter names at the top of the block, so
`layers.<i>.self_attention.layernorm_qkv.weight` is the same name as in the torch backend.
"""
from __future__ import annotations

import contextlib

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


_BLOCK_CLASS = None


def _block_class():
    """The TEBlock class, defined once TE is importable."""
    global _BLOCK_CLASS
    if _BLOCK_CLASS is not None:
        return _BLOCK_CLASS
    import transformer_engine.pytorch as te

    class TEBlock(te.TransformerLayer):
        fp8_disabled = False  # blocks kept in bf16 by fp8.bf16_layers
        fp8_params = False  # weights built as FP8 (QuantizedTensor) by fp8.params
        checkpointed = False  # activation checkpointing through TE's own checkpoint
        # FSDP2 gathers FP8 weights for the forward in row-wise form only and for the backward in
        # column-wise form only when a block reshards after forward; recomputing the forward inside
        # the backward then finds no row-wise data. Such blocks keep their gathered weights instead.
        keep_gathered_for_recompute = False

        def enable_activation_checkpoint(self) -> None:
            self.checkpointed = True
            self.keep_gathered_for_recompute = self.fp8_params

        def forward(self, x: torch.Tensor, angles: torch.Tensor, mask: dict | None = None) -> torch.Tensor:  # type: ignore[override]
            ctx = te.autocast(enabled=False) if self.fp8_disabled else contextlib.nullcontext()
            kwargs = {"rotary_pos_emb": angles, **(mask or {})}
            shape = x.shape
            if mask is not None:  # packed documents: TE's THD layout, one "sequence" per document
                x = x.reshape(-1, shape[-1])
            with ctx:
                if self.checkpointed and torch.is_grad_enabled():
                    out = te.distributed.checkpoint(super().forward, x, use_reentrant=False, **kwargs)
                else:
                    out = super().forward(x, **kwargs)
            return out.view(shape)

    _BLOCK_CLASS = TEBlock
    return TEBlock


def te_block(args, layer_id: int, fp8=None, params_dtype: torch.dtype = torch.float32, document_mask: bool = False):
    keep_bf16 = fp8 is not None and layer_id in fp8.bf16_block_ids(args.n_layers)
    init_ctx = fp8.model_init() if fp8 is not None and not keep_bf16 else contextlib.nullcontext()
    with init_ctx:
        block = _block_class()(
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
            attn_input_format="thd" if document_mask else "bshd",
            params_dtype=params_dtype,
            device="meta",
        )
    block.fp8_disabled = keep_bf16
    block.fp8_params = fp8 is not None and fp8.cfg.params and not keep_bf16
    return block


def te_materialize(model, device) -> None:
    """Allocate meta parameters: TE modules through reset_parameters() (which also quantizes FP8
    weights, shard by shard), everything else through to_empty."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    for module in model.modules():
        if isinstance(module, TransformerEngineBaseModule):
            module.reset_parameters()
    model.to_empty(device=device, recurse=True)


def te_write(target: torch.Tensor, value: torch.Tensor, keep_high_precision: bool = False) -> None:
    """Store an init value in a parameter; FP8 (QuantizedTensor) weights quantize it.

    keep_high_precision (fp8.preserve_high_precision_init): also keep the unquantized value, on the
    CPU, for fused_adam to seed its FP32 master weight from (it drops the copy then)."""
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    if isinstance(target, QuantizedTensor):
        target.quantize_(value.to(torch.float32))
        if keep_high_precision:
            target._high_precision_init = value.detach().to("cpu", torch.float32)
    else:
        target.copy_(value)


def te_document_mask(doc_start: torch.Tensor) -> dict:
    """TE forward arguments that cut the flattened batch into documents (THD cumulative lengths);
    every row also starts a new one."""
    b, s = doc_start.shape
    starts = doc_start.clone()
    starts[:, 0] = True
    cu = torch.nonzero(starts.flatten()).flatten().to(torch.int32)
    cu = torch.cat([cu, cu.new_tensor([b * s])])
    return {"self_attn_mask_type": "padding_causal", "cu_seqlens_q": cu, "cu_seqlens_kv": cu,
            "max_seqlen_q": s, "max_seqlen_kv": s}


BACKENDS.register("te")(BackendSpec(name="te", block=te_block, available=te_unavailable_reason,
                                    materialize=te_materialize, write=te_write, document_mask=te_document_mask,
                                    needs_cuda=True, fp8=True, compiles_blocks=False,
                                    install="pip install --no-build-isolation 'transformer_engine[pytorch]'"))
