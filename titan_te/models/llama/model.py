"""Llama 3: the model shell (embedding, blocks, norm, fused output head), RoPE, and its FSDP wrap plan.

Its blocks, torch_block.py and te_block.py, use Transformer Engine's parameter names
(`self_attention.layernorm_qkv.weight`, `layernorm_mlp.fc1_weight`, ...) so a checkpoint moves
between layer backends unchanged.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_te.models.llama.args import LlamaArgs
from titan_te.models.llama.head import linear_cross_entropy_sum
from titan_te.models.llama.te_block import te_block
from titan_te.models.llama.torch_block import TorchBlock


def rope_angles(args: LlamaArgs, seq_len: int, device=None) -> torch.Tensor:
    """Rotary angles [seq, 1, 1, head_dim] in the non-interleaved (rotate-half) layout TE uses."""
    hd = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float64) / hd))
    if args.rope_scaling_factor != 1.0:  # Llama 3.x: slow the low frequencies, keep the high ones
        low_wl = args.rope_original_max_pos / args.rope_low_freq_factor
        high_wl = args.rope_original_max_pos / args.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (args.rope_original_max_pos / wavelen - args.rope_low_freq_factor) / (
            args.rope_high_freq_factor - args.rope_low_freq_factor)
        scaled = (1 - smooth) * inv / args.rope_scaling_factor + smooth * inv
        inv = torch.where(wavelen > low_wl, inv / args.rope_scaling_factor,
                          torch.where(wavelen < high_wl, inv, scaled))
    t = torch.arange(seq_len, device=device, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    return torch.cat([freqs, freqs], dim=-1).float().view(seq_len, 1, 1, hd)


class OutputHead(nn.Linear):
    """The vocabulary projection; with labels it returns the summed cross-entropy from the fused,
    chunked head instead of the logits (a module of its own, so it can be its own FSDP unit)."""

    fp8 = "off"  # fp8.head: which of the fused head's GEMMs run in FP8 (head.py)

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h).float()
        return linear_cross_entropy_sum(h, self.weight, labels, fp8=self.fp8)


class RMSNorm(nn.RMSNorm):
    """RMSNorm whose weight follows the activations' dtype, as FSDP's parameter cast gives it (under
    autocast an FP32 weight would send rms_norm down its unfused path)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(h, self.normalized_shape, self.weight.to(h.dtype), self.eps)


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs, block_factory, document_mask=None):
        """document_mask: the backend's mask builder when attention must stay inside documents."""
        super().__init__()
        self.args = args
        self.document_mask = document_mask
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by str(i) keeps names stable (layers.<i>.*) when blocks are wrapped.
        self.layers = nn.ModuleDict({str(i): block_factory(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = OutputHead(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_angles(args, args.max_seq_len), persistent=False)

    def init_buffers(self, device) -> None:
        self.rope = rope_angles(self.args, self.args.max_seq_len, device=device)

    def init_rule(self, name: str) -> tuple[str, float]:
        """How the parameter `name` is initialized: (kind, std)."""
        if name.endswith(("layer_norm_weight", "norm.weight")):
            return "ones", 0.0
        if name == "tok_embeddings.weight":
            return "normal", 1.0
        if name == "output.weight":
            return "trunc_normal", self.args.dim ** -0.5
        layer_id = int(name.split(".")[1])
        if name.endswith(("proj.weight", "fc2_weight")):  # residual outputs: depth-scaled
            return "normal", 0.02 / math.sqrt(2 * (layer_id + 1))
        return "normal", 0.02

    def forward(self, tokens: torch.Tensor, doc_start: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, seq] tokens -> [batch, seq, vocab] FP32 logits, or with labels the cross-entropy
        summed over the valid tokens (never building the logits). doc_start [batch, seq] bool marks
        the first token of each packed document (used when the model was built with a document mask)."""
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds max_seq_len {self.args.max_seq_len}")
        h = self.tok_embeddings(tokens)
        if torch.is_autocast_enabled(h.device.type):  # as under FSDP's parameter cast: a bf16 residual stream
            h = h.to(torch.get_autocast_dtype(h.device.type))
        rope = self.rope[:seq]
        mask = None
        if self.document_mask is not None:  # blocks built for packed documents need a mask every time
            if doc_start is None:  # no boundaries given: each row is one document
                doc_start = torch.zeros_like(tokens, dtype=torch.bool)
            mask = self.document_mask(doc_start)
        for block in self.layers.values():
            h = block(h, rope, mask)
        return self.output(self.norm(h), labels)  # module calls: each may be (part of) an FSDP unit


def fsdp_units(model: Llama) -> list:
    """torchtitan's wrap plan: the embedding, every block, then norm + output as one unit. The root then
    holds no parameters, so nothing stays gathered from the first forward to the end of backward (at
    8B: the 1 GiB bf16 embedding)."""
    return [model.tok_embeddings, *model.layers.values(), [model.norm, model.output]]


BLOCKS = {"torch": TorchBlock, "te": te_block}  # layer backend -> Llama's block on it


def build_llama(args: LlamaArgs, backend: str, document_mask: bool = False, **block_options) -> Llama:
    """block_options (fp8: the FP8Policy or None, params_dtype) go to the block builder."""
    from titan_te.layers import BACKENDS

    block = BLOCKS[backend]
    model = Llama(args, lambda a, i: block(a, i, document_mask=document_mask, **block_options),
                  BACKENDS.get(backend).document_mask if document_mask else None)
    fp8 = block_options.get("fp8")
    if fp8 is not None:
        model.output.fp8 = fp8.head
    return model
