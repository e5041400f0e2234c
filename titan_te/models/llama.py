"""Llama 3 family: args, flavors, FLOP count and the model shell around a layer backend.

Blocks come from the layer-backend registry; they all use Transformer Engine's parameter names
(`self_attention.layernorm_qkv.weight`, `layernorm_mlp.fc1_weight`, ...) so a checkpoint moves
between backends unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_te.errors import ConfigError
from titan_te.loss import linear_cross_entropy_sum
from titan_te.models import MODELS, ModelSpec


@dataclass(frozen=True)
class LlamaArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = 128256  # 0: taken from the tokenizer
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling_factor: float = 8.0  # Llama 3.x long-context frequency scaling; 1 disables it
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_pos: int = 8192
    max_seq_len: int = 8192

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, include_embedding: bool = True) -> int:
        hd = self.head_dim
        attn = self.dim * (self.n_heads + 2 * self.n_kv_heads) * hd + self.n_heads * hd * self.dim
        mlp = 3 * self.dim * self.ffn_dim
        block = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim
        return self.n_layers * block + self.dim + emb + (emb if include_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x non-embedding params (incl. the output head) + attention, counted
        over the whole score matrix (torchtitan's count)."""
        return 6 * self.num_params(include_embedding=False) + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """The attention part of flops_per_token: QK^T and PV, forward and backward, every score counted.
        Megatron's tables count causal attention as half of it."""
        return 12 * self.n_layers * self.dim * seq_len


FLAVORS = {
    "debug": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=0,
                       rope_theta=10000.0, rope_scaling_factor=1.0, max_seq_len=2048),
    "1B": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, rope_scaling_factor=32.0),
    "3B": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, rope_scaling_factor=32.0),
    "8B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "70B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
}


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

    fp8 = "off"  # fp8.head: which of the fused head's GEMMs run in FP8 (titan_te/loss.py)

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


def build_llama(args: LlamaArgs, backend: str, document_mask: bool = False, **block_options) -> Llama:
    """block_options (fp8, params_dtype) go to the backend's block builder."""
    from titan_te.layers import BACKENDS

    spec = BACKENDS.get(backend)
    model = Llama(args, lambda a, i: spec.block(a, i, document_mask=document_mask, **block_options),
                  spec.document_mask if document_mask else None)
    fp8 = block_options.get("fp8")
    if fp8 is not None:
        model.output.fp8 = fp8.cfg.head
    return model


def resolve_args(args: LlamaArgs, vocab_size: int, seq_len: int, n_layers: int = 0) -> LlamaArgs:
    """One run's args from a flavor's: vocabulary 0 follows the tokenizer, a larger tokenizer than the
    flavor's embedding is refused, `n_layers` overrides, the RoPE tables cover seq_len."""
    if args.vocab_size == 0:
        args = replace(args, vocab_size=vocab_size)
    elif vocab_size > args.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size:,} ids (padded), but this flavor's embedding and output "
                          f"head have {args.vocab_size:,} rows; use a tokenizer with at most {args.vocab_size:,} ids, "
                          f"or the debug flavor (its vocabulary follows the tokenizer)")
    if n_layers:
        args = replace(args, n_layers=n_layers)
    if seq_len > args.max_seq_len:
        args = replace(args, max_seq_len=seq_len)
    return args


def check(cfg) -> str:
    """Llama's rules on the config: TE's FP8 attention (cuDNN) takes head_dim 128 only."""
    head_dim = FLAVORS[cfg.model.flavor].head_dim
    if cfg.fp8.attention and head_dim != 128:
        return (f"fp8.attention: Transformer Engine's FP8 attention takes head_dim 128 only (cuDNN), the "
                f"{cfg.model.flavor} flavor's is {head_dim}; set --fp8.attention=false")
    return ""


MODELS.register("llama3")(ModelSpec(name="llama3", flavors=FLAVORS, build=build_llama, resolve_args=resolve_args,
                                    hf="titan_te.hf_io", computes_loss=True, fp8_head=True,
                                    fsdp_units=fsdp_units, check=check))
