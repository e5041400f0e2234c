"""Layer-backend registry: what a layer backend ("torch", "te") brings to every model family.

A family builds its own blocks for each backend it supports (ModelSpec.backends); the backend supplies what
does not depend on the family: whether it runs here, how its modules are materialized and written, the
attention mask of packed documents, what it needs and allows.
"""
from dataclasses import dataclass
from typing import Callable

import torch

from titan_te.registry import Registry
from titan_te.te import layers as te_layers


@dataclass
class BackendSpec:
    name: str
    available: Callable[[], str]  # "" when usable here, else the reason it is not
    materialize: Callable | None = None  # materialize(model, device) after sharding; default to_empty
    write: Callable | None = None  # write(param_local, value) for init; default copy_
    # document_mask(doc_start [batch, seq] bool) -> what the blocks take as `mask` so that attention
    # stays inside each packed document (model.document_mask)
    document_mask: Callable | None = None
    needs_cuda: bool = False  # runs only with training.device = cuda
    fp8: bool = False  # runs linear layers in FP8 (fp8.enable)
    install: str = ""  # how to install what `available()` misses
    compiles_blocks: bool = True  # torch.compile can trace its blocks (else compile.enable does nothing)
    # its blocks can recompute their MLP's first half in the backward (activation_checkpoint.mode = mlp)
    recomputes_mlp: bool = False
    # chooses its attention kernels (model.attention_kernel): a module with missing(kernel), use(kernel),
    # check(kernel, heads, kv_heads, head_dim, device) and ran() (titan_te/te/attention.py)
    attention: object = None


BACKENDS: Registry[BackendSpec] = Registry("layer backend")


def sdpa_document_mask(doc_start: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] bool, True where a query may attend: causal and inside its own document."""
    doc = doc_start.cumsum(1)
    s = doc_start.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_start.device).tril()
    return (doc[:, None, :, None] == doc[:, None, None, :]) & causal


BACKENDS.register("torch")(BackendSpec(name="torch", available=lambda: "", document_mask=sdpa_document_mask))
BACKENDS.register("te")(BackendSpec(name="te", **te_layers.BACKEND))  # Transformer Engine (titan_te/te/layers.py)
