"""The `te` layer backend: TE's TransformerLayer as a block any model family configures, how TE modules are
materialized and written, and TE's packed-document (THD) attention arguments.

A family gives `transformer_layer` the layer's shape and kind (sizes, normalization, activation, bias ...:
TE's own keyword arguments); the block class here adds what every family needs from the trainer: blocks
kept in bf16 (fp8.bf16_layers), activation checkpointing through TE's own checkpoint (of the block, or of
its MLP alone), the THD layout for packed documents. Subclassing (not wrapping) keeps TE's parameter names at
the top of the block.
"""
from __future__ import annotations

import contextlib

import torch

from titan_te.te import attention, tensors


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
        fp8_disabled = False  # a block kept in bf16 by fp8.bf16_layers
        checkpointed = False  # activation checkpointing through TE's own checkpoint

        def enable_activation_checkpoint(self, mlp_only: bool = False) -> None:
            """Recompute the block's forward in its backward (TE's checkpoint), or with `mlp_only` only the MLP's
            norm, FC1 and activation (TE's LayerNormMLP checkpoint: it saves its input, not FC1's output)."""
            if mlp_only:
                self.layernorm_mlp.checkpoint = True
            else:
                self.checkpointed = True

        @property
        def recomputes_forward(self) -> bool:
            """Whether some of the forward runs again in the backward (either kind of checkpointing)."""
            return self.checkpointed or self.layernorm_mlp.checkpoint

        def forward(self, x: torch.Tensor, angles: torch.Tensor | None = None,  # type: ignore[override]
                    mask: dict | None = None) -> torch.Tensor:
            ctx = te.autocast(enabled=False) if self.fp8_disabled else contextlib.nullcontext()
            kwargs = {**({"rotary_pos_emb": angles} if angles is not None else {}), **(mask or {})}
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


def transformer_layer(layer_id: int, n_layers: int, fp8=None, document_mask: bool = False,
                      params_dtype: torch.dtype = torch.float32, **te_kwargs):
    """Block `layer_id` of `n_layers`: TE's TransformerLayer with the family's `te_kwargs`, on the meta device,
    its weights FP8 when the policy `fp8` (an FP8Policy, or None: no FP8) says so for this block."""
    init = fp8.block_init(layer_id, n_layers) if fp8 is not None else contextlib.nullcontext()
    with init:
        block = _block_class()(layer_number=layer_id + 1, hidden_dropout=0.0, attention_dropout=0.0,
                               self_attn_mask_type="causal", attn_input_format="thd" if document_mask else "bshd",
                               params_dtype=params_dtype, device="meta", **te_kwargs)
    block.fp8_disabled = fp8 is not None and fp8.enabled and not fp8.block_fp8(layer_id, n_layers)
    if fp8 is not None:
        fp8.built(block, layer_id, n_layers)
    return block


def te_materialize(model, device) -> None:
    """Allocate meta parameters: TE modules through reset_parameters() (which also quantizes FP8
    weights, shard by shard), everything else through to_empty."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    for module in model.modules():
        if isinstance(module, TransformerEngineBaseModule):
            module.reset_parameters()
    model.to_empty(device=device, recurse=True)


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


# what the `te` layer backend brings to every family (titan_te/layers registers it)
BACKEND = dict(available=te_unavailable_reason, materialize=te_materialize, write=tensors.write,
               document_mask=te_document_mask, needs_cuda=True, fp8=True, compiles_blocks=False, recomputes_mlp=True,
               attention=attention, install="pip install --no-build-isolation 'transformer_engine[pytorch]'")
