"""Llama 3's args, flavors and the rules on a run's config that are Llama's own."""
from __future__ import annotations

from dataclasses import dataclass, replace

from titan_te.errors import ConfigError


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
