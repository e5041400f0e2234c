"""Model registry: each entry is a ModelSpec, the whole contract between a model family and the trainer.

A family registers (usually from a module named by `job.custom_import`):
- `flavors`: flavor name -> args; the args answer `num_params()`, `flops_per_token(seq_len)` and carry
  `n_layers`, `dim`, `vocab_size` (checkpoint facts and the start-up summary);
- `resolve_args(flavor_args, vocab_size, seq_len, n_layers)`: the args of one run from its flavor's args
  (the tokenizer's padded vocabulary, the sequence length, an optional block-count override), so another
  family can reuse an architecture with flavors of its own; `args_for(flavor, ...)` calls it;
- `build(args, backend, document_mask=, fp8=, params_dtype=)`: the module, called under the meta
  device; it follows `Model` below; `fp8` is the run's FP8Policy (titan_te/te/policy.py) or None;
- `backends`: the layer backends (titan_te/layers) it has blocks for; model.backend must be one of them
  (None: its modules do not depend on the backend);
- `hf`: an optional Hugging Face adapter (`HFAdapter` below: export and `checkpoint.initial_load_path`),
  None: not offered; models/llama/hf.py is Llama's, tests/tiny_lm_hf.py a small one;
- `computes_loss`: the forward also takes `labels=` and then returns the summed cross-entropy over the
  valid tokens itself (a fused head that never builds the logits); otherwise the trainer computes it
  from the returned logits;
- `fp8_head`: the fused head runs in FP8 when `fp8.head` asks (build receives `fp8=` and reads
  `fp8.head`);
- `fp8_stat_groups`: TE module name -> the group its FP8 statistics are logged under;
- `check(cfg)`: the family's own rules on the config (e.g. a head size some kernel needs), run with the
  config's validation, before anything is built: a problem's text, or "".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn

from titan_te.registry import Registry


class Model(Protocol):
    """What the trainer, FSDP wrapping, activation checkpointing and init ask of a model."""

    args: Any
    layers: nn.ModuleDict  # the repeated blocks: each its own FSDP unit and checkpointing unit

    def init_rule(self, name: str) -> tuple[str, float]:
        """("normal" | "trunc_normal" | "ones" | "zeros", std) for the parameter `name`."""

    def init_buffers(self, device: torch.device) -> None:
        """Fill non-persistent buffers (e.g. RoPE tables) after the parameters are materialized."""

    def __call__(self, tokens: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, seq] token ids -> [batch, seq, vocab] logits (with `labels=` when the spec
        computes_loss: the summed cross-entropy)."""


class HFAdapter(Protocol):
    """A family's Hugging Face adapter."""

    def export_args(self, flavor_args: Any, full_state: dict, seq_len: int) -> Any:
        """The flavor's args sized from a checkpoint's full state (its blocks and vocabulary)."""

    def to_hf(self, full_state: dict, args: Any) -> dict:
        """Our full (unsharded) state -> HF tensor names."""

    def hf_config(self, args: Any, dtype_name: str) -> dict:
        """The HF config.json of a model of `args`."""

    def load_hf_weights(self, model: nn.Module, folder: str, write: Callable | None = None) -> None:
        """An HF folder into a (possibly sharded) model, each rank writing its own shard with `write`."""


def blocks(model) -> list:
    """The default FSDP wrap plan: every repeated block its own unit (the rest stays with the root)."""
    return list(model.layers.values())


@dataclass
class ModelSpec:
    name: str
    flavors: dict[str, Any]  # flavor name -> model args dataclass
    build: Callable[..., Any]  # build(args, backend_name, **kw) -> nn.Module (call under the meta device)
    resolve_args: Callable[[Any, int, int, int], Any]  # (flavor's args, vocab_size, seq_len, n_layers) -> args
    backends: tuple[str, ...] | None = None  # the layer backends it builds blocks for; None: it ignores the backend
    hf: HFAdapter | None = None  # None: no HF export or import
    computes_loss: bool = False  # forward(tokens, labels=...) returns the summed cross-entropy
    fp8_head: bool = False  # its fused head honours fp8.head
    # the FSDP wrap plan: the units in forward order, each a submodule or a list of submodules that share
    # one unit (called as modules, so FSDP's hooks run); the root takes the rest. Data parallelisms that
    # shard receive it. Llama's: embedding, blocks, [norm, output]
    fsdp_units: Callable[[Any], list] = blocks
    check: Callable[[Any], str] | None = None  # check(cfg) -> a problem with the config, or ""
    fp8_stat_groups: dict[str, str] = field(default_factory=dict)

    def args_for(self, flavor: str, vocab_size: int, seq_len: int, n_layers: int = 0):
        """The args of one run of `flavor` (a ConfigError of resolve_args names the flavor)."""
        from titan_te.errors import ConfigError

        try:
            return self.resolve_args(self.flavors[flavor], vocab_size, seq_len, n_layers)
        except ConfigError as e:
            raise ConfigError(f"model.flavor = {flavor!r}: {e.msg}") from None


MODELS: Registry[ModelSpec] = Registry("model")

from titan_te.models import llama  # noqa: E402,F401  (registers llama3)
